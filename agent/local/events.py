"""The cluster's event log: joins, deaths, elections, failovers, re-plans and model loads.

Membership, the orchestrator and the router record what happens here; `GET /cluster/events`
streams it (the recent history first) to the dashboard, and :mod:`agent.local.metrics` counts it.
Each agent keeps its own log; the cluster's is the orchestrator's, which sees every change.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")

HISTORY_LENGTH = 200
SUBSCRIBER_QUEUE_LENGTH = 256
KINDS = ("join", "death", "election", "failover", "replan", "degraded", "recovered", "load", "load_failed",
         "unload", "sleep", "evict", "corrupt")


@dataclass(frozen=True)
class ClusterEvent:
    kind: str
    message: str
    time_s: float  # Unix time
    node: str | None = None
    model: str | None = None
    duration_s: float | None = None  # what the change took (a load, a failover), when measured

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown cluster event kind {self.kind!r}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Fanout(Generic[T]):
    """Items sent to every subscriber's queue as they come; a subscriber that stops reading (its
    queue full) is dropped, so a slow reader never holds the sender up."""

    def __init__(self, queue_length: int = SUBSCRIBER_QUEUE_LENGTH) -> None:
        self._queue_length = queue_length
        self._subscribers: set[asyncio.Queue[T]] = set()

    def __bool__(self) -> bool:
        """Whether anyone is subscribed (so a sender can skip building what nobody reads)."""
        return bool(self._subscribers)

    def send(self, item: T) -> None:
        for queue in list(self._subscribers):
            if queue.full():
                self._subscribers.discard(queue)  # a reader that stopped reading is dropped
            else:
                queue.put_nowait(item)

    @contextlib.contextmanager
    def subscribe(self, backlog: Iterable[T] = ()) -> Iterator[asyncio.Queue[T]]:
        """A queue of ``backlog``, then of every item sent while subscribed."""
        first = list(backlog)
        queue: asyncio.Queue[T] = asyncio.Queue(self._queue_length + len(first))
        for item in first:
            queue.put_nowait(item)
        self._subscribers.add(queue)
        try:
            yield queue
        finally:
            self._subscribers.discard(queue)


class EventLog:
    """The recent events, and queues of the subscribers that read them as they come."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.history: deque[ClusterEvent] = deque(maxlen=HISTORY_LENGTH)
        self._subscribers: Fanout[ClusterEvent] = Fanout()
        self._listeners: list[Callable[[ClusterEvent], None]] = []

    def listen(self, listener: Callable[[ClusterEvent], None]) -> None:
        """Call ``listener`` with every event recorded from now on (the metrics count them)."""
        self._listeners.append(listener)

    def record(self, kind: str, message: str, *, node: str | None = None, model: str | None = None,
               duration_s: float | None = None) -> ClusterEvent:
        event = ClusterEvent(kind, message, self._clock(), node, model, duration_s)
        self.history.append(event)
        for listener in self._listeners:
            listener(event)
        self._subscribers.send(event)
        return event

    def subscribe(self) -> contextlib.AbstractContextManager[asyncio.Queue[ClusterEvent]]:
        """A queue of the recent history, then of every event recorded while subscribed."""
        return self._subscribers.subscribe(self.history)
