"""Deploying plans on the devices (design §5, §8): what the live nodes hold, planning a model
over them, and the two-step change of plan on every node of it.

A plan changes atomically: every node stages the new order (weights fetched, fragments built)
while the old one keeps serving, and only when every node of the new route has staged it is it
committed everywhere; otherwise it is aborted everywhere and the old plan goes on. A node that
could not stage it is marked with the cause (``disk_full``, ``out_of_memory``...) and left out
of plans until something about it changes (:func:`agent.core.deployments.clear_faults`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from agent.cluster.membership import Membership
from agent.cluster.peer_client import PeerClient, PeerError
from agent.core.deployments import NodeFault, clear_faults, resolve_fallback, weight_sources
from agent.core.errors import ClusterError
from agent.core.node_report import StageFault, WorkerReport
from agent.core.orders import RoutingOrder
from agent.core.plan import ShardingPlan, make_copies_plan, make_plan
from agent.core.presets import ModelPreset, ModelSettings
from agent.core.protocol import (
    ABORT_PATH,
    COMMIT_PATH,
    COPY_PATH,
    ROUTING_PATH,
    UNLOAD_PATH,
    CopyOrder,
    OrderStep,
    UnloadOrder,
)
from agent.core.routing import Route, Telemetry, choose_route, copy_nodes, standby_hops
from agent.local.config import AgentConfig
from agent.stage.weights import complete_models, ensure_model_files
from agent.stage.worker import Worker
from shards.store.manifest import Manifest
from shards.store.model_store import ModelStore
from shards.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)
ORDER_STEP_TIMEOUT_S = 30.0
UNLOAD_TIMEOUT_S = 30.0
DEPLOY_TIMEOUT_S = 900.0
STAGE_LIVENESS_CHECK_S = 1.0  # how often a node's staging is checked against membership
RUNTIME_OVERHEAD_BYTES = 24 * 1024 * 1024  # per fragment: the runtime session and its buffers


@dataclass
class Deployment:
    """A model running on the devices under its router ``name`` (``order.model`` may be its fallback)."""

    name: str
    order: RoutingOrder
    plan: ShardingPlan
    tokenizer: Tokenizer
    settings: ModelSettings
    effective_bytes: dict[str, int]
    # per whole copy's node, the requests its memory holds KV caches for (the router counts
    # them when the model loads, design §11); empty: the copies take requests evenly
    copy_sessions: dict[str, int] = field(default_factory=dict)

    def serving_nodes(self) -> tuple[str, ...]:
        """Where a request may run: the route's head, then each whole copy (design §11)."""
        return (self.order.route.hops[0].node_id, *self.order.copies)


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
        need[node] = (sum(manifest.files[key].loaded_bytes for key in files)
                      + manifest.kv_bytes_per_token(len(layers)) * max_context
                      + RUNTIME_OVERHEAD_BYTES * len(node_ranges))
    return need


class Deployer:
    """Plans models over the live nodes and sends, commits, aborts and drops their orders.
    ``on_progress(name, nodes_done, nodes)`` follows a deployment node by node.

    Over 250 lines: planning and the two-step change of orders share the nodes' faults and
    the plan versions, which neither may change alone."""

    def __init__(self, node_id: str, config: AgentConfig, membership: Membership, worker: Worker,
                 client: PeerClient, store: ModelStore, on_progress: Callable[[str, int, int], None]) -> None:
        self.node_id = node_id
        self.config = config
        self.membership = membership
        self.worker = worker
        self.client = client
        self.store = store
        self._on_progress = on_progress
        self.plan_version = 0
        self.faults: dict[str, NodeFault] = {}
        self._tokenizers: dict[str, Tokenizer] = {}

    # --- what the cluster has -------------------------------------------------------------------
    def holdings(self) -> dict[str, dict[str, int]]:
        """node id -> {model: bytes} of complete models, for every live node."""
        holdings = {self.node_id: complete_models(self.store)}
        holdings.update({node_id: dict(report.models) for node_id, report in self.membership.peer_reports().items()})
        return holdings

    def sources(self, model: str, holdings: dict[str, dict[str, int]]) -> list[tuple[str, str]]:
        """Where to fetch ``model``'s files from, as (node, address), best first."""
        return [(n, self.membership.peer_address_of(n)) for n in weight_sources(model, holdings, self.node_id)]

    def fallback_model(self, holdings: dict[str, dict[str, int]]) -> str:
        return resolve_fallback(self.config.fallback_model, holdings)

    def telemetry(self, scores: dict[str, float]) -> dict[str, Telemetry]:
        return {n: Telemetry(latency_ms=self.membership.latency_ms(n), capacity_score=s) for n, s in scores.items()}

    async def fetch_manifest(self, model: str, holdings: dict[str, dict[str, int]]) -> Manifest:
        """``model``'s manifest, fetched from a live node when this node lacks it."""
        return await ensure_model_files(self.client, self.store, model, lambda m: [], self.sources(model, holdings))

    async def tokenizer(self, model: str) -> Tokenizer:
        if model not in self._tokenizers:
            self._tokenizers[model] = await asyncio.to_thread(Tokenizer.from_model_dir, self.store.models_dir / model)
        return self._tokenizers[model]

    def require_orchestrator(self) -> None:
        election = self.membership.election
        if election is None or election.orchestrator != self.node_id:
            raise ClusterError("this node is no longer the orchestrator")

    # --- planning ---------------------------------------------------------------------------------
    async def plan_model(self, preset: ModelPreset, *, copies: bool | None = None,
                         nodes: Collection[str] | None = None) -> PlannedModel:
        """Plan ``preset`` over every live node not left out (of ``nodes``, when given), and
        what each device needs: whole copies (design §11) with ``copies`` (None: as its
        placement says, "auto" counting as copies), else the seed's split."""
        self.require_orchestrator()
        scores = {n: s for n, s in self.membership.scores().items()
                  if n not in self.faults and (nodes is None or n in nodes)}
        manifest = await self.fetch_manifest(preset.store_model, self.holdings())
        settings = preset.settings
        if settings.weights is not None and manifest.weight_format != settings.weights:
            raise ClusterError(f"the preset of {preset.name} asks for {settings.weights} weights but "
                               f"{preset.store_model} is stored as {manifest.weight_format}")
        if settings.max_context > manifest.context_length:
            raise ClusterError(f"{preset.name}: context {settings.max_context} is beyond what "
                               f"{preset.store_model} was trained for ({manifest.context_length})")
        whole = settings.placement != "split" if copies is None else copies
        if whole:
            plan = make_copies_plan(scores, manifest.n_layers)
        else:
            plan = make_plan(scores, manifest.n_layers, replicate_head_ratio=settings.replicate_head_ratio,
                             replica_count=settings.replica_count, min_layers_per_node=self.config.min_layers_per_node)
        route = choose_route(plan, scores, self.telemetry(scores))
        standby = standby_hops(plan, route, set(scores), self.telemetry(scores))
        ranges: dict[str, set[tuple[int, int]]] = {n: set() for n in scores}
        for hop in route.hops:
            ranges[hop.node_id].add((hop.layers.first, hop.layers.last))
        for node in copy_nodes(plan, route, scores):
            ranges[node].add((0, plan.total_layers - 1))
        for node, node_ranges in standby.items():
            ranges[node] |= {(r.first, r.last) for r in node_ranges}
        need = min_bytes_per_node(manifest, {n: r for n, r in ranges.items() if r}, settings.max_context)
        return PlannedModel(preset, plan, route, frozenset(scores), need)

    # --- the two-step change of plan ----------------------------------------------------------------
    async def deploy(self, name: str, plan: ShardingPlan, route: Route, model: str, settings: ModelSettings, *,
                     degraded: bool, holdings: dict[str, dict[str, int]], publish: Callable[[Deployment], None],
                     failover: bool = False) -> Deployment:
        """Stage a new order on every planned node, then commit it. Once every node of its route
        has staged it (a staged order answers steps), the deployment is handed to ``publish``,
        before the commit: requests may use it from then on."""
        self.require_orchestrator()
        election = self.membership.election
        assert election is not None
        scores = {n: s for n, s in plan.scores if n in self.membership.alive_nodes()}
        alive = set(scores)
        if not set(route.nodes) <= alive:
            raise ClusterError(f"the route of {name} goes through node(s) no longer alive: "
                               f"{', '.join(sorted(set(route.nodes) - alive))}")
        self.plan_version = max(self.plan_version, self._newest_worker_plan()) + 1
        order = RoutingOrder(
            epoch=election.epoch, orchestrator=self.node_id, plan_version=self.plan_version, model=model,
            total_layers=plan.total_layers, route=route,
            addresses={n: self.membership.peer_address_of(n) for n in alive},
            weight_sources=tuple(n for n in weight_sources(model, holdings, self.node_id) if n in alive),
            plan=plan.to_dict(), degraded=degraded,
            standby={n: tuple(sorted(r)) for n, r in standby_hops(plan, route, alive, self.telemetry(scores)).items()},
            name=name, max_context=settings.max_context, prefill_chunk=settings.prefill_chunk,
            standby_later=failover, copies=copy_nodes(plan, route, alive),
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
                self._on_progress(name, nodes_done, len(nodes))

        results = await asyncio.gather(*(send(n) for n in nodes), return_exceptions=True)
        failed = {n: r for n, r in zip(nodes, results) if isinstance(r, BaseException)}
        staged = [n for n in nodes if n not in failed]
        for node_id, error in failed.items():
            log.warning("node %s did not stage plan %d: %s", node_id, order.plan_version, error)
            self._record_fault(node_id, error)
        route_failures = [n for n in failed if n in route.nodes or n in order.copies]  # a copy serves requests
        if route_failures:
            await self._order_step(ABORT_PATH, order, staged)
            first = route_failures[0]
            cause = self.faults[first].cause if first in self.faults else "unreachable"
            raise ClusterError(f"node(s) {', '.join(route_failures)} could not stage plan {order.plan_version} "
                               f"({cause}): {failed[first]}")
        effective = {}
        for node_id, result in zip(nodes, results):
            memory = WorkerReport.from_json(result).staged_bytes.get(name, 0) if isinstance(result, dict) else 0
            if memory > 0:
                effective[node_id] = memory
        deployment = Deployment(name, order, plan, await self.tokenizer(model), settings, effective)
        publish(deployment)
        await self._order_step(COMMIT_PATH, order, staged)
        log.info("plan %d deployed (%s as %s): %s%s", order.plan_version, model, name,
                 " -> ".join(f"{h.node_id[:8]}[{h.layers}]" for h in route.hops),
                 "".join(f", whole on {n[:8]}" for n in order.copies))
        return deployment

    async def _send_order(self, node_id: str, order: RoutingOrder) -> dict[str, Any]:
        """Have ``node_id`` stage ``order``. Staging may take minutes (weights to fetch,
        fragments to build), so the wait ends early when membership finds the node gone or
        frozen (a failed step counts too): a re-plan waiting on it would hold up every failover."""
        if node_id == self.node_id:
            return await self.worker.stage(order)
        staging = asyncio.ensure_future(self.client.request_json(
            "POST", order.addresses[node_id], ROUTING_PATH, order.to_json(), target=node_id,
            timeout_s=DEPLOY_TIMEOUT_S))
        try:
            while not (await asyncio.wait({staging}, timeout=STAGE_LIVENESS_CHECK_S))[0]:
                if node_id not in self.membership.alive_nodes():
                    raise PeerError(order.addresses[node_id], f"node {node_id} stopped answering while it staged "
                                    f"plan {order.plan_version}")
            return staging.result()
        finally:
            staging.cancel()

    async def _order_step(self, path: str, order: RoutingOrder, nodes: list[str]) -> None:
        """Commit or abort ``order`` on ``nodes`` (a node that misses it is logged: a commit it
        missed leaves it serving the older plan, whose requests it still answers)."""
        body = OrderStep(order.name, order.plan_version, order.epoch).to_json()

        async def step(node_id: str) -> None:
            if node_id == self.node_id:
                call = self.worker.commit if path == COMMIT_PATH else self.worker.abort
                await call(order.name, order.plan_version, order.epoch)
            else:
                await self.client.request_json("POST", order.addresses[node_id], path, body, target=node_id,
                                               timeout_s=ORDER_STEP_TIMEOUT_S)

        await self._on_every(nodes, step, f"the {path.rsplit('/', 1)[-1]} of plan {order.plan_version}")

    async def drop_orders(self, name: str, nodes: Iterable[str] | None = None) -> None:
        """Unload model ``name`` from ``nodes`` (default: every live node)."""
        election = self.membership.election
        epoch = election.epoch if election else self.worker.newest_epoch

        async def drop(node_id: str) -> None:
            if node_id == self.node_id:
                await self.worker.unload(name, epoch)
            else:
                await self.client.request_json("POST", self.membership.peer_address_of(node_id), UNLOAD_PATH,
                                               UnloadOrder(name, epoch).to_json(), target=node_id,
                                               timeout_s=UNLOAD_TIMEOUT_S)

        targets = sorted(self.membership.alive_nodes() if nodes is None else nodes)
        await self._on_every(targets, drop, f"the unload of {name}")

    @staticmethod
    async def _on_every(nodes: list[str], call: Callable[[str], Any], what: str) -> None:
        """Run ``call`` on every node at once; a node that misses it is logged."""
        results = await asyncio.gather(*(call(n) for n in nodes), return_exceptions=True)
        for node_id, result in zip(nodes, results):
            if isinstance(result, BaseException):
                log.warning("node %s missed %s: %s", node_id, what, result)

    async def spread_fallback(self) -> None:
        """Ask every live node that lacks it to hold the fallback model whole (when its disk has
        room), so that losing any single node leaves a node that can serve it."""
        if not self.config.allow_fallback:
            return
        holdings = self.holdings()
        try:
            model = self.fallback_model(holdings)
        except ClusterError:
            return
        holders = [n for n, models in holdings.items() if model in models]
        if not holders:
            return
        copy = CopyOrder(model, tuple(self.sources(model, holdings)))

        async def ask(node_id: str) -> None:
            if node_id == self.node_id:
                self.worker.keep_whole_copy(copy.model, list(copy.sources))
            else:
                await self.client.request_json("POST", self.membership.peer_address_of(node_id), COPY_PATH,
                                               copy.to_json(), target=node_id, timeout_s=ORDER_STEP_TIMEOUT_S)

        lacking = sorted(n for n in holdings if n not in holders)
        if self.config.fallback_copies:
            lacking = lacking[:max(0, self.config.fallback_copies - len(holders))]
        for node_id, result in zip(lacking, await asyncio.gather(*(ask(n) for n in lacking), return_exceptions=True)):
            if isinstance(result, BaseException):
                log.debug("node %s was not asked to keep %s: %s", node_id, model, result)

    # --- nodes that could not stage a plan ----------------------------------------------------
    def _fingerprint(self, node_id: str, holdings: dict[str, dict[str, int]]) -> str:
        """What must change for a faulty node to be planned again: its devices, its memory in
        whole GiB, the models it stores. Not its latency or load, which move every round."""
        advert = self.membership.alive_nodes().get(node_id)
        capacity = advert.capacity if advert else None
        devices = None if capacity is None else [capacity.vram_gib, capacity.npu_tops, round(capacity.ram_gib)]
        return json.dumps([devices, holdings.get(node_id)], sort_keys=True)

    def _reports_fault(self, node_id: str) -> bool:
        if node_id == self.node_id:
            return self.worker.fault is not None
        report = self.membership.peer_reports().get(node_id)
        return report is not None and report.worker.fault is not None

    def _record_fault(self, node_id: str, error: BaseException) -> None:
        if node_id == self.node_id:
            fault = self.worker.fault
        elif isinstance(error, PeerError):
            fault = StageFault.from_json(error.peer_answer)
        else:
            return  # unreachable, or a stale order: nothing to hold against the node
        if fault is not None:
            self.faults[node_id] = NodeFault(fault.cause, fault.message, self._fingerprint(node_id, self.holdings()))
            log.warning("node %s is left out of plans until it changes: %s (%s)", node_id, fault.cause, fault.message)

    def clear_faults(self, members: frozenset[str]) -> bool:
        """Forget the faults of nodes that left, changed, or withdrew them; True if a live node
        may be planned again."""
        holdings = self.holdings()
        self.faults, cleared = clear_faults(
            self.faults, members=members, fingerprints={n: self._fingerprint(n, holdings) for n in self.faults},
            reported=[n for n in self.faults if self._reports_fault(n)])
        for node_id in cleared:
            log.info("node %s changed: it is planned again", node_id)
        return bool(cleared)

    def _newest_worker_plan(self) -> int:
        versions = [self.worker.current.plan_version if self.worker.current else 0]
        versions += [report.worker.plan_version for report in self.membership.peer_reports().values()
                     if report.worker.plan_version is not None]
        return max(versions)
