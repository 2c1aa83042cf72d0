"""Admission control of inference requests, per model. Pure: time is a parameter.

Each model runs at most ``max_requests_in_flight`` requests at once; the next
``max_queued_requests`` wait in a FIFO queue, and a request beyond that is refused at once
(the caller answers 429 with ``Retry-After``). A queued request that leaves (its client
disconnected) gives up its place; a request that ends frees its slot for the head of the queue.

``Retry-After`` is an estimate of when a place frees up: the recent time a request of the
model spent in flight (a moving average), divided by the requests that run at once.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from agent.core.errors import AdmissionError, TooManyRequestsError

DEFAULT_MAX_REQUESTS_IN_FLIGHT = 4
DEFAULT_MAX_QUEUED_REQUESTS = 32
DEFAULT_REQUEST_DURATION_S = 5.0  # assumed until a request of the model has finished
DURATION_WEIGHT = 0.2  # weight of the newest duration in the moving average
MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True)
class AdmissionLimits:
    """Per model: requests that run at once (>= 1) and requests that may wait (>= 0)."""

    max_requests_in_flight: int = DEFAULT_MAX_REQUESTS_IN_FLIGHT
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS

    def __post_init__(self) -> None:
        for name, low in (("max_requests_in_flight", 1), ("max_queued_requests", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise AdmissionError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(eq=False)
class AdmissionTicket:
    """One request's place: ``queued``, then ``admitted`` (in flight), then ``done``."""

    model: str
    number: int  # arrival order, over every model
    state: str = "queued"
    admitted_s: float | None = None


@dataclass
class Admission:
    """Slots in flight and FIFO queues of every model."""

    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    _in_flight: dict[str, int] = field(default_factory=dict)
    _queues: dict[str, deque[AdmissionTicket]] = field(default_factory=dict)
    _duration_s: dict[str, float] = field(default_factory=dict)
    _arrivals: int = 0

    def in_flight(self, model: str) -> int:
        return self._in_flight.get(model, 0)

    def queued(self, model: str) -> int:
        return len(self._queues.get(model, ()))

    def arrive(self, model: str, *, now: float) -> AdmissionTicket:
        """A request for ``model``: admitted now, or queued behind the others; raises
        TooManyRequestsError when the queue is full."""
        queue = self._queues.setdefault(model, deque())
        self._arrivals += 1
        ticket = AdmissionTicket(model, self._arrivals)
        if not queue and self.in_flight(model) < self.limits.max_requests_in_flight:
            self._admit(ticket, now)
        elif len(queue) < self.limits.max_queued_requests:
            queue.append(ticket)
        else:
            if not queue:
                del self._queues[model]
            retry_after_s = self.retry_after_s(model)
            raise TooManyRequestsError(
                f"model {model!r} is busy: {self.in_flight(model)} request(s) in flight and {len(queue)} queued, "
                f"the most it takes (max_requests_in_flight={self.limits.max_requests_in_flight}, "
                f"max_queued_requests={self.limits.max_queued_requests}); retry in {retry_after_s} s", retry_after_s)
        return ticket

    def leave(self, ticket: AdmissionTicket, *, now: float) -> list[AdmissionTicket]:
        """``ticket`` is done: served, failed, or its client left while it waited. Returns the
        tickets admitted in its place (the head of the queue, in order)."""
        if ticket.state == "queued":
            queue = self._queues.get(ticket.model)
            if queue is not None and ticket in queue:
                queue.remove(ticket)
        elif ticket.state == "admitted":
            self._in_flight[ticket.model] -= 1
            if ticket.admitted_s is not None:
                self._record(ticket.model, max(0.0, now - ticket.admitted_s))
        ticket.state = "done"
        admitted = []
        queue = self._queues.get(ticket.model)
        while queue and self.in_flight(ticket.model) < self.limits.max_requests_in_flight:
            head = queue.popleft()
            self._admit(head, now)
            admitted.append(head)
        if queue is not None and not queue:
            del self._queues[ticket.model]
        if self._in_flight.get(ticket.model) == 0:
            del self._in_flight[ticket.model]
        return admitted

    def retry_after_s(self, model: str) -> int:
        """Whole seconds until a place is likely to free up for ``model``."""
        duration_s = self._duration_s.get(model, DEFAULT_REQUEST_DURATION_S)
        estimate = math.ceil(duration_s / self.limits.max_requests_in_flight)
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, estimate))

    def _admit(self, ticket: AdmissionTicket, now: float) -> None:
        ticket.state, ticket.admitted_s = "admitted", now
        self._in_flight[ticket.model] = self.in_flight(ticket.model) + 1

    def _record(self, model: str, duration_s: float) -> None:
        previous = self._duration_s.get(model)
        self._duration_s[model] = duration_s if previous is None else (
            (1 - DURATION_WEIGHT) * previous + DURATION_WEIGHT * duration_s)
