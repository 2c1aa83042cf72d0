"""The model router: many models behind the one API (design §10).

The orchestrator plays llama.cpp's router for the whole cluster: a model is *loaded* when its
fragments are planned and running on the devices. The router answers the orchestrator's hooks,
serves the requests (admitted by :mod:`agent.models.admission_gate`, then waiting until their model is
ready), takes the management requests (load, unload, sleep, keep-alive) and shows each model's
state. Its collaborators: :mod:`agent.models.catalog` (the models the sources list),
:mod:`agent.models.scheduler` (the loads, evictions and sleeps the registry decides on) and
:mod:`agent.models.events` (the `GET /models/sse` stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from typing import Any

from agent.cluster.membership import Membership
from agent.core.admission import (
    AUTO_MOST_REQUESTS_IN_FLIGHT,
    DEFAULT_MAX_REQUESTS_IN_FLIGHT,
    Admission,
    AdmissionLimits,
)
from agent.core.embedding_placement import place_embedding_model
from agent.core.errors import (
    ClusterError,
    ModelBusyError,
    ModelLoadError,
    ModelNotLoadedError,
    PresetError,
    RouterError,
    UnknownModelError,
)
from agent.core.memory_ledger import MIB, DeviceMemory
from agent.core.model_registry import ModelRegistry, ModelState
from agent.core.presets import ModelPreset
from agent.local.compat import timeout
from agent.local.config import AgentConfig
from agent.local.events import EventLog
from agent.models.admission_gate import AdmissionGate
from agent.models.catalog import ModelCatalog
from agent.models.events import ModelEventStream
from agent.models.scheduler import ModelScheduler
from agent.orchestration.orchestrator import Deployment, ModelHooks, Orchestrator
from shards.errors import ShardsError
from shards.store.model_store import ModelStore

log = logging.getLogger(__name__)
WAIT_POLL_S = 0.5


LATEST_TAG = ":latest"


class ModelRouter:
    """Many models behind one API on the orchestrator: what the sources list, what is loaded,
    the requests that wait for a model, and the scheduler that loads, evicts and puts to sleep.

    Over 250 lines: each public request path (use, load, unload, sleep, list) reads and changes
    the one registry under one lock, and is kept beside the others for that."""

    def __init__(self, config: AgentConfig, store: ModelStore, membership: Membership, events: EventLog,
                 orchestrator: Callable[[ModelHooks], Orchestrator]) -> None:
        """``orchestrator`` makes this router's orchestrator, given the router as its hooks."""
        self.config = config
        self.events = events
        self.store = store
        self.membership = membership
        self.registry = ModelRegistry(models_max=config.models_max,
                                      memory_margin_bytes=config.models_memory_margin_mib * MIB)
        self.gate = AdmissionGate(AdmissionLimits(
            max_requests_in_flight=config.max_requests_in_flight or DEFAULT_MAX_REQUESTS_IN_FLIGHT,
            max_queued_requests=config.max_queued_requests,
            max_in_flight_per_client=config.max_requests_in_flight_per_client,
            max_queued_per_client=config.max_queued_requests_per_client))
        self.model_events = ModelEventStream(self.registry, self.model_info, self.models)
        self.enabled = False  # this node is the orchestrator
        self._members: frozenset[str] = frozenset()
        self._startup: set[str] = set()  # load-on-startup models not loaded yet since this node leads
        self.orchestrator = orchestrator(self)
        self.catalog = ModelCatalog(config, store, self.orchestrator.holdings, on_reload=self._listed)
        self.scheduler = ModelScheduler(self.registry, self.catalog, self.orchestrator, events, self.model_events,
                                        enabled=lambda: self.enabled, loaded=self._loaded)

    # --- sources ---------------------------------------------------------------------------------
    @property
    def presets(self) -> dict[str, ModelPreset]:
        return self.catalog.presets

    def reload(self, *, reread_file: bool = True, strict: bool = False) -> None:
        """Re-read the sources (:meth:`ModelCatalog.reload`); loads nothing new."""
        self.catalog.reload(reread_file=reread_file, strict=strict)

    def _listed(self, presets: Mapping[str, ModelPreset]) -> None:
        """The sources list ``presets`` now: the registry adds the new, drops the gone idle ones."""
        before = set(self.registry.entries)
        self.registry.set_models(presets)
        for name in sorted(set(self.registry.entries) ^ before):
            self.model_events.status_changed(name)

    def preset_of(self, name: str) -> ModelPreset | None:
        return self.catalog.preset_of(name)

    def resolve(self, name: str | None) -> str:
        """The canonical name of ``name`` (an alias, or None for the main model); Ollama's
        ``:latest`` tag, which ``/api/tags`` lists, names the model itself."""
        wanted = name or self.config.model
        canonical = self.catalog.resolve(wanted)
        if canonical is None and wanted.endswith(LATEST_TAG):
            canonical = self.catalog.resolve(wanted[:-len(LATEST_TAG)])
        if canonical is None or canonical not in self.registry.entries:
            raise UnknownModelError(wanted, self.presets)
        return canonical

    # --- hooks from the orchestrator -------------------------------------------------------------
    def on_role(self, is_orchestrator: bool) -> None:
        self.enabled = is_orchestrator
        if not is_orchestrator:
            self.registry.reset(ModelLoadError("this node stopped being the orchestrator; retry"))
            self.scheduler.notify()
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
            if entry.state == ModelState.READY:
                self._startup.discard(name)
            elif entry.state in (ModelState.UNLOADED, ModelState.FAILED):
                self.scheduler.spawn(self._preload(name), f"preload {name}")

    def _adopted(self, name: str, deployment: Deployment) -> None:
        if name in self.registry.entries and self.registry.entries[name].state != ModelState.READY:
            self._loaded(name, deployment)
            self.model_events.status_changed(name)

    def _loaded(self, name: str, deployment: Deployment, *, replanned: bool = False) -> None:
        """The registry counts ``name`` as ready (or, ``replanned``, ready on a new plan) with
        the memory ``deployment`` holds; with ``max_requests_in_flight`` 0, running as many
        requests at once as every stage's memory holds the KV cache of (at full context, up
        to :data:`AUTO_MOST_REQUESTS_IN_FLIGHT` per node), which admission follows from now
        on; placed as whole copies, as many as each copy's own memory holds, all together."""
        if replanned:
            self.registry.update_effective(name, deployment.effective_bytes)
        else:
            self.registry.loaded(name, deployment.effective_bytes, now=time.monotonic())
            self._startup.discard(name)  # loaded: an unload from now on keeps it unloaded
        if not self.config.max_requests_in_flight:  # the room is counted, not held: a model to load comes first
            sessions, ledger = self._session_bytes(deployment), self.registry.ledger
            copies = bool(deployment.order.copies)  # each copy takes as many as its own room holds
            per_node = ledger.sessions_per_node(sessions, AUTO_MOST_REQUESTS_IN_FLIGHT)
            deployment.copy_sessions = per_node if copies else {}
            self.gate.set_in_flight(name, ledger.sessions_fitting(sessions, AUTO_MOST_REQUESTS_IN_FLIGHT,
                                                                  one_node_each=copies))

    def _session_bytes(self, deployment: Deployment) -> dict[str, int]:
        """Per node of ``deployment``'s route (and of its whole copies: every layer), one
        request's KV cache at full context."""
        try:
            manifest = self.store.manifest(deployment.order.model)
        except ShardsError:
            return {}
        layers: Counter[str] = Counter()
        for hop in deployment.order.route.hops:
            layers[hop.node_id] += hop.layers.last - hop.layers.first + 1
        for node in deployment.order.copies:
            layers[node] = manifest.n_layers
        context = deployment.order.max_context or self.config.max_context
        return {node: manifest.kv_bytes_per_token(count) * context for node, count in layers.items()}

    def on_members(self, members: frozenset[str]) -> None:
        self._update_devices()
        if members != self._members:
            self._members = members
            for name in list(self.registry.entries):
                self.registry.forget_measure(name)
            with contextlib.suppress(PresetError):
                self.reload(reread_file=False)
            self._load_startup_models()
        self.scheduler.tick()

    def on_deployment(self, name: str, deployment: Deployment | None, reason: str) -> None:
        entry = self.registry.entries.get(name)
        if entry is None:
            return
        if deployment is None:
            self.registry.failed(name, reason)
            if name == self.config.model or (name in self.presets and self.presets[name].settings.load_on_startup):
                self._startup.add(name)  # it must run: load it again now, and on every change of members
                self.model_events.status_changed(name, reason=reason)
                self._load_startup_models()
                self.scheduler.tick()
                return
        elif entry.state == ModelState.READY:
            self._loaded(name, deployment, replanned=True)
        else:
            self._adopted(name, deployment)
        self.model_events.status_changed(name, reason=reason)
        self.scheduler.tick()

    def shortfall(self, name: str, min_bytes: Mapping[str, int]) -> Mapping[str, int]:
        """What a loaded model's new plan would lack, its own memory counted as free."""
        self._update_devices()
        return self.registry.ledger.shortfall(min_bytes, without=[name])

    def place_embedding_model(self, name: str, weight_bytes: int, open_on: Collection[str]) -> str:
        """The live node that runs embedding model ``name`` of ``weight_bytes`` (``open_on``: where
        it is open now), from the ledger's free memory (:mod:`agent.core.embedding_placement`)."""
        self._update_devices()
        me = self.orchestrator.node_id
        free: dict[str, int | None] = {}
        for node in {me, *self.membership.alive_nodes()}:
            budget = self.registry.ledger.budget_bytes(node)
            free[node] = None if budget is None else budget - self.registry.ledger.held_bytes(node)
        return place_embedding_model(name, weight_bytes, free, orchestrator=me, open_on=open_on)

    def on_progress(self, name: str, nodes_done: int, nodes: int) -> None:
        entry = self.registry.entries.get(name)
        if entry is not None and entry.state == ModelState.LOADING:
            self.scheduler.progressed(name, nodes_done / nodes)
            self.model_events.status_changed(name)

    def _update_devices(self) -> None:
        devices = {}
        reports = {self.orchestrator.node_id: self.orchestrator.worker.device_memory()}
        reports.update({n: r.device_memory for n, r in self.membership.peer_reports().items()})
        for node, report in reports.items():
            if isinstance(report, dict):
                with contextlib.suppress(RouterError, TypeError):
                    devices[node] = DeviceMemory(int(report["total_bytes"]), int(report["external_bytes"]))
        self.registry.set_devices(devices)

    # --- scheduling ------------------------------------------------------------------------------
    async def _preload(self, name: str) -> None:
        try:
            await self._wait_ready(name, autoload=True, once=True)
        except (RouterError, ClusterError) as error:
            log.warning("could not load %s at start: %s (trying again when the members change)", name, error)

    async def run(self) -> None:
        """Own the loads, evictions and sleeps (:meth:`ModelScheduler.run`; owned by the app)."""
        await self.scheduler.run()

    # --- requests --------------------------------------------------------------------------------
    async def _wait_ready(self, name: str, *, autoload: bool, once: bool = False) -> Deployment | None:
        """Wait until ``name`` is ready, loading it if needed; returns its deployment. A request
        whose client leaves is cancelled here: it leaves the queue, the load goes on. ``once``
        (a load at start, which leaves the models to load at start once loaded: ``_loaded``)
        waits for one load only and returns None: a model unloaded or put to sleep before this
        waiter saw it ready stays so."""
        if not self.enabled:
            raise ClusterError("this node is not the orchestrator; the cluster is changing, retry")
        ticket = None
        deadline = time.monotonic() + self.config.models_load_timeout_s
        try:
            while True:
                entry = self.registry.entry(name)
                deployment = self.orchestrator.deployments.get(name)
                if entry.state == ModelState.READY and not entry.stopping:
                    if deployment is not None:
                        return deployment
                    self.registry.failed(name, "its deployment is gone")
                if ticket is not None and ticket.done:
                    self.registry.leave(ticket)
                    outcome, ticket = ticket.outcome, None
                    if outcome is not None:
                        raise outcome
                    if once:
                        return None
                    continue
                if ticket is None:
                    if not autoload and entry.state not in (ModelState.MEASURING, ModelState.LOADING,
                                                            ModelState.SLEEPING, ModelState.READY):
                        raise ModelNotLoadedError(f"model {name!r} is not loaded ({entry.state}) and autoload is off; "
                                                  f"load it with POST /models/load or pass ?autoload=true")
                    ticket = self.registry.join(name)
                    self.scheduler.tick()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ModelLoadError(f"model {name!r} was not ready within {self.config.models_load_timeout_s:g} s")
                changed = self.scheduler.changed
                with contextlib.suppress(asyncio.TimeoutError):
                    async with timeout(min(WAIT_POLL_S, remaining)):
                        await changed.wait()
        finally:
            if ticket is not None:
                self.registry.leave(ticket)
                self.scheduler.tick()

    @contextlib.asynccontextmanager
    async def use(self, name: str, *, client: str, autoload: bool | None = None) -> AsyncIterator[Deployment]:
        """Serve one inference request of ``client`` on ``name``: admit it
        (:meth:`AdmissionGate.admit`), wait until the model is ready, count it as busy."""
        async with self.gate.admit(name, client), self._ready_for_request(name, autoload=autoload) as deployment:
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
            self.scheduler.tick()

    async def load(self, name: str) -> dict[str, Any]:
        """`POST /models/load`: load ``name`` (waits until it is ready)."""
        await self._wait_ready(name, autoload=True)
        return self.model_info(name)

    async def unload(self, name: str) -> dict[str, Any]:
        """`POST /models/unload`: unload an idle model; a busy one is refused (no preemption)."""
        entry = self.registry.entry(name)
        if entry.state == ModelState.SLEEPING:
            self.orchestrator.forget_plan(name)
            self.registry.unloaded(name)
            self.model_events.status_changed(name, reason="unloaded on request")
        elif entry.state in (ModelState.UNLOADED, ModelState.FAILED):
            pass
        elif not self.registry.begin_stop(name):
            raise self._busy(name, "unloaded")
        else:
            await self.scheduler.stop(name, "unload", reason="unloaded on request")
        return self.model_info(name)

    async def sleep(self, name: str) -> dict[str, Any]:
        """`POST /models/sleep`: release an idle model's memory now, keeping its plan (the next
        request wakes it without measuring again); a busy one is refused."""
        entry = self.registry.entry(name)
        if entry.state == ModelState.SLEEPING:
            return self.model_info(name)
        if entry.state != ModelState.READY:
            raise ModelNotLoadedError(f"model {name!r} is {entry.state}; only a ready model can sleep")
        if not self.registry.begin_stop(name):
            raise self._busy(name, "put to sleep")
        await self.scheduler.stop(name, "sleep", reason="put to sleep on request")
        return self.model_info(name)

    def _busy(self, name: str, action: str) -> ModelBusyError:
        """Why ``name`` cannot be ``action`` ("unloaded") now: requests use it (no preemption)."""
        entry = self.registry.entry(name)
        waiting = " and requests waiting" if self.registry.find(name) else ""
        return ModelBusyError(f"model {name!r} cannot be {action}: it is {entry.state} with "
                              f"{entry.active_requests} request(s) in flight{waiting}; retry when it is idle")

    def sleeps_after_s(self, name: str) -> float:
        """How long ``name`` stays loaded while idle (:meth:`ModelScheduler.sleeps_after_s`)."""
        return self.scheduler.sleeps_after_s(name)

    def keep_alive(self, name: str, seconds: float, *, unload: bool) -> None:
        """Ollama's keep_alive of a request (:meth:`ModelScheduler.keep_alive`). Only a request
        that may ``unload`` (it holds the admin token) unloads the model with 0; from any other,
        0 ends its own claim on the model and the model's idle rule applies again."""
        self.scheduler.keep_alive(name, seconds, unload=unload)

    # --- views -----------------------------------------------------------------------------------
    def model_info(self, name: str) -> dict[str, Any]:
        entry = self.registry.entry(name)
        preset = self.presets.get(name)
        deployment = self.orchestrator.deployments.get(name)
        queued = self.registry.find(name)
        progress = {ModelState.READY: 1.0, ModelState.LOADING: self.scheduler.progress(name)}.get(entry.state)
        info: dict[str, Any] = {"id": name, "object": "model", "owned_by": "ncm", **entry.to_dict(),
                                "waiters": queued.waiters if queued else 0, "progress": progress,
                                "requests_in_flight": self.admission.in_flight(name),
                                "max_requests_in_flight": self.admission.limits_of(name).max_requests_in_flight,
                                "queued_requests": self.admission.queued(name)}
        if preset is not None:
            info.update(aliases=list(preset.aliases), source=preset.source, store_model=preset.store_model,
                        settings={k: getattr(preset.settings, k) for k in (
                            "max_context", "prefill_chunk", "replicate_head_ratio", "replica_count",
                            "load_on_startup", "stop_timeout_s", "sleep_idle_s", "weights", "placement")})
        if deployment is not None:
            info.update(serving=deployment.order.model, degraded=deployment.order.degraded,
                        plan_version=deployment.order.plan_version, runs_on=list(deployment.serving_nodes()))
        return info

    def models(self) -> list[dict[str, Any]]:
        return [self.model_info(name) for name in sorted(self.registry.entries)]

    @property
    def admission(self) -> Admission:
        return self.gate.admission

    def subscribe(self) -> contextlib.AbstractContextManager[asyncio.Queue[dict[str, Any]]]:
        """`GET /models/sse`: events of every state change, starting with the state of every model."""
        return self.model_events.subscribe()
