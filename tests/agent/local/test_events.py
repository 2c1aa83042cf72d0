"""agent.local.events: cluster events are of known kinds only and come out as JSON whole; a
Fanout gives each subscriber its backlog, then every item in order, and drops a subscriber
that stopped reading without holding the sender up; the EventLog keeps a bounded history,
calls its listeners with each event and feeds its subscribers (also a reader in another task)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.local.compat import timeout
from agent.local.events import HISTORY_LENGTH, KINDS, SUBSCRIBER_QUEUE_LENGTH, ClusterEvent, EventLog, Fanout

OPTIONAL_TEXT = st.none() | st.text(max_size=20)
events = st.builds(ClusterEvent, kind=st.sampled_from(KINDS), message=st.text(max_size=40),
                   time_s=st.floats(0, 4e9), node=OPTIONAL_TEXT, model=OPTIONAL_TEXT,
                   duration_s=st.none() | st.floats(0, 1e6))


def drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@given(events)
def test_an_event_is_json_whole_and_rebuilt_from_it(event: ClusterEvent) -> None:
    shape = event.to_json()
    assert set(shape) == {"kind", "message", "time_s", "node", "model", "duration_s"}
    assert ClusterEvent(**json.loads(json.dumps(shape))) == event


@given(st.text(max_size=12).filter(lambda kind: kind not in KINDS))
def test_an_event_of_an_unknown_kind_is_refused(kind: str) -> None:
    with pytest.raises(ValueError, match="unknown cluster event kind"):
        ClusterEvent(kind, "something", 1.0)


def test_an_event_cannot_be_changed_once_made() -> None:
    event = ClusterEvent("join", "peer b is alive", 5.0, node="b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.kind = "death"  # type: ignore[misc]


def test_a_fanout_is_true_only_while_someone_is_subscribed() -> None:
    fanout: Fanout[int] = Fanout()
    assert not fanout
    with fanout.subscribe():
        assert fanout
        with fanout.subscribe():
            assert fanout
        assert fanout
    assert not fanout
    fanout.send(1)  # nobody to send to: nothing happens


def test_each_subscriber_gets_its_backlog_then_what_is_sent_while_subscribed_in_order() -> None:
    fanout: Fanout[str] = Fanout()
    fanout.send("before anyone")
    with fanout.subscribe(["old-1", "old-2"]) as first:
        fanout.send("a")
        with fanout.subscribe() as second:
            fanout.send("b")
            fanout.send("c")
        fanout.send("d")  # second has left
        assert drain(first) == ["old-1", "old-2", "a", "b", "c", "d"]
        assert drain(second) == ["b", "c"]


def test_a_subscriber_that_stopped_reading_is_dropped_and_the_others_get_everything() -> None:
    fanout: Fanout[int] = Fanout(queue_length=3)
    with fanout.subscribe() as stalled, fanout.subscribe() as reader:
        received = []
        for n in range(10):
            fanout.send(n)  # never blocks, never raises
            received.extend(drain(reader))
        assert received == list(range(10))
        assert drain(stalled) == [0, 1, 2]  # what fitted; dropped at the fourth
        fanout.send(10)
        assert stalled.empty()  # once dropped, it gets nothing more even after it read up
        assert drain(reader) == [10]


def test_a_long_backlog_does_not_count_against_the_room_for_new_items() -> None:
    fanout: Fanout[int] = Fanout(queue_length=2)
    with fanout.subscribe(range(100, 105)) as queue:
        fanout.send(1)
        fanout.send(2)
        fanout.send(3)  # the third new item finds the queue full: the subscriber is dropped
        assert drain(queue) == [100, 101, 102, 103, 104, 1, 2]


def test_recorded_events_carry_the_clock_time_and_go_to_the_history() -> None:
    clock = Clock(1000.0)
    log = EventLog(clock=clock)
    first = log.record("join", "peer b is alive", node="b")
    clock.now = 1002.5
    second = log.record("load", "loaded m", model="m", duration_s=1.25)
    assert first == ClusterEvent("join", "peer b is alive", 1000.0, node="b")
    assert second == ClusterEvent("load", "loaded m", 1002.5, model="m", duration_s=1.25)
    assert list(log.history) == [first, second]


def test_an_event_of_an_unknown_kind_is_not_recorded_nor_told_to_anyone() -> None:
    log = EventLog(clock=Clock(1.0))
    told: list[ClusterEvent] = []
    log.listen(told.append)
    with log.subscribe() as queue:
        with pytest.raises(ValueError):
            log.record("explosion", "no such kind")
        assert not log.history and not told and queue.empty()


def test_the_history_keeps_only_the_latest_events() -> None:
    log = EventLog(clock=Clock(1.0))
    for n in range(HISTORY_LENGTH + 25):
        log.record("replan", f"replan {n}", model="m")
    assert len(log.history) == HISTORY_LENGTH
    assert log.history[0].message == "replan 25" and log.history[-1].message == f"replan {HISTORY_LENGTH + 24}"


def test_listeners_are_called_in_order_with_each_event_before_record_returns() -> None:
    log = EventLog(clock=Clock(1.0))
    calls: list[tuple[str, str]] = []
    log.listen(lambda event: calls.append(("first", event.message)))
    log.record("election", "before the second listener")
    log.listen(lambda event: calls.append(("second", event.message)))
    log.record("death", "peer c is dead", node="c")
    assert calls == [("first", "before the second listener"), ("first", "peer c is dead"),
                     ("second", "peer c is dead")]


def test_a_subscriber_reads_the_history_then_events_as_they_are_recorded() -> None:
    log = EventLog(clock=Clock(1.0))
    old = [log.record("join", f"peer {n} is alive", node=str(n)) for n in range(3)]
    with log.subscribe() as queue:
        new = log.record("election", "orchestrator is 0", node="0")
        assert drain(queue) == [*old, new]
    log.record("death", "after unsubscribing")
    assert queue.empty()


def test_a_stalled_subscriber_is_dropped_while_the_history_and_listeners_go_on() -> None:
    log = EventLog(clock=Clock(1.0))
    counted: list[ClusterEvent] = []
    log.listen(counted.append)
    with log.subscribe() as stalled:
        for n in range(SUBSCRIBER_QUEUE_LENGTH + 10):
            log.record("load", f"load {n}", model="m")
        assert stalled.qsize() == SUBSCRIBER_QUEUE_LENGTH
        assert [e.message for e in drain(stalled)] == [f"load {n}" for n in range(SUBSCRIBER_QUEUE_LENGTH)]
        log.record("unload", "after the drop", model="m")
        assert stalled.empty()
    assert len(counted) == SUBSCRIBER_QUEUE_LENGTH + 11
    assert log.history[-1].message == "after the drop"


def test_a_reader_task_receives_every_event_recorded_by_another_task_in_order() -> None:
    async def scenario() -> list[str]:
        log = EventLog(clock=Clock(1.0))
        log.record("join", "already there", node="a")
        received: list[str] = []
        subscribed = asyncio.Event()

        async def reader() -> None:
            with log.subscribe() as queue:
                subscribed.set()
                while True:
                    event = await queue.get()
                    received.append(event.message)
                    if event.kind == "death":
                        return

        async def writer() -> None:
            await subscribed.wait()
            for n in range(50):
                log.record("replan", f"replan {n}", model="m")
                if n % 7 == 0:
                    await asyncio.sleep(0)  # the reader runs between some of them
            log.record("death", "the end", node="a")

        async with timeout(10.0):
            await asyncio.gather(reader(), writer())
        return received

    assert asyncio.run(scenario()) == ["already there", *(f"replan {n}" for n in range(50)), "the end"]
