"""Carries out what the model registry (:mod:`agent.core.model_registry`) decides, each as a task
it owns: loads (measuring a model's plan first), evictions, and the sleep of a model idle longer
than its keep-alive. Every change of state goes to the event log and to the model events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from agent.core.errors import RETRY_AFTER_LOAD_S, ClusterError, ModelLoadError
from agent.core.memory_ledger import MIB
from agent.core.model_registry import Evict, Load, ModelRegistry, Refuse
from agent.local.compat import TaskGroup, timeout
from agent.local.events import EventLog
from agent.models.catalog import ModelCatalog
from agent.models.events import ModelEventStream
from agent.orchestration.orchestrator import Deployment, Orchestrator
from agent.orchestration.public_errors import public_reason

log = logging.getLogger(__name__)
SLEEP_CHECK_INTERVAL_S = 1.0


class ModelScheduler:
    def __init__(self, registry: ModelRegistry, catalog: ModelCatalog, orchestrator: Orchestrator,
                 events: EventLog, model_events: ModelEventStream, enabled: Callable[[], bool],
                 loaded: Callable[[str, Deployment], None]) -> None:
        """``enabled``: whether this node is the orchestrator (nothing is carried out otherwise);
        ``loaded(name, deployment)`` counts a model that is loaded in the registry."""
        self.registry = registry
        self._loaded = loaded
        self.catalog = catalog
        self.orchestrator = orchestrator
        self.events = events
        self.model_events = model_events
        self._enabled = enabled
        self.changed = asyncio.Event()  # set, and replaced, on every decision: waiters look again
        self._tasks: TaskGroup | None = None
        self._progress: dict[str, float] = {}  # share of the nodes holding a loading model's order
        # Per model, the idle time after which it sleeps as the last request asked (Ollama's
        # keep_alive); it overrides the preset's sleep_idle_s until the model stops.
        self._keep_alive_s: dict[str, float] = {}

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        if self._tasks is None:
            coro.close()
            raise ClusterError("the model router is not running")
        self._tasks.create_task(coro, name=name)

    def notify(self) -> None:
        """Wake whoever waits on :attr:`changed`."""
        self.changed.set()
        self.changed = asyncio.Event()

    def tick(self) -> None:
        """Carry out what the registry decides for the head of the queue."""
        while self._enabled():
            action = self.registry.next_action()
            if action is None:
                break
            if isinstance(action, Load):
                self._progress.pop(action.model, None)  # the last load's progress is not this one's
                self.model_events.status_changed(action.model)
                self.spawn(self._run_load(action), f"load {action.model}")
            elif isinstance(action, Evict):
                log.info("evicting %s (least recently used, idle) to load %s", action.victim, action.model)
                self.spawn(self.stop(action.victim, "evict", reason=f"evicted for {action.model}"),
                           f"evict {action.victim}")
            elif isinstance(action, Refuse):
                # Not a state change (unless the model goes back from measuring): its own event.
                log.warning("%s", action.error)
                if action.state_changed:
                    self.model_events.status_changed(action.model)
                self.model_events.load_refused(action.model, action.error)
        self.notify()

    def progress(self, name: str) -> float:
        """The share of the nodes that hold loading model ``name``'s order."""
        return self._progress.get(name, 0.0)

    def progressed(self, name: str, share: float) -> None:
        self._progress[name] = share

    async def _run_load(self, action: Load) -> None:
        name = action.model
        preset = self.catalog.presets.get(name)
        retry_after_s: float | None = RETRY_AFTER_LOAD_S
        try:
            if preset is None:
                raise ModelLoadError(f"model {name!r} is no longer in the sources")
            if preset.store_model not in self.catalog.stored():
                retry_after_s = None  # not before a node that stores them joins: the reason says so
                raise ModelLoadError(
                    f"no live node stores the weights of {preset.store_model!r}; start the node that holds them, "
                    f"or import them on one (ncm pull / ncm import)")
            if action.measure:
                if not self.catalog.store.has(preset.store_model):
                    # Known only from another node's holdings: its context length is known once
                    # its manifest is here, and the preset is built again with it.
                    await self.orchestrator.fetch_manifest(preset.store_model)
                    preset = self.catalog.reload(reread_file=False).get(name, preset)
                planned = await self.orchestrator.measure(preset)
                self.registry.measured(name, planned.min_bytes)
                log.info("%s needs %s", name, ", ".join(f"{n[:8]} {b / MIB:.0f} MiB" for n, b in sorted(planned.min_bytes.items())))
            else:
                started = time.monotonic()
                deployment = await self.orchestrator.load(preset)
                self._loaded(name, deployment)
                self.events.record("load", f"{name} loaded", model=name, duration_s=time.monotonic() - started)
        except asyncio.CancelledError:
            self.registry.failed(name, "the router stopped")
            raise
        except Exception as error:  # noqa: BLE001 - any failure of a load is recorded, the agent goes on
            log.warning("%s %s failed: %s", "measuring" if action.measure else "loading", name,
                        str(error) or type(error).__name__)
            self.registry.failed(name, public_reason(error), retry_after_s=retry_after_s)
            self.events.record("load_failed", f"{name} failed to load: {public_reason(error)}", model=name)
        self.model_events.status_changed(name)
        self.tick()

    async def stop(self, name: str, how: str, *, reason: str) -> None:
        """Stop ``name``: ``how`` is "sleep" (the plan is kept), "unload" or "evict"."""
        preset = self.catalog.presets.get(name)
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
            self.model_events.status_changed(name, reason=reason)
            self.tick()

    def sleeps_after_s(self, name: str) -> float:
        """How long ``name`` stays loaded while idle (0: until asked): Ollama's keep_alive of its
        last request, else its sleep_idle_s."""
        preset = self.catalog.presets.get(name)
        return self._keep_alive_s.get(name, preset.settings.sleep_idle_s if preset else 0.0)

    def keep_alive(self, name: str, seconds: float, *, unload: bool = True) -> None:
        """After this request, keep ``name`` loaded while it is idle for ``seconds`` (Ollama's
        keep_alive): 0 unloads it as soon as it is idle, a negative value keeps it loaded.
        With ``unload`` False (the request may not change the cluster), 0 only drops the
        request's own keep_alive: the model's idle rule (sleep_idle_s) applies again."""
        if seconds == 0:
            self._keep_alive_s.pop(name, None)
            if unload and self.registry.begin_stop(name):
                self.spawn(self.stop(name, "unload", reason="unloaded after the request (keep_alive 0)"),
                           f"unload {name}")
            return
        self._keep_alive_s[name] = seconds if seconds > 0 else 0.0  # 0 in the idle table: never

    async def run(self) -> None:
        """Own the loads, evictions and sleeps; put models to sleep when idle."""
        async with TaskGroup() as tasks:
            self._tasks = tasks
            try:
                while True:
                    await asyncio.sleep(SLEEP_CHECK_INTERVAL_S)
                    if not self._enabled():
                        continue
                    idle = {name: self.sleeps_after_s(name) for name in self.catalog.presets}
                    for name in self.registry.sleep_candidates(time.monotonic(), idle):
                        if self.registry.begin_stop(name):
                            log.info("%s idle for %g s: sleeping (plan kept)", name, idle[name])
                            self.spawn(self.stop(name, "sleep", reason="idle"), f"sleep {name}")
            finally:
                self._tasks = None
