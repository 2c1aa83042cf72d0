"""Admission control of inference requests, per model. Pure: time is a parameter.

Each model runs at most ``max_requests_in_flight`` requests at once (its own count once set,
:meth:`Admission.set_in_flight`: the router's, from the memory its KV cache needs); the next
``max_queued_requests`` wait in a queue, and a request beyond that is refused at once
(the caller answers 429 with ``Retry-After``). A queued request that leaves (its client
disconnected) gives up its place; a request that ends frees its slot for a waiting one.

Every request belongs to a client (its API key, else its address). No client holds every
slot of a model: one holds at most ``max_in_flight_per_client`` (default: all slots but one)
and waits with at most ``max_queued_per_client`` (default: half the queue), so a household
member's request is served while another app streams six answers at once. A freed slot goes
to the waiting request whose client holds the fewest slots, the oldest first among equals.

``Retry-After`` is an estimate of when a place frees up: the recent time a request of the
model spent in flight (a moving average), divided by the requests that run at once.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace

from agent.core.errors import AdmissionError, TooManyRequestsError

DEFAULT_MAX_REQUESTS_IN_FLIGHT = 4  # a model's count until it is set (it is loading)
AUTO_MOST_REQUESTS_IN_FLIGHT = 8  # the most a count set from the KV memory reaches
DEFAULT_MAX_QUEUED_REQUESTS = 32
DEFAULT_REQUEST_DURATION_S = 5.0  # assumed until a request of the model has finished
DURATION_WEIGHT = 0.2  # weight of the newest duration in the moving average
MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True)
class AdmissionLimits:
    """Per model: requests that run at once (>= 1) and requests that may wait (>= 0); per
    client of a model, the same two (0: the defaults the module docstring gives)."""

    max_requests_in_flight: int = DEFAULT_MAX_REQUESTS_IN_FLIGHT
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    max_in_flight_per_client: int = 0
    max_queued_per_client: int = 0

    def __post_init__(self) -> None:
        for name, low in (("max_requests_in_flight", 1), ("max_queued_requests", 0), ("max_in_flight_per_client", 0),
                          ("max_queued_per_client", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise AdmissionError(f"{name} must be an integer >= {low}, got {value!r}")

    @property
    def client_in_flight(self) -> int:
        """The slots of a model one client may hold at once."""
        default = max(1, self.max_requests_in_flight - 1)
        return min(self.max_in_flight_per_client or default, self.max_requests_in_flight)

    @property
    def client_queued(self) -> int:
        """The requests of one client that may wait for a model."""
        default = max(1, self.max_queued_requests // 2) if self.max_queued_requests else 0
        return min(self.max_queued_per_client or default, self.max_queued_requests)


@dataclass(eq=False)
class AdmissionTicket:
    """One request's place: ``queued``, then ``admitted`` (in flight), then ``done``."""

    model: str
    client: str
    number: int  # arrival order, over every model
    state: str = "queued"
    admitted_s: float | None = None


@dataclass
class Admission:
    """Slots in flight and queues of every model, and what each client holds of them."""

    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    _in_flight: dict[str, int] = field(default_factory=dict)
    _queues: dict[str, list[AdmissionTicket]] = field(default_factory=dict)
    _held: Counter[tuple[str, str]] = field(default_factory=Counter)  # (model, client) -> slots in flight
    _duration_s: dict[str, float] = field(default_factory=dict)
    _arrivals: int = 0
    _model_limits: dict[str, AdmissionLimits] = field(default_factory=dict)  # models with their own count

    def limits_of(self, model: str) -> AdmissionLimits:
        return self._model_limits.get(model, self.limits)

    def set_in_flight(self, model: str, max_requests_in_flight: int, *, now: float) -> list[AdmissionTicket]:
        """``model`` runs at most ``max_requests_in_flight`` requests at once from now on (the
        client shares follow); requests in flight beyond a lower count finish. Returns the
        waiting tickets a higher count admits, in order."""
        self._model_limits[model] = replace(self.limits, max_requests_in_flight=max_requests_in_flight)
        return self._admit_waiting(model, now)

    def in_flight(self, model: str) -> int:
        return self._in_flight.get(model, 0)

    def queued(self, model: str) -> int:
        return len(self._queues.get(model, ()))

    def arrive(self, model: str, *, now: float, client: str) -> AdmissionTicket:
        """A request of ``client`` for ``model``: admitted now, or queued; raises
        TooManyRequestsError when the model's queue, or the client's share of it, is full."""
        queue = self._queues.setdefault(model, [])
        self._arrivals += 1
        ticket = AdmissionTicket(model, client, self._arrivals)
        limits = self.limits_of(model)
        if self._may_run(ticket) and self._next(model) is None:
            self._admit(ticket, now)
            return ticket
        waiting = sum(1 for t in queue if t.client == client)
        if len(queue) < limits.max_queued_requests and waiting < limits.client_queued:
            queue.append(ticket)
            return ticket
        if not queue:
            del self._queues[model]
        retry_after_s = self.retry_after_s(model)
        if len(queue) < limits.max_queued_requests:
            raise TooManyRequestsError(
                f"this client already has {self._held[model, client]} request(s) of model {model!r} in flight and "
                f"{waiting} waiting, its share (max_requests_in_flight - 1 and half of max_queued_requests, or "
                f"max_in_flight_per_client / max_queued_per_client); retry in {retry_after_s} s", retry_after_s)
        raise TooManyRequestsError(
            f"model {model!r} is busy: {self.in_flight(model)} request(s) in flight and {len(queue)} queued, "
            f"the most it takes (max_requests_in_flight={limits.max_requests_in_flight}, "
            f"max_queued_requests={limits.max_queued_requests}); retry in {retry_after_s} s", retry_after_s)

    def leave(self, ticket: AdmissionTicket, *, now: float) -> list[AdmissionTicket]:
        """``ticket`` is done: served, failed, or its client left while it waited. Returns the
        tickets admitted in its place, in order."""
        model = ticket.model
        if ticket.state == "queued":
            queue = self._queues.get(model)
            if queue is not None and ticket in queue:
                queue.remove(ticket)
        elif ticket.state == "admitted":
            self._in_flight[model] -= 1
            self._held[model, ticket.client] -= 1
            if not self._held[model, ticket.client]:
                del self._held[model, ticket.client]
            if ticket.admitted_s is not None:
                self._record(model, max(0.0, now - ticket.admitted_s))
        ticket.state = "done"
        admitted = self._admit_waiting(model, now)
        if self._in_flight.get(model) == 0:
            del self._in_flight[model]
        return admitted

    def _admit_waiting(self, model: str, now: float) -> list[AdmissionTicket]:
        """Admit the waiting requests of ``model`` that free slots take, in order."""
        admitted = []
        while (head := self._next(model)) is not None:
            self._queues[model].remove(head)
            self._admit(head, now)
            admitted.append(head)
        if model in self._queues and not self._queues[model]:
            del self._queues[model]
        return admitted

    def retry_after_s(self, model: str) -> int:
        """Whole seconds until a place is likely to free up for ``model``."""
        duration_s = self._duration_s.get(model, DEFAULT_REQUEST_DURATION_S)
        estimate = math.ceil(duration_s / self.limits_of(model).max_requests_in_flight)
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, estimate))

    def _may_run(self, ticket: AdmissionTicket) -> bool:
        limits = self.limits_of(ticket.model)
        return (self.in_flight(ticket.model) < limits.max_requests_in_flight
                and self._held[ticket.model, ticket.client] < limits.client_in_flight)

    def _next(self, model: str) -> AdmissionTicket | None:
        """The waiting request a free slot goes to: of the client holding the fewest slots, the
        oldest first; None when no slot is free or every waiting client holds its share."""
        runnable = [t for t in self._queues.get(model, ()) if self._may_run(t)]
        return min(runnable, key=lambda t: (self._held[model, t.client], t.number), default=None)

    def _admit(self, ticket: AdmissionTicket, now: float) -> None:
        ticket.state, ticket.admitted_s = "admitted", now
        self._in_flight[ticket.model] = self.in_flight(ticket.model) + 1
        self._held[ticket.model, ticket.client] += 1

    def _record(self, model: str, duration_s: float) -> None:
        previous = self._duration_s.get(model)
        self._duration_s[model] = duration_s if previous is None else (
            (1 - DURATION_WEIGHT) * previous + DURATION_WEIGHT * duration_s)
