"""The router's bookkeeping: unit cases of docs/design.md §10 and a stateful property test."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agent.core.errors import CapacityError, ModelLoadError, UnknownModelError
from agent.core.memory_ledger import MIB, DeviceMemory
from agent.core.model_registry import Evict, Load, ModelRegistry, Refuse
from tests.examples import examples

MODELS = ("a", "b", "c", "d")
NODES = ("n1", "n2")


def ready(registry: ModelRegistry, name: str, need: dict[str, int], *, now: float) -> None:
    ticket = registry.join(name)
    assert registry.next_action() == Load(name, measure=True)
    registry.measured(name, need)
    assert registry.next_action() == Load(name, measure=False)
    registry.loaded(name, need, now=now)
    assert ticket.done and ticket.outcome is None
    registry.leave(ticket)


def test_waiters_for_one_model_share_one_entry_and_one_loader():
    registry = ModelRegistry()
    registry.set_models(MODELS)
    tickets = [registry.join("a") for _ in range(50)]
    assert len(registry.queue) == 1 and tickets[0].waiters == 50
    assert registry.next_action() == Load("a", measure=True)
    assert registry.next_action() is None  # claimed: nobody else loads
    registry.measured("a", {"n1": 10})
    assert registry.next_action() == Load("a", measure=False)
    assert registry.next_action() is None
    registry.loaded("a", {"n1": 12}, now=1.0)
    assert all(t.done and t.outcome is None for t in tickets)
    assert registry.entry("a").state == "ready"


def test_seed_example_evicts_the_idle_lru_never_the_busy_one():
    """models_max 2: A busy, B idle and older; C waits -> B is the victim."""
    registry = ModelRegistry(models_max=2)
    registry.set_models(["A", "B", "C"])
    ready(registry, "B", {}, now=90.0)
    ready(registry, "A", {}, now=100.0)
    registry.begin_request("A", now=100.0)
    registry.join("C")
    assert registry.next_action() == Load("C", measure=True)
    registry.measured("C", {})
    assert registry.next_action() == Evict("B", "C")
    assert registry.next_action() is None  # wait until B has gone
    registry.unloaded("B")
    assert registry.next_action() == Load("C", measure=False)


def test_nothing_evictable_refuses_with_retry_after():
    registry = ModelRegistry(models_max=1)
    registry.set_models(["A", "C"])
    ready(registry, "A", {}, now=1.0)
    registry.begin_request("A", now=1.0)
    ticket = registry.join("C")
    registry.next_action()
    registry.measured("C", {})
    action = registry.next_action()
    assert isinstance(action, Refuse) and action.error.retry_after_s
    assert ticket.done and isinstance(ticket.outcome, CapacityError)
    assert "retry later" in str(ticket.outcome)


def test_memory_ledger_counts_external_use_and_margin():
    registry = ModelRegistry(memory_margin_bytes=10)
    registry.set_models(["A", "B"])
    registry.set_devices({"n1": DeviceMemory(total_bytes=100, external_bytes=30)})
    ready(registry, "A", {"n1": 40}, now=1.0)  # 60 usable, 40 held
    registry.join("B")
    registry.next_action()
    registry.measured("B", {"n1": 30})
    assert registry.next_action() == Evict("A", "B")
    registry.unloaded("A")
    assert registry.next_action() == Load("B", measure=False)


def test_a_model_larger_than_any_device_is_refused_without_evicting():
    registry = ModelRegistry()
    registry.set_models(["A", "B"])
    registry.set_devices({"n1": DeviceMemory(total_bytes=100)})
    ready(registry, "A", {"n1": 50}, now=1.0)
    registry.join("B")
    registry.next_action()
    registry.measured("B", {"n1": 101})
    action = registry.next_action()
    assert isinstance(action, Refuse) and action.error.retry_after_s is None
    assert registry.entry("A").state == "ready"


def test_a_waited_for_model_is_never_a_victim_and_a_left_load_completes():
    registry = ModelRegistry(models_max=1)
    registry.set_models(["A", "B"])
    ready(registry, "A", {}, now=1.0)
    waiting_a = registry.join("A")  # e.g. a request that found A stopping
    registry.join("B")
    registry.queue.reverse()  # B at the head, A waited for behind it
    registry.next_action()
    registry.measured("B", {})
    action = registry.next_action()
    assert isinstance(action, Refuse)
    registry.leave(waiting_a)
    ticket = registry.join("B")
    assert registry.next_action() == Evict("A", "B")
    registry.unloaded("A")
    assert registry.next_action() == Load("B", measure=False)
    registry.leave(ticket)  # the only waiter left: the load still completes
    assert registry.queue and registry.queue[0].claimed
    registry.loaded("B", {}, now=2.0)
    assert registry.entry("B").state == "ready" and not registry.queue


def test_failed_load_reaches_the_waiters_and_reload_keeps_loaded_models():
    registry = ModelRegistry()
    registry.set_models(["A", "B"])
    ticket = registry.join("A")
    registry.next_action()
    registry.failed("A", "manifest missing")
    assert isinstance(ticket.outcome, ModelLoadError)
    ready(registry, "B", {}, now=1.0)
    registry.set_models(["C"])
    assert set(registry.entries) == {"B", "C"}  # B stays until it is unloaded
    registry.begin_stop("B")
    registry.unloaded("B")
    assert set(registry.entries) == {"C"}
    with pytest.raises(UnknownModelError, match="known models: C"):
        registry.join("B")


def test_sleep_candidates_are_idle_and_last_use_comes_from_requests_only():
    registry = ModelRegistry()
    registry.set_models(["A"])
    ready(registry, "A", {}, now=0.0)
    registry.begin_request("A", now=5.0)
    assert registry.sleep_candidates(100.0, {"A": 10}) == []  # busy
    registry.end_request("A", now=6.0)
    assert registry.sleep_candidates(15.0, {"A": 10}) == []
    assert registry.sleep_candidates(16.0, {"A": 10}) == ["A"]
    assert registry.begin_stop("A")
    registry.slept("A")
    assert registry.entry("A").state == "sleeping" and registry.ledger.held_bytes("n1") == 0


def test_states_only_go_forward_while_a_load_makes_room():
    """unloaded -> measuring -> loading -> ready, as documented: never back to unloaded between
    the measure and the load, even while an idle model is evicted to make room."""
    registry = ModelRegistry()
    registry.set_models(["A", "B"])
    registry.set_devices({"n1": DeviceMemory(total_bytes=100)})
    ready(registry, "A", {"n1": 60}, now=1.0)
    registry.join("B")
    seen = [registry.entry("B").state]
    assert registry.next_action() == Load("B", measure=True)
    seen.append(registry.entry("B").state)
    registry.measured("B", {"n1": 50})
    seen.append(registry.entry("B").state)
    assert registry.next_action() == Evict("A", "B")
    seen.append(registry.entry("B").state)
    registry.unloaded("A")
    assert registry.next_action() == Load("B", measure=False)
    seen.append(registry.entry("B").state)
    registry.loaded("B", {"n1": 50}, now=2.0)
    seen.append(registry.entry("B").state)
    entered = [b for a, b in zip(seen, seen[1:]) if a != b]
    assert entered == ["measuring", "loading", "ready"], seen


def test_a_measured_model_whose_waiters_leave_goes_back_to_where_it_was():
    registry = ModelRegistry(models_max=1)
    registry.set_models(["A", "B"])
    ready(registry, "A", {}, now=1.0)
    registry.begin_request("A", now=1.0)
    ticket = registry.join("B")
    registry.next_action()
    registry.measured("B", {})
    registry.leave(ticket)
    assert registry.entry("B").state == "unloaded" and not registry.queue


def test_a_model_waiting_for_room_measures_again_when_the_devices_change():
    registry = ModelRegistry()
    registry.set_models(["A", "B"])
    registry.set_devices({"n1": DeviceMemory(total_bytes=100)})
    ready(registry, "A", {"n1": 60}, now=1.0)
    registry.join("B")
    registry.next_action()
    registry.forget_measure("B")  # the measure is under way: kept
    registry.measured("B", {"n1": 50})
    assert registry.next_action() == Evict("A", "B")
    registry.forget_measure("B")  # measured, waiting for room: measured again
    registry.unloaded("A")
    assert registry.next_action() == Load("B", measure=True)
    assert registry.entry("B").state == "measuring" and registry.entry("B").resting_state == "unloaded"
    registry.measured("B", {"n1": 40})
    assert registry.next_action() == Load("B", measure=False)


def test_a_refusal_says_whether_the_state_changed():
    """A refusal right after the measure takes the model back from measuring (a state change);
    a refusal of a model measured before changes no state, and must not be sent as one."""
    registry = ModelRegistry(models_max=1)
    registry.set_models(["A", "B"])
    ready(registry, "A", {}, now=1.0)
    registry.begin_request("A", now=1.0)
    registry.join("B")
    registry.next_action()
    registry.measured("B", {})
    first = registry.next_action()
    assert isinstance(first, Refuse) and first.state_changed and registry.entry("B").state == "unloaded"
    registry.join("B")
    again = registry.next_action()  # measured already: refused at once
    assert isinstance(again, Refuse) and not again.state_changed and registry.entry("B").state == "unloaded"


def test_a_refusal_gives_the_real_reason_when_evicting_the_idle_model_frees_too_little():
    """B is idle but small; C is busy and big: the refusal must not call B busy."""
    registry = ModelRegistry()
    registry.set_models(["B", "C", "D"])
    registry.set_devices({"n1": DeviceMemory(total_bytes=100 * MIB)})
    ready(registry, "B", {"n1": 20 * MIB}, now=1.0)
    ready(registry, "C", {"n1": 60 * MIB}, now=2.0)
    registry.begin_request("C", now=2.0)
    ticket = registry.join("D")
    registry.next_action()
    registry.measured("D", {"n1": 50 * MIB})
    action = registry.next_action()
    assert isinstance(action, Refuse) and action.error.retry_after_s
    message = str(ticket.outcome)
    assert "needs 50 MiB on node n1, which has 20 MiB free" in message
    assert "evicting the idle model B would free only 20 MiB more" in message
    assert "the rest is held by C (60 MiB, serving 1 request)" in message
    assert "B (" not in message.split("the rest is held by")[1]  # the idle model is not called busy
    assert "retry later" in message


def test_a_refusal_at_models_max_names_why_each_model_stays():
    registry = ModelRegistry(models_max=2)
    registry.set_models(["A", "B", "C"])
    ready(registry, "A", {}, now=1.0)
    ready(registry, "B", {}, now=2.0)
    registry.begin_request("A", now=3.0)
    registry.begin_request("A", now=3.0)
    registry.join("B")  # waited for: a request found it stopping
    registry.join("C")
    registry.queue.reverse()
    registry.next_action()
    registry.measured("C", {})
    action = registry.next_action()
    assert isinstance(action, Refuse)
    assert "models_max=2 is reached by models that cannot be evicted: A (serving 2 requests), " \
           "B (requests wait for it)" in str(action.error)


def test_reset_hands_every_waiter_the_error():
    registry = ModelRegistry()
    registry.set_models(["A", "B"])
    tickets = [registry.join("A"), registry.join("B")]
    registry.next_action()
    registry.reset(ModelLoadError("no longer the orchestrator"))
    assert all(t.done and isinstance(t.outcome, ModelLoadError) for t in tickets)
    assert not registry.entries and not registry.queue


class RouterMachine(RuleBasedStateMachine):
    """Drives the bookkeeping like the adapter does; checks the promises of the router."""

    def __init__(self) -> None:
        super().__init__()
        self.registry = ModelRegistry(models_max=2, memory_margin_bytes=5)
        self.registry.set_models(MODELS)
        self.registry.set_devices({"n1": DeviceMemory(100, 10), "n2": DeviceMemory(80, 0)})
        self.tickets: list = []
        self.in_flight: dict[str, bool] = {}  # model -> measure? (the loaders running)
        self.evicting: set[str] = set()
        self.stopping: set[str] = set()
        self.needs: dict[str, dict[str, int]] = {}
        self.now = 0.0

    def _tick(self) -> None:
        action = self.registry.next_action()
        if isinstance(action, Load):
            assert action.model not in self.in_flight, "two loaders for one model"
            entry = self.registry.entry(action.model)
            if not action.measure:
                for node, need in (entry.min_bytes or {}).items():
                    held = self.registry.ledger.held_bytes(node, without=[action.model])
                    budget = self.registry.ledger.budget_bytes(node)
                    assert budget is None or held + need <= budget, "over-committed a device"
                assert self.registry.ledger.loaded_count() <= self.registry.ledger.models_max
            self.in_flight[action.model] = action.measure
        elif isinstance(action, Evict):
            victim = self.registry.entry(action.victim)
            assert victim.active_requests == 0, "evicted a busy model"
            assert self.registry.find(action.victim) is None, "evicted a waited-for model"
            assert victim.state == "ready" and action.victim not in self.in_flight
            self.evicting.add(action.victim)

    @rule(model=st.sampled_from(MODELS))
    def request(self, model):
        if model not in self.registry.entries:
            return
        entry = self.registry.entry(model)
        if entry.state == "ready" and not entry.stopping:
            self.registry.begin_request(model, now=self.now)
        else:
            self.tickets.append(self.registry.join(model))
        self._tick()

    @precondition(lambda self: self.tickets)
    @rule(data=st.data())
    def waiter_leaves(self, data):
        ticket = self.tickets.pop(data.draw(st.integers(0, len(self.tickets) - 1)))
        self.registry.leave(ticket)
        self._tick()

    @precondition(lambda self: any(e.active_requests for e in self.registry.entries.values()))
    @rule(data=st.data())
    def request_ends(self, data):
        busy = sorted(n for n, e in self.registry.entries.items() if e.active_requests)
        self.registry.end_request(data.draw(st.sampled_from(busy)), now=self.now)
        self._tick()

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), ok=st.booleans())
    def loader_finishes(self, data, ok):
        model = data.draw(st.sampled_from(sorted(self.in_flight)))
        measure = self.in_flight.pop(model)
        if not ok:
            self.registry.failed(model, "boom")
        elif measure:
            need = self.needs.setdefault(model, {n: data.draw(st.integers(0, 60)) for n in NODES})
            self.registry.measured(model, need)
        else:
            need = self.registry.entry(model).min_bytes or {}
            self.registry.loaded(model, {n: max(0, v - data.draw(st.integers(0, 5))) for n, v in need.items()},
                                 now=self.now)
        self._tick()

    @precondition(lambda self: self.evicting or self.stopping)
    @rule()
    def stop_finishes(self):
        for model in sorted(self.evicting):
            self.registry.unloaded(model)
        for model in sorted(self.stopping):
            self.registry.slept(model)
        self.evicting.clear()
        self.stopping.clear()
        self._tick()

    @rule(seconds=st.floats(0.5, 30))
    def time_passes(self, seconds):
        self.now += seconds
        for model in self.registry.sleep_candidates(self.now, {m: 20.0 for m in MODELS}):
            assert self.registry.entry(model).active_requests == 0
            if self.registry.begin_stop(model):
                self.stopping.add(model)
        self._tick()

    @rule(model=st.sampled_from(MODELS), reason=st.sampled_from(["node n2 died", "worker exited with status -9"]))
    def crash(self, model, reason):
        entry = self.registry.entries.get(model)
        if entry is None or entry.state not in ("ready", "loading"):
            return
        self.in_flight.pop(model, None)
        self.evicting.discard(model)
        self.stopping.discard(model)
        self.registry.failed(model, reason)
        assert self.registry.ledger.held_bytes("n1", without=[m for m in MODELS if m != model]) == 0
        self._tick()

    @rule(model=st.sampled_from(MODELS))
    def devices_change(self, model):
        self.registry.forget_measure(model)
        self._tick()

    @rule(names=st.sets(st.sampled_from(MODELS), min_size=1))
    def reload(self, names):
        self.registry.set_models(names)
        self._tick()

    @invariant()
    def never_over_models_max(self):
        assert self.registry.ledger.loaded_count() <= self.registry.ledger.models_max

    @invariant()
    def only_the_head_is_claimed(self):
        assert all(not q.claimed for q in self.registry.queue[1:])
        assert len({q.model for q in self.registry.queue}) == len(self.registry.queue)

    @invariant()
    def a_measuring_model_is_waited_for(self):
        for entry in self.registry.entries.values():
            if entry.state == "measuring":
                assert self.registry.find(entry.name) is not None, f"{entry.name} measuring outside the queue"
            assert entry.resting_state != "measuring"

    @invariant()
    def ledger_matches_states(self):
        for entry in self.registry.entries.values():
            if entry.state not in ("loading", "ready"):
                assert not entry.held_bytes()


TestRouterMachine = RouterMachine.TestCase
TestRouterMachine.settings = settings(max_examples=examples(300), stateful_step_count=40, deadline=None)


def test_the_requests_a_loaded_model_runs_at_once_follow_the_room_its_ledger_leaves():
    """The router's count for max_requests_in_flight 0 (MemoryLedger.sessions_fitting): the
    room beside every loaded model, which is not held for it, and counted again beside a
    model loaded later."""
    registry = ModelRegistry()
    registry.set_models(MODELS)
    registry.set_devices({"n1": DeviceMemory(1000 * MIB), "n2": DeviceMemory(400 * MIB)})
    ready(registry, "a", {"n1": 100 * MIB, "n2": 100 * MIB}, now=1.0)
    sessions = {"n1": 50 * MIB, "n2": 100 * MIB}
    assert registry.ledger.sessions_fitting(sessions, 8) == 1 + 300 // 100  # n2's room: 3 more caches of 100 MiB
    assert registry.entry("a").held_bytes() == {"n1": 100 * MIB, "n2": 100 * MIB}  # the room is not held
    ready(registry, "b", {"n2": 200 * MIB}, now=3.0)
    registry.update_effective("a", {"n1": 100 * MIB, "n2": 100 * MIB})
    assert registry.ledger.sessions_fitting(sessions, 8) == 2  # a new plan counts again, beside b
