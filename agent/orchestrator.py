"""The orchestrator: plans the model over the live nodes, deploys the plan (`set_routing` on
every worker), drives requests through the pipeline one step per token, and keeps them
going when a device dies (design §6–§8):

- a device on the route dies and every layer it served has a live holder: the cheapest
  holders are spliced into its place (their fragments were built ahead, as standby), and
  requests in flight replay their tokens so far on the new route and go on;
- some layer has no live holder: the fallback model is planned over the survivors and
  requests finish on it (degraded); with no survivor the cluster has failed;
- a device joins or comes back: the model is re-planned over every live node (no more often
  than `replan_min_interval_s`), and requests in flight finish on the plan they started on.

A plan changes atomically: every node stages the new order (weights fetched, fragments built)
while the old one keeps serving, and only when every node of the new route has staged it is it
committed everywhere; otherwise it is aborted everywhere and the old plan goes on. A node that
could not stage it is marked with the cause (``disk_full``, ``out_of_memory``...) and left out
of plans until something about it changes.

Several models can be deployed at once, each under its router name (see :mod:`agent.router`,
which decides what is loaded): :meth:`measure` plans a model and works out the memory each
device needs, :meth:`load` deploys it, :meth:`unload` drops it from every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from agent.compat import timeout
from agent.config import AgentConfig
from agent.core.chat_request import InvalidRequestError
from agent.core.errors import ClusterError, NcmError, RoutingFailure
from agent.core.model_registry import MIB
from agent.core.orders import RoutingOrder
from agent.core.plan import ShardingPlan, make_plan, plan_from_dict
from agent.core.presets import ModelPreset, ModelSettings
from agent.core.routing import Route, Telemetry, choose_route, describe_layers, failover, standby_hops
from agent.dataplane import StageError
from agent.events import EventLog
from agent.membership import Membership
from agent.peer_client import PeerClient, PeerError
from agent.protocol import ABORT_PATH, COMMIT_PATH, COPY_PATH, ROUTING_PATH, UNLOAD_PATH
from agent.weights import complete_models, ensure_model_files
from agent.worker import Worker
from shards.errors import ShardsError
from shards.generate import FINISH_LENGTH, TextStream
from shards.manifest import Manifest
from shards.sampling import SamplingParams
from shards.store import ModelStore
from shards.tokenizer import Tokenizer

log = logging.getLogger(__name__)
ORDER_STEP_TIMEOUT_S = 30.0
UNLOAD_TIMEOUT_S = 30.0
RUNTIME_OVERHEAD_BYTES = 24 * 1024 * 1024  # per fragment: the runtime session and its buffers
DEPLOY_TIMEOUT_S = 900.0
SETTLE_S = 0.5
PREFILL_STEP_TIMEOUT_S = 300.0
DECODE_STEP_TIMEOUT_S = 60.0
MAX_RECOVERIES_PER_REQUEST = 4
TINY_ALIAS = "ncm-tiny"


@dataclass(frozen=True)
class Completion:
    """One event of a completion as the API streams it; ``model`` is the model that produced it."""

    text: str
    model: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tokens: tuple[int, ...] = ()  # the sampled ids behind this event's text (since the previous event)


@dataclass
class Deployment:
    """A model running on the devices under its router ``name`` (``order.model`` may be its fallback)."""

    name: str
    order: RoutingOrder
    plan: ShardingPlan
    tokenizer: Tokenizer
    settings: ModelSettings
    effective_bytes: dict[str, int]


@dataclass(frozen=True)
class NodeFault:
    """Why a node could not stage a plan; it is left out of plans while ``fingerprint`` (what
    it advertises and holds) is unchanged and it has not withdrawn the fault itself."""

    cause: str
    message: str
    fingerprint: str
    reported: bool = False  # the node itself has reported the fault (so withdrawing it means something)


@dataclass(frozen=True)
class PlannedModel:
    """A measured model: its plan over ``members`` and the memory each device needs (minimum)."""

    preset: ModelPreset
    plan: ShardingPlan
    route: Route
    members: frozenset[str]
    min_bytes: dict[str, int]


def min_bytes_per_node(manifest: Manifest, ranges: dict[str, set[tuple[int, int]]], max_context: int) -> dict[str, int]:
    """Memory each node needs for its layer ranges: weights + one full-context KV cache + runtime."""
    need = {}
    for node, node_ranges in ranges.items():
        files = {key for a, b in node_ranges for key in manifest.fragment_files(a, b)}
        layers = {layer for a, b in node_ranges for layer in range(a, b + 1)}
        need[node] = (sum(manifest.files[key].bytes for key in files)
                      + manifest.kv_bytes_per_token(len(layers)) * max_context
                      + RUNTIME_OVERHEAD_BYTES * len(node_ranges))
    return need


class ModelHooks(Protocol):
    """What the orchestrator tells the model router (:class:`agent.router.ModelRouter`), and
    asks it."""

    def on_role(self, is_orchestrator: bool) -> None:
        """This node became (or stopped being) the orchestrator."""

    def on_members(self, members: frozenset[str]) -> None:
        """The live members changed."""

    def on_deployment(self, name: str, deployment: Deployment | None, reason: str) -> None:
        """A deployment changed by itself (failover, re-plan, loss: None)."""

    def on_progress(self, name: str, nodes_done: int, nodes: int) -> None:
        """A model's order is held by ``nodes_done`` of ``nodes`` nodes."""

    def preset_of(self, name: str) -> ModelPreset | None:
        """The preset of router model ``name``."""

    def shortfall(self, name: str, min_bytes: Mapping[str, int]) -> Mapping[str, int]:
        """Per node, the bytes model ``name`` would lack with a plan needing ``min_bytes``."""


class Orchestrator:
    def __init__(self, node_id: str, config: AgentConfig, membership: Membership, worker: Worker,
                 client: PeerClient, store: ModelStore, events: EventLog, models: ModelHooks) -> None:
        self.node_id = node_id
        self.events = events
        self.models = models
        self.config = config
        self.membership = membership
        self.worker = worker
        self.client = client
        self.store = store
        self.deployments: dict[str, Deployment] = {}
        self.planned: dict[str, PlannedModel] = {}  # measured, and kept while a model sleeps
        self.plan_version = 0
        self.state = "starting"
        self.message = "waiting for the membership to settle"
        self._deployed_members: frozenset[str] = frozenset()
        self.faults: dict[str, NodeFault] = {}
        self._replan_pending = False  # a node left out of plans may be planned again
        self._last_replan = -float("inf")
        # One lock per model: a failover of one model does not wait for another model's load.
        self._locks: dict[str, asyncio.Lock] = {}
        self._tokenizers: dict[str, Tokenizer] = {}

    # --- status ---------------------------------------------------------------------------
    @property
    def active(self) -> Deployment | None:
        """The deployment of the main model (else of any model), for the cluster views."""
        return self.deployments.get(self.config.model) or next(iter(self.deployments.values()), None)

    @property
    def order(self) -> RoutingOrder | None:
        return self.active.order if self.active else None

    @property
    def plan(self) -> ShardingPlan | None:
        return self.active.plan if self.active else None

    def status(self) -> dict[str, Any]:
        order = self.order
        return {
            "state": self.state,
            "message": self.message,
            "model": order.model if order else self.config.model,
            "main_model": self.config.model,
            "degraded": bool(order and order.degraded),
            "plan_version": order.plan_version if order else None,
            "epoch": order.epoch if order else None,
            "route": order.route.to_list() if order else None,
            "models": {name: {"serving": d.order.model, "degraded": d.order.degraded, "plan_version": d.order.plan_version,
                              "route": d.order.route.to_list(), "total_layers": d.plan.total_layers,
                              "layers": [{"layer": layer, "holders": list(holders)}
                                         for layer, holders in enumerate(d.plan.redundancy_map)],
                              "replicas": [[node, layers.to_list()] for node, layers in d.plan.replicas]}
                       for name, d in sorted(self.deployments.items())},
            "faults": {node: {"cause": f.cause, "message": f.message} for node, f in sorted(self.faults.items())},
        }

    def _set_state(self, state: str, message: str) -> None:
        if (state, message) != (self.state, self.message):
            (log.warning if state in ("degraded", "failed") else log.info)("cluster %s: %s", state, message)
        self.state, self.message = state, message

    def _settle_state(self) -> None:
        degraded = sorted(n for n, d in self.deployments.items() if d.order.degraded)
        if degraded:
            self._set_state("degraded", f"{', '.join(degraded)} served by a fallback")
        elif self.deployments:
            self._set_state("ok", f"serving {', '.join(sorted(self.deployments))}")
        elif self.state not in ("failed", "loading"):
            self._set_state("idle", "no model is loaded; a request loads one")

    # --- what the cluster has -------------------------------------------------------------------
    def holdings(self) -> dict[str, dict[str, int]]:
        """node id -> {model: bytes} of complete models, for every live node."""
        holdings = {self.node_id: complete_models(self.store)}
        for node_id, extra in self.membership.peer_extras().items():
            models = extra.get("models")
            holdings[node_id] = {k: int(v) for k, v in models.items()} if isinstance(models, dict) else {}
        return holdings

    def _sources(self, model: str, holdings: dict[str, dict[str, int]]) -> list[str]:
        """Nodes to fetch ``model``'s files from: live nodes holding it whole (this node first),
        then every other live node, which may hold some of its layers."""
        return sorted(holdings, key=lambda n: (model not in holdings[n], n != self.node_id, n))

    def _addressed(self, nodes: list[str]) -> list[tuple[str, str]]:
        return [(n, self.membership.peer_address_of(n)) for n in nodes]

    def resolve_fallback(self, holdings: dict[str, dict[str, int]]) -> str:
        """The configured fallback; `ncm-tiny` means the smallest model some live node holds whole."""
        if self.config.fallback_model != TINY_ALIAS:
            return self.config.fallback_model
        sizes: dict[str, int] = {}
        for models in holdings.values():
            sizes.update(models)
        if TINY_ALIAS in sizes:
            return TINY_ALIAS
        if not sizes:
            raise ClusterError("no live node holds a whole model to fall back to")
        return min(sizes, key=lambda name: (sizes[name], name))

    def _telemetry(self, scores: dict[str, float]) -> dict[str, Telemetry]:
        return {n: Telemetry(latency_ms=self.membership.latency_ms(n), capacity_score=s) for n, s in scores.items()}

    async def _tokenizer(self, model: str) -> Tokenizer:
        if model not in self._tokenizers:
            self._tokenizers[model] = await asyncio.to_thread(Tokenizer.from_model_dir, self.store.models_dir / model)
        return self._tokenizers[model]

    def _require_orchestrator(self) -> None:
        election = self.membership.election
        if election is None or election.orchestrator != self.node_id:
            raise ClusterError("this node is no longer the orchestrator")

    # --- deployment ------------------------------------------------------------------------
    async def _deploy(self, name: str, plan: ShardingPlan, route: Route, model: str, settings: ModelSettings, *,
                      degraded: bool, holdings: dict[str, dict[str, int]], failover: bool = False) -> Deployment:
        """Send a new order to every planned node; the new deployment is active once all hold it."""
        self._require_orchestrator()
        election = self.membership.election
        assert election is not None
        scores = {n: s for n, s in plan.scores if n in self.membership.alive_nodes()}
        alive = set(scores)
        self.plan_version = max(self.plan_version, self._newest_worker_plan()) + 1
        order = RoutingOrder(
            epoch=election.epoch, orchestrator=self.node_id, plan_version=self.plan_version, model=model,
            total_layers=plan.total_layers, route=route,
            addresses={n: self.membership.peer_address_of(n) for n in alive},
            weight_sources=tuple(n for n in self._sources(model, holdings) if n in alive), plan=plan.to_dict(), degraded=degraded,
            standby={n: tuple(sorted(r)) for n, r in standby_hops(plan, route, alive, self._telemetry(scores)).items()},
            name=name, max_context=settings.max_context, prefill_chunk=settings.prefill_chunk,
            standby_later=failover,
        )
        await ensure_model_files(self.client, self.store, model, lambda m: [], order.sources())
        nodes = sorted(alive)
        nodes_done = 0

        async def send(node_id: str) -> dict[str, Any]:
            nonlocal nodes_done
            try:
                return await self._send_order(node_id, order)
            finally:
                nodes_done += 1
                self.models.on_progress(name, nodes_done, len(nodes))

        results = await asyncio.gather(*(send(n) for n in nodes), return_exceptions=True)
        failed = {n: r for n, r in zip(nodes, results) if isinstance(r, BaseException)}
        staged = [n for n in nodes if n not in failed]
        for node_id, error in failed.items():
            log.warning("node %s did not stage plan %d: %s", node_id, order.plan_version, error)
            self._record_fault(node_id, error)
        route_failures = [n for n in failed if n in route.nodes]
        if route_failures:
            await self._order_step(ABORT_PATH, order, staged)
            first = route_failures[0]
            cause = self.faults[first].cause if first in self.faults else "unreachable"
            raise ClusterError(f"node(s) {', '.join(route_failures)} could not stage plan {order.plan_version} "
                               f"({cause}): {failed[first]}")
        effective = {}
        for node_id, result in zip(nodes, results):
            if isinstance(result, dict):
                memory = ((result.get("staged") or {}).get(name) or {}).get("memory_bytes")
                if isinstance(memory, int) and memory > 0:
                    effective[node_id] = memory
        deployment = Deployment(name, order, plan, await self._tokenizer(model), settings, effective)
        # Every node of the route holds the order (a staged order answers steps): requests may
        # use it from now on, and the nodes switch to it.
        self.deployments[name] = deployment
        self._deployed_members = frozenset(alive)
        await self._order_step(COMMIT_PATH, order, staged)
        log.info("plan %d deployed (%s as %s): %s", order.plan_version, model, name,
                 " -> ".join(f"{h.node_id[:8]}[{h.layers}]" for h in route.hops))
        return deployment

    async def _order_step(self, path: str, order: RoutingOrder, nodes: list[str]) -> None:
        """Commit or abort ``order`` on ``nodes`` (a node that misses it is logged: a commit it
        missed leaves it serving the older plan, whose requests it still answers)."""
        body = {"name": order.name, "plan_version": order.plan_version, "epoch": order.epoch}

        async def step(node_id: str) -> None:
            if node_id == self.node_id:
                call = self.worker.commit if path == COMMIT_PATH else self.worker.abort
                await call(order.name, order.plan_version, order.epoch)
            else:
                await self.client.request_json("POST", order.addresses[node_id], path, body, target=node_id,
                                               timeout_s=ORDER_STEP_TIMEOUT_S)

        results = await asyncio.gather(*(step(n) for n in nodes), return_exceptions=True)
        for node_id, result in zip(nodes, results):
            if isinstance(result, BaseException):
                log.warning("node %s missed the %s of plan %d: %s", node_id, path.rsplit("/", 1)[-1],
                            order.plan_version, result)

    async def _spread_fallback(self) -> None:
        """Ask every live node that lacks it to hold the fallback model whole (when its disk has
        room), so that losing any single node leaves a node that can serve it."""
        if not self.config.allow_fallback:
            return
        holdings = self.holdings()
        try:
            model = self.resolve_fallback(holdings)
        except ClusterError:
            return
        holders = [n for n, models in holdings.items() if model in models]
        if not holders:
            return
        body = {"model": model, "sources": self._addressed(self._sources(model, holdings))}

        async def ask(node_id: str) -> None:
            if node_id == self.node_id:
                self.worker.keep_whole_copy(model, [tuple(s) for s in body["sources"]])
            else:
                await self.client.request_json("POST", self.membership.peer_address_of(node_id), COPY_PATH, body,
                                               target=node_id, timeout_s=ORDER_STEP_TIMEOUT_S)

        lacking = sorted(n for n in holdings if n not in holders)
        if self.config.fallback_copies:
            lacking = lacking[:max(0, self.config.fallback_copies - len(holders))]
        for node_id, result in zip(lacking, await asyncio.gather(*(ask(n) for n in lacking), return_exceptions=True)):
            if isinstance(result, BaseException):
                log.debug("node %s was not asked to keep %s: %s", node_id, model, result)

    # --- nodes that could not stage a plan ----------------------------------------------------
    def _fingerprint(self, node_id: str) -> str:
        advert = self.membership.alive_nodes().get(node_id)
        capacity = advert.capacity.to_dict() if advert else None
        return json.dumps([capacity, self.holdings().get(node_id)], sort_keys=True)

    def _reported_fault(self, node_id: str) -> Any:
        if node_id == self.node_id:
            return self.worker.fault
        return ((self.membership.peer_extras().get(node_id) or {}).get("worker") or {}).get("fault")

    def _record_fault(self, node_id: str, error: BaseException) -> None:
        if node_id == self.node_id:
            fault = self.worker.fault
        elif isinstance(error, PeerError) and isinstance(error.answer, dict) and error.answer.get("cause"):
            fault = {"cause": str(error.answer["cause"]), "message": str(error.answer.get("error", ""))}
        else:
            return  # unreachable, or a stale order: nothing to hold against the node
        if fault:
            self.faults[node_id] = NodeFault(fault["cause"], fault["message"], self._fingerprint(node_id))
            log.warning("node %s is left out of plans until it changes: %s (%s)", node_id, fault["cause"],
                        fault["message"])

    def _clear_faults(self, members: frozenset[str]) -> bool:
        """Forget the faults of nodes that left, changed, or withdrew them; True if a live node
        may be planned again."""
        cleared = False
        for node_id, fault in list(self.faults.items()):
            reported = self._reported_fault(node_id) is not None
            if node_id not in members:
                del self.faults[node_id]
            elif self._fingerprint(node_id) != fault.fingerprint or (fault.reported and not reported):
                del self.faults[node_id]
                cleared = True
                log.info("node %s changed: it is planned again", node_id)
            elif reported and not fault.reported:
                self.faults[node_id] = replace(fault, reported=True)
        return cleared

    def _plannable_scores(self) -> dict[str, Any]:
        return {n: s for n, s in self.membership.scores().items() if n not in self.faults}

    def _newest_worker_plan(self) -> int:
        versions = [self.worker.current.plan_version if self.worker.current else 0]
        for extra in self.membership.peer_extras().values():
            worker = extra.get("worker") or {}
            if isinstance(worker.get("plan_version"), int):
                versions.append(worker["plan_version"])
        return max(versions)

    async def _send_order(self, node_id: str, order: RoutingOrder) -> dict[str, Any]:
        if node_id == self.node_id:
            return await self.worker.stage(order)
        return await self.client.request_json("POST", order.addresses[node_id], ROUTING_PATH, order.to_json(),
                                              target=node_id, timeout_s=DEPLOY_TIMEOUT_S)

    async def measure(self, preset: ModelPreset) -> PlannedModel:
        """Plan ``preset`` over every live node and work out what each device needs (minimum);
        the plan is kept for the next :meth:`load`."""
        planned = await self._plan_model(preset)
        self.planned[preset.name] = planned
        return planned

    async def _plan_model(self, preset: ModelPreset) -> PlannedModel:
        self._require_orchestrator()
        holdings = self.holdings()
        scores = self._plannable_scores()
        manifest = await ensure_model_files(self.client, self.store, preset.store_model, lambda m: [],
                                            self._addressed(self._sources(preset.store_model, holdings)))
        settings = preset.settings
        if settings.weights is not None and manifest.weight_format != settings.weights:
            raise ClusterError(f"the preset of {preset.name} asks for {settings.weights} weights but "
                               f"{preset.store_model} is stored as {manifest.weight_format}")
        if settings.max_context > manifest.context_length:
            raise ClusterError(f"{preset.name}: context {settings.max_context} is beyond what "
                               f"{preset.store_model} was trained for ({manifest.context_length})")
        plan = make_plan(scores, manifest.n_layers, replicate_head_ratio=settings.replicate_head_ratio,
                         replica_count=settings.replica_count, min_layers_per_node=self.config.min_layers_per_node)
        route = choose_route(plan, scores, self._telemetry(scores))
        standby = standby_hops(plan, route, set(scores), self._telemetry(scores))
        ranges: dict[str, set[tuple[int, int]]] = {n: set() for n in scores}
        for hop in route.hops:
            ranges[hop.node_id].add((hop.layers.first, hop.layers.last))
        for node, node_ranges in standby.items():
            ranges[node] |= {(r.first, r.last) for r in node_ranges}
        need = min_bytes_per_node(manifest, {n: r for n, r in ranges.items() if r}, settings.max_context)
        return PlannedModel(preset, plan, route, frozenset(scores), need)

    async def load(self, preset: ModelPreset) -> Deployment:
        """Deploy a measured model (its kept plan while every node of it is alive, else a new one)."""
        async with self._lock(preset.name):
            planned = self.planned.get(preset.name)
            alive = set(self.membership.alive_nodes())
            if planned is None or planned.preset != preset or not planned.members <= alive:
                planned = await self.measure(preset)
            self._set_state("loading", f"loading {preset.name} on {len(planned.route.hops)} stage(s)")
            self._last_replan = time.monotonic()
            try:
                deployment = await self._deploy(preset.name, planned.plan, planned.route, preset.store_model,
                                                preset.settings, degraded=False, holdings=self.holdings())
            except (NcmError, ShardsError):
                await self._drop_orders(preset.name)
                self._settle_state()
                raise
            self._settle_state()
            return deployment

    async def unload(self, name: str, *, keep_plan: bool = False) -> None:
        """Drop model ``name`` from every worker (sleep: ``keep_plan``, the next load reuses it)."""
        async with self._lock(name):
            self.deployments.pop(name, None)
            if not keep_plan:
                self.forget_plan(name)
            await self._drop_orders(name)
            self._settle_state()

    def _lock(self, name: str) -> asyncio.Lock:
        """The lock of model ``name``'s deployment (its loads, re-plans, failovers and unloads)."""
        return self._locks.setdefault(name, asyncio.Lock())

    def forget_plan(self, name: str) -> None:
        """A sleeping model that is unloaded: its next load plans it afresh."""
        self.planned.pop(name, None)

    async def _drop_orders(self, name: str) -> None:
        election = self.membership.election
        epoch = election.epoch if election else self.worker.newest_epoch

        async def drop(node_id: str) -> None:
            if node_id == self.node_id:
                await self.worker.unload(name, epoch)
            else:
                await self.client.request_json("POST", self.membership.peer_address_of(node_id), UNLOAD_PATH,
                                               {"name": name, "epoch": epoch}, target=node_id,
                                               timeout_s=UNLOAD_TIMEOUT_S)

        nodes = sorted(self.membership.alive_nodes())
        results = await asyncio.gather(*(drop(n) for n in nodes), return_exceptions=True)
        for node_id, result in zip(nodes, results):
            if isinstance(result, BaseException):
                log.warning("node %s did not unload %s: %s", node_id, name, result)

    async def replan(self, name: str, reason: str) -> None:
        """Plan a loaded model again over every live node and deploy it (§8)."""
        async with self._lock(name):
            preset = self.models.preset_of(name)
            if name not in self.deployments or preset is None or not self.membership.is_orchestrator:
                return
            self._last_replan = started = time.monotonic()
            was_degraded = self.deployments[name].order.degraded
            try:
                planned = await self._plan_model(preset)
                short = self.models.shortfall(name, planned.min_bytes)
                if short:
                    lacking = ", ".join(f"{node} lacks {missing / MIB:.0f} MiB" for node, missing in sorted(short.items()))
                    log.warning("not re-planning %s (%s): the new plan does not fit (%s); it keeps its plan",
                                name, reason, lacking)
                    return
                deployment = await self._deploy(name, planned.plan, planned.route, preset.store_model,
                                                preset.settings, degraded=False, holdings=self.holdings())
            except (NcmError, ShardsError) as error:
                log.warning("cannot re-plan %s (%s); it keeps its plan", name, error)
                return
            self.planned[name] = planned
            log.info("re-planned %s: %s", name, reason)
            self.models.on_deployment(name, deployment, reason)
            self._settle_state()
            self.events.record("recovered" if was_degraded else "replan", f"re-planned {name}: {reason}", model=name,
                               duration_s=time.monotonic() - started)

    async def recover(self, broken: Deployment, dead: set[str]) -> Deployment:
        """Fail over from ``broken`` after ``dead`` nodes died (§6, §7); returns what to use now."""
        name = broken.name
        started = time.monotonic()
        async with self._lock(name):
            current = self.deployments.get(name)
            if current is not None and current is not broken and not (set(current.order.route.nodes) & dead):
                return current  # another request already recovered
            base = current or broken
            alive = set(self.membership.alive_nodes()) - dead
            holdings = {n: m for n, m in self.holdings().items() if n in alive}
            scores = {n: s for n, s in self.membership.scores().items() if n in alive}
            telemetry = self._telemetry(scores)
            try:
                try:
                    decision = failover(base.order.route, dead, base.plan, alive, telemetry, allow_fallback=False)
                    plan, route, model = base.plan, decision.route, base.order.model
                    degraded = base.order.degraded
                    message = f"{name}: lost {', '.join(sorted(dead))}; replicas took over"
                except RoutingFailure as failure:
                    if not self.config.allow_fallback:
                        raise ClusterError(f"{name}: {failure}") from None
                    model = self.resolve_fallback(holdings)
                    manifest = await ensure_model_files(self.client, self.store, model, lambda m: [],
                                                        self._addressed(self._sources(model, holdings)))
                    decision = failover(base.order.route, dead, base.plan, alive, telemetry,
                                        fallback_model=model, fallback_layers=manifest.n_layers,
                                        survivor_scores=scores)
                    assert decision.plan is not None
                    plan, route, degraded = decision.plan, decision.route, True
                    message = (f"{name}: lost {', '.join(sorted(dead))} and layers "
                               f"{describe_layers(list(decision.lost_layers))}; serving {model}")
                deployment = await self._deploy(name, plan, route, model, base.settings, degraded=degraded,
                                                holdings=holdings, failover=True)
            except (NcmError, ShardsError) as error:
                reason = str(error) if isinstance(error, ClusterError) else f"failover failed: {error}"
                self.deployments.pop(name, None)
                self.forget_plan(name)
                self._set_state("failed", reason)
                self.models.on_deployment(name, None, reason)
                self.events.record("failover", reason, model=name, node=min(dead))
                raise ClusterError(reason) from None
            self._set_state("degraded" if degraded else "ok", message)
            self.models.on_deployment(name, deployment, message)
            self.events.record("degraded" if degraded and not base.order.degraded else "failover", message,
                               model=name, node=min(dead), duration_s=time.monotonic() - started)
            return deployment

    async def _adopt_after_election(self) -> None:
        """A new orchestrator rebuilds its view from the orders workers report (newest per model)."""
        newest: dict[str, RoutingOrder] = {}
        reports = [self.worker.status()] + [extra.get("worker") or {} for extra in self.membership.peer_extras().values()]
        for report in reports:
            for raw in report.get("orders") or []:
                try:
                    order = RoutingOrder.from_json(raw)
                except NcmError:
                    continue
                if order.name not in newest or order.plan_version > newest[order.name].plan_version:
                    newest[order.name] = order
        alive = set(self.membership.alive_nodes())
        for name, order in sorted(newest.items()):
            preset = self.models.preset_of(name)
            settings = preset.settings if preset is not None else ModelSettings(
                max_context=order.max_context or self.config.max_context,
                prefill_chunk=order.prefill_chunk or self.config.prefill_chunk)
            log.info("taking over plan %d of %s (epoch %d) from the workers' reports", order.plan_version, name, order.epoch)
            try:
                adopted = Deployment(name, order, plan_from_dict(order.plan), await self._tokenizer(order.model),
                                     settings, {})
                dead = set(order.route.nodes) - alive
                if dead:
                    await self.recover(adopted, dead)
                else:
                    async with self._lock(name):
                        deployment = await self._deploy(name, adopted.plan, order.route, order.model, settings,
                                                        degraded=order.degraded, holdings=self.holdings())
                    self.models.on_deployment(name, deployment, f"took over serving {order.model}")
            except (NcmError, ShardsError) as error:
                log.warning("could not take over %s (%s); it is unloaded", name, error)
                await self._drop_orders(name)
                self.models.on_deployment(name, None, f"could not take over: {error}")
        self._settle_state()

    async def run(self) -> None:
        """React to membership changes while this node is the orchestrator (owned by the app)."""
        changes = self.membership.subscribe()
        was_orchestrator = False
        while True:
            await changes.wait()
            changes.clear()
            if not self.membership.is_orchestrator:
                if was_orchestrator:
                    log.info("no longer the orchestrator")
                    self.models.on_role(False)
                was_orchestrator = False
                self.deployments.clear()
                self.planned.clear()
                self.state, self.message = "follower", "another node is the orchestrator"
                continue
            await asyncio.sleep(SETTLE_S)  # let a burst of changes settle
            changes.clear()
            try:
                members = frozenset(self.membership.alive_nodes())
                if not was_orchestrator:
                    was_orchestrator = True
                    self._deployed_members = members
                    await self._adopt_after_election()
                    self.models.on_role(True)
                    await self._spread_fallback()
                    continue
                for deployment in list(self.deployments.values()):
                    lost = set(deployment.order.route.nodes) - members
                    if lost:
                        with contextlib.suppress(ClusterError):
                            await self.recover(deployment, lost)
                self.models.on_members(members)
                self._replan_pending |= self._clear_faults(members)
                if self.deployments and (members - self._deployed_members or self._replan_pending):
                    wait_s = self._last_replan + self.config.replan_min_interval_s - time.monotonic()
                    if wait_s > 0:
                        log.info("re-planning in %.1f s (minimum interval between re-plans)", wait_s)
                        await asyncio.sleep(wait_s)
                        changes.set()  # look again after the pause
                        continue
                    reason = "a node joined" if members - self._deployed_members else "a node that could not stage a plan changed"
                    self._replan_pending = False
                    for name in list(self.deployments):
                        await self.replan(name, reason)
                self._deployed_members = members
                await self._spread_fallback()
            except ClusterError as error:
                log.error("%s", error)

    # --- requests ---------------------------------------------------------------------------
    async def _step(self, order: RoutingOrder, header: dict[str, Any], tensor: np.ndarray, timeout_s: float) -> int | None:
        head = order.route.hops[0].node_id
        try:
            async with timeout(timeout_s):
                result, _ = await self.worker.forward_to(order, head, header, tensor, timeout_s=timeout_s)
        except asyncio.TimeoutError:
            raise StageError("stage_timeout", f"the pipeline did not answer within {timeout_s:g} s", head) from None
        return result["token"]

    async def _prefill(self, deployment: Deployment, order: RoutingOrder, sid: str, ids: list[int],
                       sampling: dict[str, Any]) -> int:
        """Feed ``ids`` from position 0 in chunks; the last chunk samples the next token."""
        chunk = deployment.settings.prefill_chunk
        token: int | None = None
        for seq, start in enumerate(range(0, len(ids), chunk)):
            header = {"kind": "step", "sid": sid, "seq": seq, "layer": 0, "start": start, "epoch": order.epoch,
                      "plan": order.plan_version, "sample": start + chunk >= len(ids), "params": sampling}
            token = await self._step(order, header, np.asarray([ids[start:start + chunk]], dtype=np.int64), PREFILL_STEP_TIMEOUT_S)
        assert token is not None
        return token

    async def complete(self, deployment: Deployment, prompt_ids: list[int], params: SamplingParams,
                       generated: Sequence[int] = ()) -> AsyncIterator[Completion]:
        """Generate from ``prompt_ids``: yields text pieces, the last event has the finish reason.

        When a stage fails, the request continues on what :meth:`recover` returns, after
        replaying its tokens so far (prompt + generated) there: nothing is lost or repeated.
        ``generated``: the ids an earlier orchestrator sampled for this request before it was
        lost (their text was sent already): the request goes on after them.
        """
        max_context = deployment.settings.max_context
        if len(prompt_ids) + len(generated) + 1 > max_context:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the context of {deployment.name} is {max_context}")
        sampling = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p, "seed": params.seed}
        stream = TextStream(deployment.tokenizer, params)
        for token in generated:  # their text went out already: only the stream's state matters
            stream.push(token)
            if stream.done:
                raise InvalidRequestError("the tokens to go on after end the generation already", "ncm_resume")
        context = [*prompt_ids, *generated]  # every token whose KV the stages must hold before the next step
        unsent: list[int] = []  # sampled ids whose text has not gone out yet
        recoveries = 0
        sid = uuid.uuid4().hex
        try:
            token = None
            while True:
                order = deployment.order
                served = order.model if order.degraded else order.name
                try:
                    if token is None:
                        token = await self._prefill(deployment, order, sid, context, sampling)
                    text = stream.push(token)
                    unsent.append(token)
                    if stream.done:
                        yield Completion(text, served, stream.finish_reason, len(prompt_ids), stream.completion_tokens,
                                         tuple(unsent))
                        return
                    if len(context) + 1 >= max_context:
                        yield Completion(text + stream.finish(FINISH_LENGTH), served, FINISH_LENGTH,
                                         len(prompt_ids), stream.completion_tokens, tuple(unsent))
                        return
                    if text:
                        yield Completion(text, served, tokens=tuple(unsent))
                        unsent.clear()
                    context.append(token)
                    header = {"kind": "step", "sid": sid, "seq": len(context), "layer": 0, "start": len(context) - 1,
                              "epoch": order.epoch, "plan": order.plan_version, "sample": True}
                    token = None
                    token = await self._step(order, header, np.asarray([[context[-1]]], dtype=np.int64), DECODE_STEP_TIMEOUT_S)
                except StageError as error:
                    if error.node is None or error.node == self.node_id or recoveries >= MAX_RECOVERIES_PER_REQUEST:
                        raise
                    recoveries += 1
                    log.warning("request %s: stage %s failed (%s); failing over", sid[:8], error.node, error.code)
                    self.membership.mark_unreachable(error.node)
                    await self._close(order, sid)
                    previous = deployment
                    deployment = await self.recover(deployment, {error.node})
                    if deployment.order.model != previous.order.model and deployment.tokenizer.vocab_size != previous.tokenizer.vocab_size:
                        raise ClusterError("the fallback model uses another tokenizer; the request cannot continue on it") from None
                    sid = uuid.uuid4().hex
                    token = None  # replay everything so far on the new route
        finally:
            await self._close(deployment.order, sid)

    async def _close(self, order: RoutingOrder, sid: str) -> None:
        """Free ``sid`` on every stage of ``order``'s route: each is told directly, so that a
        dead or frozen stage does not keep the ones after it holding the session (its own go
        when it has been idle for a while)."""
        alive = self.membership.alive_nodes()
        for node_id in order.route.nodes:
            if node_id == self.node_id:
                self.worker.close_session(sid)
            elif node_id in alive:
                link = await self.worker.links.get(node_id, order.addresses[node_id])
                layer = order.hops_of(node_id)[0].layers.first
                await link.send({"kind": "close", "sid": sid, "layer": layer, "plan": order.plan_version})