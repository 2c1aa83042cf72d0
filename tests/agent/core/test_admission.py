"""Admission control per model: slots in flight, a bounded queue, 429 beyond it, and every
client's share of both."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agent.core.admission import (
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_MAX_REQUESTS_IN_FLIGHT,
    MAX_RETRY_AFTER_S,
    Admission,
    AdmissionLimits,
)
from agent.core.errors import AdmissionError, RouterError, TooManyRequestsError
from tests.examples import examples


def test_defaults_and_validation():
    limits = AdmissionLimits()
    assert (limits.max_requests_in_flight, limits.max_queued_requests) == (
        DEFAULT_MAX_REQUESTS_IN_FLIGHT, DEFAULT_MAX_QUEUED_REQUESTS) == (4, 32)
    for bad in ({"max_requests_in_flight": 0}, {"max_queued_requests": -1}, {"max_requests_in_flight": True},
                {"max_queued_requests": 1.5}):
        with pytest.raises(AdmissionError, match=next(iter(bad))):
            AdmissionLimits(**bad)
    assert issubclass(TooManyRequestsError, RouterError)


def test_one_in_flight_one_queued_the_third_is_refused_with_retry_after():
    admission = Admission(AdmissionLimits(max_requests_in_flight=1, max_queued_requests=1))
    first = admission.arrive("m", now=0.0, client="a")
    second = admission.arrive("m", now=0.1, client="b")
    assert (first.state, second.state) == ("admitted", "queued")
    with pytest.raises(TooManyRequestsError) as refused:
        admission.arrive("m", now=0.2, client="c")
    assert refused.value.retry_after_s >= 1
    assert "max_requests_in_flight=1" in str(refused.value) and "max_queued_requests=1" in str(refused.value)
    assert admission.leave(first, now=4.0) == [second]
    assert second.state == "admitted" and admission.in_flight("m") == 1 and admission.queued("m") == 0
    assert admission.leave(second, now=5.0) == [] and admission.in_flight("m") == 0


def test_the_queue_is_fifo_and_a_request_that_leaves_gives_up_its_place():
    admission = Admission(AdmissionLimits(max_requests_in_flight=2, max_queued_requests=10))
    running = [admission.arrive("m", now=0.0, client=f"r{i}") for i in range(2)]
    queued = [admission.arrive("m", now=float(i), client=f"q{i}") for i in range(5)]
    assert admission.leave(queued[1], now=6.0) == []  # its client disconnected
    assert queued[1].state == "done" and admission.queued("m") == 4
    admitted = admission.leave(running[0], now=7.0) + admission.leave(running[1], now=7.0)
    assert admitted == [queued[0], queued[2]]
    assert admission.leave(queued[0], now=8.0) == [queued[3]]
    assert admission.leave(queued[3], now=8.0) == [queued[4]]


def test_models_are_admitted_independently():
    admission = Admission(AdmissionLimits(max_requests_in_flight=1, max_queued_requests=0))
    a = admission.arrive("a", now=0.0, client="x")
    b = admission.arrive("b", now=0.0, client="x")
    assert a.state == b.state == "admitted"
    with pytest.raises(TooManyRequestsError, match="'a'"):
        admission.arrive("a", now=0.0, client="y")  # no queue: refused at once


def test_retry_after_follows_the_time_requests_spend_in_flight():
    admission = Admission(AdmissionLimits(max_requests_in_flight=2, max_queued_requests=0))
    assert admission.retry_after_s("m") == 3  # 5 s assumed before any request ended, over 2 slots
    for _ in range(30):
        ticket = admission.arrive("m", now=0.0, client="x")
        admission.leave(ticket, now=40.0)
    assert admission.retry_after_s("m") == 20
    for _ in range(30):
        ticket = admission.arrive("m", now=0.0, client="x")
        admission.leave(ticket, now=1000.0)
    assert admission.retry_after_s("m") == MAX_RETRY_AFTER_S
    admission.leave(admission.arrive("n", now=0.0, client="x"), now=0.001)
    assert admission.retry_after_s("n") == 1


def test_one_client_cannot_take_every_slot_and_the_queue():
    """Six streams of one app hold all but one slot and half the queue: a seventh request,
    of another client, runs at once; the app's own extra requests wait or are refused."""
    admission = Admission(AdmissionLimits(max_requests_in_flight=4, max_queued_requests=4))
    app = [admission.arrive("m", now=float(i), client="10.0.0.5") for i in range(5)]
    assert [t.state for t in app] == ["admitted"] * 3 + ["queued"] * 2
    with pytest.raises(TooManyRequestsError, match="this client"):
        admission.arrive("m", now=5.0, client="10.0.0.5")  # its share of the queue (half) is used
    neighbour = admission.arrive("m", now=6.0, client="10.0.0.9")
    assert neighbour.state == "admitted" and admission.in_flight("m") == 4
    late = admission.arrive("m", now=7.0, client="10.0.0.7")
    assert late.state == "queued"
    # a freed slot goes to the client holding the fewest, before the app's older requests
    assert admission.leave(app[0], now=8.0) == [late]
    assert admission.leave(neighbour, now=9.0) == [app[3]]


def test_shares_can_be_set_and_never_exceed_the_model_limits():
    limits = AdmissionLimits(max_requests_in_flight=4, max_queued_requests=8)
    assert (limits.client_in_flight, limits.client_queued) == (3, 4)
    assert AdmissionLimits(max_requests_in_flight=1, max_queued_requests=0).client_in_flight == 1
    assert AdmissionLimits(max_requests_in_flight=1, max_queued_requests=0).client_queued == 0
    custom = AdmissionLimits(max_requests_in_flight=4, max_queued_requests=8, max_in_flight_per_client=9,
                             max_queued_per_client=2)
    assert (custom.client_in_flight, custom.client_queued) == (4, 2)
    with pytest.raises(AdmissionError, match="max_in_flight_per_client"):
        AdmissionLimits(max_in_flight_per_client=-1)


class AdmissionMachine(RuleBasedStateMachine):
    """Arrivals of three clients, ends and disconnections in any order: the limits and every
    client's share hold, no slot stays free while a request that may take it waits, and each
    client's requests start in the order they came."""

    LIMITS = AdmissionLimits(max_requests_in_flight=2, max_queued_requests=3)

    def __init__(self) -> None:
        super().__init__()
        self.admission = Admission(self.LIMITS)
        self.tickets: list = []
        self.now = 0.0
        self.admitted_order: list[int] = []

    @rule(model=st.sampled_from(["a", "b"]), client=st.sampled_from(["x", "y", "z"]))
    def arrive(self, model, client):
        self.now += 1
        try:
            ticket = self.admission.arrive(model, now=self.now, client=client)
        except TooManyRequestsError as error:
            waiting = sum(t.model == model and t.client == client and t.state == "queued" for t in self.tickets)
            assert self.admission.queued(model) == 3 or waiting == self.LIMITS.client_queued
            assert error.retry_after_s >= 1
            return
        self.tickets.append(ticket)
        if ticket.state == "admitted":
            self.admitted_order.append(ticket.number)

    @precondition(lambda self: self.tickets)
    @rule(data=st.data())
    def leave(self, data):
        self.now += 1
        ticket = self.tickets.pop(data.draw(st.integers(0, len(self.tickets) - 1)))
        for admitted in self.admission.leave(ticket, now=self.now):
            self.admitted_order.append(admitted.number)

    def held(self, model, client, state="admitted"):
        return sum(t.model == model and t.client == client and t.state == state for t in self.tickets)

    @invariant()
    def limits_and_shares_hold(self):
        for model in ("a", "b"):
            assert self.admission.in_flight(model) <= 2 and self.admission.queued(model) <= 3
            live = [t for t in self.tickets if t.model == model]
            assert self.admission.in_flight(model) == sum(t.state == "admitted" for t in live)
            assert self.admission.queued(model) == sum(t.state == "queued" for t in live)
            for client in ("x", "y", "z"):
                assert self.held(model, client) <= self.LIMITS.client_in_flight
                assert self.held(model, client, "queued") <= self.LIMITS.client_queued
                # a request waits only while no slot is free or its client holds its share
                if self.held(model, client, "queued"):
                    assert (self.admission.in_flight(model) == 2
                            or self.held(model, client) == self.LIMITS.client_in_flight)

    @invariant()
    def each_clients_requests_start_in_order(self):
        for model in ("a", "b"):
            for client in ("x", "y", "z"):
                mine = [t for t in self.tickets if t.model == model and t.client == client]
                queued = [t.number for t in mine if t.state == "queued"]
                admitted = [t.number for t in mine if t.state == "admitted"]
                assert not queued or not admitted or max(admitted) < min(queued)


TestAdmissionMachine = AdmissionMachine.TestCase
TestAdmissionMachine.settings = settings(max_examples=examples(200), stateful_step_count=40, deadline=None)


def test_a_models_own_count_admits_the_waiting_when_it_rises_and_lets_the_running_finish_when_it_falls():
    admission = Admission(AdmissionLimits(max_requests_in_flight=1, max_queued_requests=10))
    first = admission.arrive("m", now=0.0, client="a")
    waiting = [admission.arrive("m", now=0.0, client=c) for c in ("b", "c", "d")]
    other = admission.arrive("n", now=0.0, client="a")
    assert first.state == other.state == "admitted" and all(t.state == "queued" for t in waiting)
    assert admission.set_in_flight("m", 3, now=1.0) == waiting[:2]  # the loaded model's count, from its KV memory
    assert admission.limits_of("m").max_requests_in_flight == 3 and admission.limits_of("n") == admission.limits
    assert admission.limits_of("m").client_in_flight == 2  # the client shares follow the count
    assert admission.set_in_flight("m", 1, now=2.0) == []  # lower: the three in flight go on
    assert admission.in_flight("m") == 3 and waiting[2].state == "queued"
    assert admission.leave(first, now=3.0) == [] and admission.leave(waiting[0], now=3.0) == []
    assert admission.leave(waiting[1], now=3.0) == [waiting[2]]
    assert admission.arrive("n", now=4.0, client="b").state == "queued"  # another model keeps the config's count
