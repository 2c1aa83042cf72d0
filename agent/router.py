"""The model router: many models behind the one API (design §10).

The orchestrator plays llama.cpp's router for the whole cluster: a model is *loaded* when its
fragments are planned and running on the devices. This module is the I/O around the pure
bookkeeping of :mod:`agent.core.model_registry`: it reads the sources (the model stores of the
live nodes and the presets file), runs the loads, evictions and sleeps the registry decides on
(each as a task it owns), and sends every state change to the `GET /models/sse` subscribers.
It also admits inference requests (:mod:`agent.core.admission`): per model, a limit of requests
in flight and a bounded FIFO queue; beyond them a request is refused with 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from agent.compat import TaskGroup, timeout
from agent.config import AgentConfig
from agent.core.admission import Admission, AdmissionLimits, AdmissionTicket
from agent.core.errors import ClusterError, NcmError, PresetError
from agent.core.model_registry import (
    MIB, RETRY_AFTER_LOAD_S, DeviceMemory, Evict, Load, ModelLoadError, ModelNotLoadedError, ModelRegistry, Refuse,
    RouterError, UnknownModelError,
)
from agent.core.presets import (
    ModelPreset, ModelSettings, PresetFile, build_models, parse_presets, resolve_name, sections_without_weights,
)
from agent.events import EventLog
from agent.membership import Membership
from agent.orchestrator import Deployment, ModelHooks, Orchestrator
from agent.peer_client import PeerError
from agent.weights import WeightTransferError
from shards.errors import ShardsError
from shards.store import ModelStore

log = logging.getLogger(__name__)
SLEEP_CHECK_INTERVAL_S = 1.0
WAIT_POLL_S = 0.5
SSE_QUEUE_LENGTH = 256
# Agent settings that are also model settings: set explicitly, they win over the presets file.
MODEL_SETTINGS = ("max_context", "prefill_chunk", "replicate_head_ratio", "replica_count", "sleep_idle_s")
# What a public error must not show: URLs, and IPv4 / IPv6 addresses with a port.
_ADDRESS = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s,;'\"()]+|\b\d{1,3}(?:\.\d{1,3}){3}:\d+\b|\[[0-9a-fA-F:]+\]:\d+")


class ModelBusyError(RouterError):
    """The model cannot be unloaded now: it is serving, loading or waited for."""


def without_addresses(text: str) -> str:
    """``text`` without the network addresses of nodes (what a public error must not show)."""
    return _ADDRESS.sub("(a node)", text)


def public_reason(error: BaseException) -> str:
    """Why a load failed, as a client may read it: the real reason, without the addresses of
    nodes or what they answered (the orchestrator's log has those)."""
    if isinstance(error, (PeerError, WeightTransferError)):
        return ("a node did not answer, or could not provide the model's files intact "
                "(the orchestrator's log has each node's answer)")
    if isinstance(error, (NcmError, ShardsError)):
        return without_addresses(str(error) or type(error).__name__)
    return f"internal error ({type(error).__name__}; the orchestrator's log has the details)"


class ModelRouter:
    def __init__(self, config: AgentConfig, store: ModelStore, membership: Membership, events: EventLog,
                 orchestrator: Callable[[ModelHooks], Orchestrator]) -> None:
        """``orchestrator`` makes this router's orchestrator, given the router as its hooks."""
        self.config = config
        self.events = events
        self.store = store
        self.membership = membership
        self.registry = ModelRegistry(models_max=config.models_max,
                                      memory_margin_bytes=config.models_memory_margin_mib * MIB)
        self.admission = Admission(AdmissionLimits(max_requests_in_flight=config.max_requests_in_flight,
                                                   max_queued_requests=config.max_queued_requests))
        self._admitted: dict[AdmissionTicket, asyncio.Future[None]] = {}  # queued requests, woken when admitted
        self._unbacked: frozenset[str] = frozenset()  # preset sections left out: no store holds their weights
        self.presets: dict[str, ModelPreset] = {}
        self.enabled = False  # this node is the orchestrator
        self._preset_file: PresetFile | None = None
        self._changed = asyncio.Event()
        self._subscribers: set[asyncio.Queue[dict[str, Any]]] = set()
        self._tasks: TaskGroup | None = None
        self._members: frozenset[str] = frozenset()
        self._startup: set[str] = set()  # load-on-startup models not loaded yet since this node leads
        self._progress: dict[str, float] = {}  # share of the nodes holding a loading model's order
        # Per model, the idle time after which it sleeps as the last request asked (Ollama's
        # keep_alive); it overrides the preset's sleep_idle_s until the model stops.
        self._keep_alive_s: dict[str, float] = {}
        self.orchestrator = orchestrator(self)

    # --- sources -----------------------------------------------------------------------------
    def _read_preset_file(self) -> PresetFile | None:
        path = self.config.models_preset
        if path is None:
            return None
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise PresetError(f"cannot read the presets file {str(path)!r}: {error.strerror}") from None
        return parse_presets(text, origin=str(path))

    def _stored(self) -> dict[str, int]:
        """Every model some live node stores (this node's store, the others' complete models),
        with its context length where known."""
        stored = {m.name: m.context_length for m in self.store.list()}
        for models in self.orchestrator.holdings().values():
            for name in models:
                stored.setdefault(name, max(self.config.max_context, 16))
        return stored

    def reload(self, *, reread_file: bool = True, strict: bool = False) -> None:
        """Re-read the sources (stores of the live nodes, presets file); loads nothing new.
        A bad presets file raises PresetError and keeps what was there. A section whose weights
        no live node stores is refused when ``strict`` (a reload someone asked for); otherwise
        (start, members changing) it is left out, with a warning, until a node that stores its
        weights joins."""
        preset_file = self._read_preset_file() if reread_file else self._preset_file
        origin = str(self.config.models_preset) if self.config.models_preset else "presets"
        stored = self._stored()
        usable = preset_file
        unbacked = sections_without_weights(stored, preset_file)
        if unbacked and not strict and preset_file is not None:
            usable = preset_file.without(unbacked)
            if frozenset(unbacked) != self._unbacked:
                log.warning("%s: left out until a node that stores their weights joins: %s", origin,
                            ", ".join(f"[{name}] (weights {weights!r})" for name, weights in unbacked.items()))
        overrides = {k: getattr(self.config, k) for k in self.config.explicit if k in MODEL_SETTINGS}
        defaults = ModelSettings(max_context=self.config.max_context, prefill_chunk=self.config.prefill_chunk,
                                 replicate_head_ratio=self.config.replicate_head_ratio,
                                 replica_count=self.config.replica_count, sleep_idle_s=self.config.sleep_idle_s)
        try:
            presets = build_models(stored, usable, defaults=defaults, overrides=overrides,
                                   startup_models=[self.config.model])
        except PresetError as error:
            raise PresetError(f"{origin}: {error}") from None
        self._unbacked = frozenset(unbacked)
        self._preset_file, self.presets = preset_file, presets
        before = set(self.registry.entries)
        self.registry.set_models(presets)
        for name in sorted(set(self.registry.entries) ^ before):
            self._emit(name)

    def preset_of(self, name: str) -> ModelPreset | None:
        if not self.presets:
            with contextlib.suppress(PresetError):
                self.reload()
        return self.presets.get(name)

    def resolve(self, name: str | None) -> str:
        """The canonical name of ``name`` (an alias, or None for the main model)."""
        wanted = name or self.config.model
        canonical = resolve_name(self.presets, wanted)
        if canonical is None:
            with contextlib.suppress(PresetError):
                self.reload(reread_file=False)  # a model imported since the last look
            canonical = resolve_name(self.presets, wanted)
        if canonical is None or canonical not in self.registry.entries:
            raise UnknownModelError(wanted, self.presets)
        return canonical

    # --- hooks from the orchestrator ----------------------------------------------------------
    def on_role(self, is_orchestrator: bool) -> None:
        self.enabled = is_orchestrator
        if not is_orchestrator:
            self.registry.reset(ModelLoadError("this node stopped being the orchestrator; retry"))
            self._notify()
            return
        try:
            self.reload()
        except PresetError as error:
            log.error("%s; serving the stored models without presets", error)
            self.reload(reread_file=False)
        self._members = frozenset(self.membership.alive_nodes())
        self._update_devices()
        for name, deployment in self.orchestrator.deployments.items():
            self._adopted(name, deployment)
        self._startup = {self.config.model} | {n for n, p in self.presets.items() if p.settings.load_on_startup}
        self._load_startup_models()

    def _load_startup_models(self) -> None:
        """Load what must run from the start; a model whose holder has not joined yet (or
        whose load failed) is tried again when the members change."""
        for name in sorted(self._startup):
            entry = self.registry.entries.get(name)
            if entry is None or self.registry.find(name) is not None:
                continue
            if entry.state == "ready":
                self._startup.discard(name)
            elif entry.state in ("unloaded", "failed"):
                self._spawn(self._preload(name), f"preload {name}")

    def _adopted(self, name: str, deployment: Deployment) -> None:
        if name in self.registry.entries and self.registry.entries[name].state != "ready":
            self.registry.loaded(name, deployment.effective_bytes, now=time.monotonic())
            self._emit(name)

    def on_members(self, members: frozenset[str]) -> None:
        self._update_devices()
        if members != self._members:
            self._members = members
            for name in list(self.registry.entries):
                self.registry.forget_measure(name)
            with contextlib.suppress(PresetError):
                self.reload(reread_file=False)
            self._load_startup_models()
        self._tick()

    def on_deployment(self, name: str, deployment: Deployment | None, reason: str) -> None:
        entry = self.registry.entries.get(name)
        if entry is None:
            return
        if deployment is None:
            self.registry.failed(name, reason)
            if name == self.config.model or (name in self.presets and self.presets[name].settings.load_on_startup):
                self._startup.add(name)  # it must run: load it again now, and on every change of members
                self._emit(name, reason=reason)
                self._load_startup_models()
                self._tick()
                return
        elif entry.state == "ready":
            self.registry.update_effective(name, deployment.effective_bytes)
        else:
            self._adopted(name, deployment)
        self._emit(name, reason=reason)
        self._tick()

    def shortfall(self, name: str, min_bytes: Mapping[str, int]) -> Mapping[str, int]:
        """What a loaded model's new plan would lack, its own memory counted as free."""
        self._update_devices()
        return self.registry.shortfall(min_bytes, without=[name])

    def on_progress(self, name: str, nodes_done: int, nodes: int) -> None:
        entry = self.registry.entries.get(name)
        if entry is not None and entry.state == "loading":
            self._progress[name] = nodes_done / nodes
            self._emit(name)

    def _update_devices(self) -> None:
        devices = {}
        reports = {self.orchestrator.node_id: self.orchestrator.worker.device_memory()}
        reports.update({n: e.get("device_memory") for n, e in self.membership.peer_extras().items()})
        for node, report in reports.items():
            if isinstance(report, dict):
                with contextlib.suppress(RouterError, TypeError):
                    devices[node] = DeviceMemory(int(report["total_bytes"]), int(report["external_bytes"]))
        self.registry.set_devices(devices)

    # --- scheduling ----------------------------------------------------------------------------
    def _spawn(self, coro: Any, name: str) -> None:
        if self._tasks is None:
            coro.close()
            raise ClusterError("the model router is not running")
        self._tasks.create_task(coro, name=name)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _tick(self) -> None:
        """Carry out what the registry decides for the head of the queue."""
        while self.enabled:
            action = self.registry.next_action()
            if action is None:
                break
            if isinstance(action, Load):
                self._emit(action.model)
                self._spawn(self._run_load(action), f"load {action.model}")
            elif isinstance(action, Evict):
                log.info("evicting %s (least recently used, idle) to load %s", action.victim, action.model)
                self._spawn(self._run_stop(action.victim, "evict", reason=f"evicted for {action.model}"),
                            f"evict {action.victim}")
            elif isinstance(action, Refuse):
                # Not a state change (unless the model goes back from measuring): its own event.
                log.warning("%s", action.error)
                if action.state_changed:
                    self._emit(action.model)
                self._emit_refusal(action.model, action.error)
        self._notify()

    async def _run_load(self, action: Load) -> None:
        name = action.model
        preset = self.presets.get(name)
        retry_after_s: float | None = RETRY_AFTER_LOAD_S
        try:
            if preset is None:
                raise ModelLoadError(f"model {name!r} is no longer in the sources")
            if preset.store_model not in self._stored():
                retry_after_s = None  # not before a node that stores them joins: the reason says so
                raise ModelLoadError(
                    f"no live node stores the weights of {preset.store_model!r}; start the node that holds them, "
                    f"or import them on one (ncm pull / ncm import)")
            self._progress.pop(name, None)
            if action.measure:
                planned = await self.orchestrator.measure(preset)
                self.registry.measured(name, planned.min_bytes)
                log.info("%s needs %s", name, ", ".join(f"{n[:8]} {b / MIB:.0f} MiB" for n, b in sorted(planned.min_bytes.items())))
            else:
                started = time.monotonic()
                deployment = await self.orchestrator.load(preset)
                self.registry.loaded(name, deployment.effective_bytes, now=time.monotonic())
                self.events.record("load", f"{name} loaded", model=name, duration_s=time.monotonic() - started)
        except asyncio.CancelledError:
            self.registry.failed(name, "the router stopped")
            raise
        except Exception as error:  # noqa: BLE001 - any failure of a load is recorded, the agent goes on
            log.warning("%s %s failed: %s", "measuring" if action.measure else "loading", name,
                        str(error) or type(error).__name__)
            self.registry.failed(name, public_reason(error), retry_after_s=retry_after_s)
            self.events.record("load_failed", f"{name} failed to load: {public_reason(error)}", model=name)
        self._emit(name)
        self._tick()

    async def _run_stop(self, name: str, how: str, *, reason: str) -> None:
        """Stop ``name``: ``how`` is "sleep" (the plan is kept), "unload" or "evict"."""
        preset = self.presets.get(name)
        timeout_s = preset.settings.stop_timeout_s if preset else 10.0
        sleep = how == "sleep"
        started = time.monotonic()
        try:
            async with timeout(timeout_s):
                await self.orchestrator.unload(name, keep_plan=sleep)
        except asyncio.TimeoutError:
            log.warning("unloading %s took over %g s (stop-timeout); counting it as unloaded", name, timeout_s)
        except Exception as error:  # noqa: BLE001
            log.warning("unloading %s: %s", name, error)
        finally:
            self._keep_alive_s.pop(name, None)
            if sleep:
                self.registry.slept(name)
            else:
                self.registry.unloaded(name)
            self.events.record(how, f"{name}: {reason}", model=name, duration_s=time.monotonic() - started)
            self._emit(name, reason=reason)
            self._tick()

    async def _preload(self, name: str) -> None:
        try:
            await self._wait_ready(name, autoload=True)
        except (RouterError, ClusterError) as error:
            log.warning("could not load %s at start: %s (trying again when the members change)", name, error)
        else:
            self._startup.discard(name)

    async def run(self) -> None:
        """Own the loads, evictions and sleeps; put models to sleep when idle (owned by the app)."""
        async with TaskGroup() as tasks:
            self._tasks = tasks
            try:
                while True:
                    await asyncio.sleep(SLEEP_CHECK_INTERVAL_S)
                    if not self.enabled:
                        continue
                    idle = {name: self.sleeps_after_s(name) for name in self.presets}
                    for name in self.registry.sleep_candidates(time.monotonic(), idle):
                        if self.registry.begin_stop(name):
                            log.info("%s idle for %g s: sleeping (plan kept)", name, idle[name])
                            self._spawn(self._run_stop(name, "sleep", reason="idle"), f"sleep {name}")
            finally:
                self._tasks = None

    # --- requests --------------------------------------------------------------------------------
    async def _wait_ready(self, name: str, *, autoload: bool) -> Deployment:
        """Wait until ``name`` is ready, loading it if needed; returns its deployment. A request
        whose client leaves is cancelled here: it leaves the queue, the load goes on."""
        if not self.enabled:
            raise ClusterError("this node is not the orchestrator; the cluster is changing, retry")
        ticket = None
        deadline = time.monotonic() + self.config.models_load_timeout_s
        try:
            while True:
                entry = self.registry.entry(name)
                deployment = self.orchestrator.deployments.get(name)
                if entry.state == "ready" and not entry.stopping:
                    if deployment is not None:
                        return deployment
                    self.registry.failed(name, "its deployment is gone")
                if ticket is not None and ticket.done:
                    self.registry.leave(ticket)
                    outcome, ticket = ticket.outcome, None
                    if outcome is not None:
                        raise outcome
                    continue
                if ticket is None:
                    if not autoload and entry.state not in ("measuring", "loading", "sleeping", "ready"):
                        raise ModelNotLoadedError(f"model {name!r} is not loaded ({entry.state}) and autoload is off; "
                                                  f"load it with POST /models/load or pass ?autoload=true")
                    ticket = self.registry.join(name)
                    self._tick()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ModelLoadError(f"model {name!r} was not ready within {self.config.models_load_timeout_s:g} s")
                changed = self._changed
                with contextlib.suppress(asyncio.TimeoutError):
                    async with timeout(min(WAIT_POLL_S, remaining)):
                        await changed.wait()
        finally:
            if ticket is not None:
                self.registry.leave(ticket)
                self._tick()

    @contextlib.asynccontextmanager
    async def admit(self, name: str) -> AsyncIterator[None]:
        """Hold one of ``name``'s slots in flight for the request, after waiting in its queue
        (FIFO) when every slot is busy. A full queue raises TooManyRequestsError (429); a
        client that leaves while queued (its task is cancelled) gives up its place."""
        ticket = self.admission.arrive(name, now=time.monotonic())
        try:
            if ticket.state == "queued":
                admitted = asyncio.get_running_loop().create_future()
                self._admitted[ticket] = admitted
                await admitted  # no deadline: the requests ahead are bounded by their own
            yield
        finally:
            self._admitted.pop(ticket, None)
            for next_ticket in self.admission.leave(ticket, now=time.monotonic()):
                waiting = self._admitted.pop(next_ticket, None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(None)

    @contextlib.asynccontextmanager
    async def use(self, name: str, *, autoload: bool | None = None) -> AsyncIterator[Deployment]:
        """Serve one inference request on ``name``: admit it (:meth:`admit`), wait until the
        model is ready, count it as busy."""
        async with self.admit(name), self._ready_for_request(name, autoload=autoload) as deployment:
            yield deployment

    @contextlib.asynccontextmanager
    async def _ready_for_request(self, name: str, *, autoload: bool | None) -> AsyncIterator[Deployment]:
        autoload = self.config.models_autoload if autoload is None else autoload
        while True:
            deployment = await self._wait_ready(name, autoload=autoload)
            with contextlib.suppress(ModelNotLoadedError):  # it began stopping in between: wait again
                self.registry.begin_request(name, now=time.monotonic())
                break
        try:
            yield deployment
        finally:
            self.registry.end_request(name, now=time.monotonic())
            self._tick()

    async def load(self, name: str) -> dict[str, Any]:
        """`POST /models/load`: load ``name`` (waits until it is ready)."""
        await self._wait_ready(name, autoload=True)
        return self.model_info(name)

    async def unload(self, name: str) -> dict[str, Any]:
        """`POST /models/unload`: unload an idle model; a busy one is refused (no preemption)."""
        entry = self.registry.entry(name)
        if entry.state == "sleeping":
            self.orchestrator.forget_plan(name)
            self.registry.unloaded(name)
            self._emit(name, reason="unloaded on request")
        elif entry.state in ("unloaded", "failed"):
            pass
        elif not self.registry.begin_stop(name):
            raise ModelBusyError(f"model {name!r} is {entry.state} with {entry.active_requests} request(s) in flight"
                                 f"{' and requests waiting' if self.registry.find(name) else ''}; retry when it is idle")
        else:
            await self._run_stop(name, "unload", reason="unloaded on request")
        return self.model_info(name)

    async def sleep(self, name: str) -> dict[str, Any]:
        """`POST /models/sleep`: release an idle model's memory now, keeping its plan (the next
        request wakes it without measuring again); a busy one is refused."""
        entry = self.registry.entry(name)
        if entry.state == "sleeping":
            return self.model_info(name)
        if entry.state != "ready":
            raise ModelNotLoadedError(f"model {name!r} is {entry.state}; only a ready model can sleep")
        if not self.registry.begin_stop(name):
            raise ModelBusyError(f"model {name!r} has {entry.active_requests} request(s) in flight"
                                 f"{' and requests waiting' if self.registry.find(name) else ''}; retry when it is idle")
        await self._run_stop(name, "sleep", reason="put to sleep on request")
        return self.model_info(name)

    def sleeps_after_s(self, name: str) -> float:
        """How long ``name`` stays loaded while idle (0: until asked): Ollama's keep_alive of its
        last request, else its sleep_idle_s."""
        preset = self.presets.get(name)
        return self._keep_alive_s.get(name, preset.settings.sleep_idle_s if preset else 0.0)

    def keep_alive(self, name: str, seconds: float) -> None:
        """After this request, keep ``name`` loaded while it is idle for ``seconds`` (Ollama's
        keep_alive): 0 unloads it as soon as it is idle, a negative value keeps it loaded."""
        if seconds == 0:
            self._keep_alive_s.pop(name, None)
            if self.registry.begin_stop(name):
                self._spawn(self._run_stop(name, "unload", reason="unloaded after the request (keep_alive 0)"),
                            f"unload {name}")
            return
        self._keep_alive_s[name] = seconds if seconds > 0 else 0.0  # 0 in the idle table: never

    # --- views and events --------------------------------------------------------------------------
    def model_info(self, name: str) -> dict[str, Any]:
        entry = self.registry.entry(name)
        preset = self.presets.get(name)
        deployment = self.orchestrator.deployments.get(name)
        queued = self.registry.find(name)
        progress = {"ready": 1.0, "loading": self._progress.get(name, 0.0)}.get(entry.state)
        info: dict[str, Any] = {"id": name, "object": "model", "owned_by": "ncm", **entry.to_dict(),
                                "waiters": queued.waiters if queued else 0, "progress": progress,
                                "requests_in_flight": self.admission.in_flight(name),
                                "queued_requests": self.admission.queued(name)}
        if preset is not None:
            info.update(aliases=list(preset.aliases), source=preset.source, store_model=preset.store_model,
                        settings={k: getattr(preset.settings, k) for k in (
                            "max_context", "prefill_chunk", "replicate_head_ratio", "replica_count",
                            "load_on_startup", "stop_timeout_s", "sleep_idle_s", "weights")})
        if deployment is not None:
            info.update(serving=deployment.order.model, degraded=deployment.order.degraded,
                        plan_version=deployment.order.plan_version)
        return info

    def models(self) -> list[dict[str, Any]]:
        return [self.model_info(name) for name in sorted(self.registry.entries)]

    def _emit(self, name: str, *, reason: str | None = None) -> None:
        if not self._subscribers or name not in self.registry.entries:
            return
        event = {"event": "status_change", "model": name, **self.model_info(name)}
        if reason is not None:
            event["detail"] = reason
        self._send(event)

    def _emit_refusal(self, name: str, error: RouterError) -> None:
        """A load refused for lack of room is not a change of state: its own event, with the
        model's state as it is and the message the waiting requests got."""
        if not self._subscribers or name not in self.registry.entries:
            return
        retry_after_s = getattr(error, "retry_after_s", None)
        event = {"event": "load_refused", "model": name, "state": self.registry.entries[name].state,
                 "detail": str(error), "retry_after_s": retry_after_s}
        self._send(event)

    def _send(self, event: dict[str, Any]) -> None:
        for queue in list(self._subscribers):
            if queue.full():
                self._subscribers.discard(queue)  # a reader that stopped reading is dropped
            else:
                queue.put_nowait(event)

    @contextlib.contextmanager
    def subscribe(self) -> Any:
        """Events of every state change, starting with the state of every model."""
        models = self.models()
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(SSE_QUEUE_LENGTH + len(models))
        for info in models:
            queue.put_nowait({"event": "status_change", "model": info["id"], **info})
        self._subscribers.add(queue)
        try:
            yield queue
        finally:
            self._subscribers.discard(queue)
