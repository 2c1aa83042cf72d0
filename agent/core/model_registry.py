"""The model router's states and transitions (design §10). Pure: time is a parameter.

A model is *loaded* when its fragments are planned and running on the devices. States:
``unloaded``, ``measuring`` (its per-device memory is being worked out, then room made for it),
``loading``, ``ready``, ``sleeping`` (plan kept, device memory released) and ``failed`` (with
a reason). A load goes forward only: unloaded (or sleeping, or failed) -> measuring -> loading
-> ready; a model whose load is refused goes back to where it was.

The registry keeps each model's entry and decides the next step for the head of the wait queue
(:mod:`agent.core.wait_queue`) against the capacity ledgers (:mod:`agent.core.memory_ledger`):
load it, evict the least recently used idle model first (one at a time; a model serving a
request, loading, being stopped or waited for is never a victim), or refuse it (the caller
answers 503 with Retry-After, and the ledger's reason).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from agent.core.errors import (
    RETRY_AFTER_LOAD_S,
    CapacityError,
    ModelLoadError,
    ModelNotLoadedError,
    RouterError,
    UnknownModelError,
)
from agent.core.memory_ledger import DeviceMemory, Holder, MemoryLedger
from agent.core.state_enum import StateEnum
from agent.core.wait_queue import QueueEntry, WaitQueue


class ModelState(StateEnum):
    """Where a model is in the router (its value is what every view and event shows)::

        unloaded, sleeping, failed --a request at the head of the queue--> measuring
        measuring --fits, after evictions--> loading --loaded--> ready
        measuring --refused, or measured for a plan only--> back to where it was
        loading --error--> failed          ready --its deployment is lost--> failed
        ready --idle for sleep_idle_s, or POST /models/sleep--> sleeping (plan kept)
        ready, sleeping --unload, eviction, keep_alive 0--> unloaded
    """

    UNLOADED = "unloaded"
    MEASURING = "measuring"
    LOADING = "loading"
    READY = "ready"
    SLEEPING = "sleeping"
    FAILED = "failed"


STATES = tuple(state.value for state in ModelState)


@dataclass
class ModelEntry:
    """One model's bookkeeping (mutated only by :class:`ModelRegistry`)."""

    name: str
    state: ModelState = ModelState.UNLOADED
    reason: str | None = None
    last_used_s: float = 0.0
    active_requests: int = 0
    min_bytes: dict[str, int] | None = None  # per node, measured before loading
    effective_bytes: dict[str, int] | None = None  # per node, reported once loaded
    stopping: bool = False  # an unload or sleep is under way
    listed: bool = True  # still in the sources (a model dropped by a reload stays until unloaded)
    resting_state: ModelState = ModelState.UNLOADED  # where a measure that did not lead to a load returns

    def counted(self) -> bool:
        """Whether the model counts against ``models_max`` (loading or ready)."""
        return self.state in (ModelState.LOADING, ModelState.READY)

    def held_bytes(self) -> Mapping[str, int]:
        """Device memory this model counts against: effective when known, else its reservation."""
        if not self.counted():
            return {}
        return self.effective_bytes or self.min_bytes or {}

    def to_dict(self) -> dict[str, object]:
        return {
            "state": self.state, "reason": self.reason, "last_used_s": self.last_used_s,
            "active_requests": self.active_requests, "stopping": self.stopping,
            "memory": {"min_bytes": dict(self.min_bytes or {}), "effective_bytes": dict(self.effective_bytes or {})},
        }


@dataclass(frozen=True)
class Load:
    """Claimed: measure the model (``measure``) or load it; then call back the registry."""

    model: str
    measure: bool


@dataclass(frozen=True)
class Evict:
    """Unload the idle model ``victim`` to make room for ``model``; then call :meth:`unloaded`."""

    victim: str
    model: str


@dataclass(frozen=True)
class Refuse:
    """The head entry was dropped: its waiters get ``error``. ``state_changed``: the model
    went back from ``measuring`` to where it was (else its state is what it was)."""

    model: str
    error: CapacityError
    state_changed: bool = False


Action = Load | Evict | Refuse


class ModelRegistry:
    """Models and their states, over the wait queue and both capacity ledgers."""

    def __init__(self, models_max: int = 0, memory_margin_bytes: int = 0) -> None:
        self.entries: dict[str, ModelEntry] = {}
        self.queue = WaitQueue()
        self.ledger = MemoryLedger(self.entries, models_max, memory_margin_bytes)

    # --- sources ---------------------------------------------------------------------------
    def set_models(self, names: Iterable[str]) -> None:
        """The models the sources list now (a reload): new ones are added unloaded; a model that
        left stays until it is unloaded. Nothing is loaded here."""
        wanted = set(names)
        for name in wanted:
            entry = self.entries.setdefault(name, ModelEntry(name))
            entry.listed = True
        for name, entry in list(self.entries.items()):
            if name not in wanted:
                entry.listed = False
                self._drop_if_gone(entry)

    def _drop_if_gone(self, entry: ModelEntry) -> None:
        if not entry.listed and entry.state in (ModelState.UNLOADED, ModelState.FAILED, ModelState.SLEEPING) and not entry.stopping \
                and self.find(entry.name) is None:
            self.entries.pop(entry.name, None)

    def entry(self, name: str) -> ModelEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise UnknownModelError(name, self.entries) from None

    def reset(self, error: RouterError) -> None:
        """Forget everything (this node no longer leads): every waiter gets ``error``."""
        for ticket in list(self.queue):
            self._pop(ticket, error)
        self.entries.clear()

    def set_devices(self, devices: Mapping[str, DeviceMemory]) -> None:
        self.ledger.devices = dict(devices)

    # --- the queue -------------------------------------------------------------------------
    def find(self, name: str) -> QueueEntry | None:
        return self.queue.find(name)

    def join(self, name: str) -> QueueEntry:
        """A request waits for ``name`` (a model the sources list)."""
        self.entry(name)
        return self.queue.join(name)

    def leave(self, ticket: QueueEntry) -> None:
        """A waiter is gone (served, failed or disconnected). A claimed load still completes."""
        ticket.waiters = max(0, ticket.waiters - 1)
        if ticket.waiters == 0 and not ticket.claimed and not ticket.done:
            self._pop(ticket, None)

    def _pop(self, ticket: QueueEntry, outcome: RouterError | None) -> None:
        self.queue.take_out(ticket, outcome)
        entry = self.entries.get(ticket.model)
        if entry is not None:
            if entry.state == ModelState.MEASURING:  # measured, but no load followed: back to where it was
                entry.state = entry.resting_state
            self._drop_if_gone(entry)

    # --- capacity --------------------------------------------------------------------------
    def _evictable(self) -> list[ModelEntry]:
        """Idle ready models, least recently used first."""
        waited_for = self.queue.waited_for()
        return sorted((e for e in self.entries.values()
                       if e.state == ModelState.READY and e.active_requests == 0 and not e.stopping
                       and e.name not in waited_for),
                      key=lambda e: (e.last_used_s, e.name))

    def next_action(self) -> Action | None:
        """What to do for the head of the queue now (None: nothing, or wait for what runs)."""
        while self.queue:
            head = self.queue[0]
            if head.claimed:
                return None
            entry = self.entries[head.model]
            if entry.state == ModelState.READY and not entry.stopping:
                self._pop(head, None)
                continue
            if entry.stopping or any(e.stopping for e in self.entries.values()):
                return None  # an unload is under way: decide once it has freed its memory
            if entry.min_bytes is None:
                head.claimed = True
                if entry.state != ModelState.MEASURING:  # measuring again (the devices changed): same resting state
                    entry.resting_state = entry.state
                entry.state = ModelState.MEASURING
                return Load(head.model, measure=True)
            if self.ledger.fits(entry.min_bytes, []):
                head.claimed = True
                entry.state, entry.reason, entry.effective_bytes = ModelState.LOADING, None, None
                return Load(head.model, measure=False)
            victims = self.ledger.victims(entry.min_bytes, self._evictable())
            if victims:
                self.entries[victims[0]].stopping = True
                return Evict(victims[0], head.model)
            error = self.ledger.refusal(entry.name, entry.min_bytes, [e.name for e in self._evictable()],
                                        self._why_kept)
            before = entry.state
            self._pop(head, error)
            return Refuse(head.model, error, state_changed=entry.state != before)
        return None

    def _why_kept(self, model: Holder) -> str:
        """Why a loaded model cannot be evicted now."""
        entry = self.entries[model.name]
        if entry.state == ModelState.LOADING:
            return "loading"
        if entry.stopping:
            return "being unloaded"
        if entry.active_requests:
            return f"serving {entry.active_requests} request{'s' if entry.active_requests > 1 else ''}"
        if self.find(entry.name) is not None:
            return "requests wait for it"
        return "in use"

    # --- outcomes of what the adapter ran -------------------------------------------------------
    def measured(self, name: str, min_bytes: Mapping[str, int]) -> None:
        """The measure of the claimed head is in; the next :meth:`next_action` decides the load.
        The model stays ``measuring`` while it waits for room, so that its states only go
        forward (measuring -> loading); it goes back to where it was if it leaves the queue."""
        entry = self.entry(name)
        if any(v < 0 for v in min_bytes.values()):
            raise RouterError("memory figures must be >= 0")
        entry.min_bytes = dict(min_bytes)
        head = self.find(name)
        if head is not None:
            head.claimed = False
        elif entry.state == ModelState.MEASURING:
            entry.state = entry.resting_state

    def forget_measure(self, name: str) -> None:
        """The devices changed: a model that is not loaded measures again before its next load
        (also one measured that waits for room; not one whose measure is under way)."""
        entry = self.entries.get(name)
        if entry is None:
            return
        head = self.find(name)
        if entry.state in (ModelState.UNLOADED, ModelState.SLEEPING, ModelState.FAILED) or (
                entry.state == ModelState.MEASURING and head is not None and not head.claimed):
            entry.min_bytes = None

    def loaded(self, name: str, effective_bytes: Mapping[str, int], *, now: float) -> None:
        entry = self.entry(name)
        entry.state, entry.reason, entry.last_used_s = ModelState.READY, None, now
        entry.effective_bytes = dict(effective_bytes) or None
        head = self.find(name)
        if head is not None:
            self._pop(head, None)

    def failed(self, name: str, reason: str, *, retry_after_s: float | None = RETRY_AFTER_LOAD_S) -> None:
        """Measuring or loading failed, or a loaded model lost a device it cannot do without.
        ``retry_after_s``: when a new request may try again (None: not before something
        changes, and ``reason`` says what)."""
        entry = self.entries.get(name)
        if entry is None:
            return
        entry.state, entry.reason, entry.stopping, entry.effective_bytes = ModelState.FAILED, reason, False, None
        head = self.find(name)
        if head is not None and head.claimed:
            self._pop(head, ModelLoadError(f"model {name!r} failed to load: {reason}", retry_after_s))
        self._drop_if_gone(entry)

    def update_effective(self, name: str, effective_bytes: Mapping[str, int]) -> None:
        entry = self.entries.get(name)
        if entry is not None and entry.state == ModelState.READY:
            entry.effective_bytes = dict(effective_bytes) or None

    def begin_stop(self, name: str) -> bool:
        """Start unloading or sleeping ``name``; False when it is busy, waited for or not loaded."""
        entry = self.entries.get(name)
        if entry is None or entry.state != ModelState.READY or entry.active_requests or entry.stopping or self.find(name):
            return False
        entry.stopping = True
        return True

    def unloaded(self, name: str) -> None:
        entry = self.entries.get(name)
        if entry is None:
            return
        entry.state, entry.stopping, entry.effective_bytes, entry.reason = ModelState.UNLOADED, False, None, None
        self._drop_if_gone(entry)

    def slept(self, name: str) -> None:
        entry = self.entries.get(name)
        if entry is None:
            return
        entry.state, entry.stopping, entry.effective_bytes = ModelState.SLEEPING, False, None
        self._drop_if_gone(entry)

    def sleep_candidates(self, now: float, idle_s: Mapping[str, float]) -> list[str]:
        """Idle ready models whose ``idle_s`` (0 = never) has passed since their last use."""
        return sorted(e.name for e in self._evictable()
                      if idle_s.get(e.name, 0) > 0 and now - e.last_used_s >= idle_s[e.name])

    # --- requests ----------------------------------------------------------------------------
    def begin_request(self, name: str, *, now: float) -> None:
        entry = self.entry(name)
        if entry.state != ModelState.READY or entry.stopping:
            raise ModelNotLoadedError(f"model {name!r} is {entry.state}")
        entry.active_requests += 1
        entry.last_used_s = now

    def end_request(self, name: str, *, now: float) -> None:
        entry = self.entries.get(name)
        if entry is not None and entry.active_requests > 0:
            entry.active_requests -= 1
            entry.last_used_s = max(entry.last_used_s, now)
