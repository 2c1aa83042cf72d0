"""The cluster's event log: joins, deaths, elections, failovers, re-plans and model loads.

Membership, the orchestrator and the router record what happens here; `GET /cluster/events`
streams it (the recent history first) to the dashboard, and :mod:`agent.metrics` counts it.
Each agent keeps its own log; the cluster's is the orchestrator's, which sees every change.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

HISTORY_LENGTH = 200
SUBSCRIBER_QUEUE_LENGTH = 256
KINDS = ("join", "death", "election", "failover", "replan", "degraded", "recovered", "load", "load_failed",
         "unload", "sleep", "evict")


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


class EventLog:
    """The recent events, and queues of the subscribers that read them as they come."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.history: deque[ClusterEvent] = deque(maxlen=HISTORY_LENGTH)
        self._subscribers: set[asyncio.Queue[ClusterEvent]] = set()
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
        for queue in list(self._subscribers):
            if queue.full():
                self._subscribers.discard(queue)  # a reader that stopped reading is dropped
            else:
                queue.put_nowait(event)
        return event

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[asyncio.Queue[ClusterEvent]]:
        """A queue of the recent history, then of every event recorded while subscribed."""
        queue: asyncio.Queue[ClusterEvent] = asyncio.Queue(SUBSCRIBER_QUEUE_LENGTH + len(self.history))
        for event in self.history:
            queue.put_nowait(event)
        self._subscribers.add(queue)
        try:
            yield queue
        finally:
            self._subscribers.discard(queue)
