"""The orchestrator: keeps the models the router loads deployed over the live nodes and keeps
them going when the nodes change (design §6–§8):

- a device on the route dies and every layer it served has a live holder: the cheapest
  holders are spliced into its place (their fragments were built ahead, as standby), and
  requests in flight replay their tokens so far on the new route and go on;
- some layer has no live holder: the fallback model is planned over the survivors and
  requests finish on it (degraded); with no survivor the cluster has failed;
- a device joins or comes back: the model is re-planned over every live node (no more often
  than `replan_min_interval_s`), and requests in flight finish on the plan they started on.

What to do is decided by :mod:`agent.core.deployments` (and :func:`agent.core.routing.failover`);
this class carries it out with a :class:`agent.orchestration.deployer.Deployer` (planning and the two-step
change of plan on every node) under one lock per model, and runs requests with a
:class:`agent.orchestration.token_loop.TokenLoop`. Several models can be deployed at once, each under its
router name (see :mod:`agent.models.router`, which decides what is loaded): :meth:`measure` plans a
model and works out the memory each device needs, :meth:`load` deploys it, :meth:`unload`
drops it from every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from agent.cluster.membership import Membership
from agent.cluster.peer_client import PeerClient
from agent.core.copies import copy_holders
from agent.core.deployments import (
    AdoptAndRecover,
    ClusterState,
    Replan,
    WaitToReplan,
    adoption_actions,
    failovers,
    orphaned_orders,
    replan_decision,
)
from agent.core.errors import ClusterError, NcmError
from agent.core.memory_ledger import MIB
from agent.core.node_report import WorkerReport
from agent.core.orders import RoutingOrder
from agent.core.plan import ShardingPlan, plan_from_dict
from agent.core.presets import ModelPreset, ModelSettings
from agent.core.recovery import Fail, Failover, recovery_decision
from agent.core.routing import Route, describe_layers, failover
from agent.dataplane.links import Replies
from agent.local.compat import timeout
from agent.local.config import AgentConfig
from agent.local.events import EventLog
from agent.orchestration.deployer import Deployer, Deployment, PlannedModel
from agent.orchestration.drafts import Drafts
from agent.orchestration.token_loop import Completion, TokenLoop
from agent.stage.worker import Worker
from shards.errors import ShardsError
from shards.runtime.sampling import SamplingParams
from shards.store.model_store import ModelStore

__all__ = ["Completion", "Deployment", "ModelHooks", "Orchestrator", "PlannedModel"]
log = logging.getLogger(__name__)
SETTLE_S = 0.5
RECONCILE_INTERVAL_S = 30.0  # a quiet orchestrator compares what nodes hold with its deployments this often


class ModelHooks(Protocol):
    """What the orchestrator tells the model router (:class:`agent.models.router.ModelRouter`), and
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
    """Carries out the deployment decisions of the models this node orchestrates.

    Over 250 lines: load, unload, re-plan, failover and adoption all change the same
    deployments under the same lock per model, and read best side by side."""

    def __init__(self, node_id: str, config: AgentConfig, membership: Membership, worker: Worker,
                 client: PeerClient, store: ModelStore, events: EventLog, models: ModelHooks, results: Replies) -> None:
        self.node_id = node_id
        self.events = events
        self.models = models
        self.config = config
        self.membership = membership
        self.worker = worker
        self.deployer = Deployer(node_id, config, membership, worker, client, store, models.on_progress)
        self.requests = TokenLoop(node_id, membership, worker, client, results, self.recover,
                                  Drafts(worker.fragments, self.deployer))
        self.deployments: dict[str, Deployment] = {}
        self.planned: dict[str, PlannedModel] = {}  # measured, and kept while a model sleeps
        self.state = ClusterState.STARTING
        self.message = "waiting for the membership to settle"
        self._deployed_members: frozenset[str] = frozenset()
        self._replan_pending = False  # a node left out of plans may be planned again
        self._last_replan = -float("inf")
        # One lock per model: a failover of one model does not wait for another model's load.
        self._locks: dict[str, asyncio.Lock] = {}

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

    def holdings(self) -> dict[str, dict[str, int]]:
        """node id -> {model: bytes} of complete models, for every live node."""
        return self.deployer.holdings()

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
                              "route": d.order.route.to_list(), "copies": list(d.order.copies),
                              "max_requests_per_copy": dict(d.copy_sessions),
                              "total_layers": d.plan.total_layers,
                              "layers": [{"layer": layer, "holders": list(holders)}
                                         for layer, holders in enumerate(d.plan.redundancy_map)],
                              "replicas": [[node, layers.to_list()] for node, layers in d.plan.replicas]}
                       for name, d in sorted(self.deployments.items())},
            "faults": {node: {"cause": f.cause, "message": f.message} for node, f in sorted(self.deployer.faults.items())},
        }

    def _set_state(self, state: ClusterState, message: str) -> None:
        if (state, message) != (self.state, self.message):
            (log.warning if state in (ClusterState.DEGRADED, ClusterState.FAILED) else log.info)("cluster %s: %s", state, message)
        self.state, self.message = state, message

    def _settle_state(self) -> None:
        degraded = sorted(n for n, d in self.deployments.items() if d.order.degraded)
        if degraded:
            self._set_state(ClusterState.DEGRADED, f"{', '.join(degraded)} served by a fallback")
        elif self.deployments:
            self._set_state(ClusterState.OK, f"serving {', '.join(sorted(self.deployments))}")
        elif self.state not in (ClusterState.FAILED, ClusterState.LOADING):
            self._set_state(ClusterState.IDLE, "no model is loaded; a request loads one")

    # --- loads, unloads, re-plans ------------------------------------------------------------
    def _lock(self, name: str) -> asyncio.Lock:
        """The lock of model ``name``'s deployment (its loads, re-plans, failovers and unloads)."""
        return self._locks.setdefault(name, asyncio.Lock())

    def _publish(self, deployment: Deployment) -> None:
        """Requests use ``deployment`` from now on (every node of its route has staged it)."""
        self.deployments[deployment.name] = deployment
        self._deployed_members = frozenset(deployment.order.addresses)

    async def _deploy(self, name: str, plan: ShardingPlan, route: Route, model: str, settings: ModelSettings, *,
                      degraded: bool, holdings: dict[str, dict[str, int]], failover: bool = False) -> Deployment:
        return await self.deployer.deploy(name, plan, route, model, settings, degraded=degraded, holdings=holdings,
                                          publish=self._publish, failover=failover)

    async def fetch_manifest(self, model: str) -> None:
        """Fetch ``model``'s manifest from a live node that holds it, when this node lacks it."""
        await self.deployer.fetch_manifest(model, self.holdings())

    async def measure(self, preset: ModelPreset) -> PlannedModel:
        """Plan ``preset`` over every live node and work out what each device needs (minimum);
        the plan is kept for the next :meth:`load`."""
        planned = self.planned[preset.name] = await self._plan(preset)
        return planned

    async def _plan(self, preset: ModelPreset) -> PlannedModel:
        """Plan ``preset`` as its placement says; "auto": whole copies on the nodes with room
        for one now, else the split (:func:`agent.core.copies.copy_holders`)."""
        planned = await self.deployer.plan_model(preset)
        if preset.settings.placement != "auto":
            return planned
        short = self.models.shortfall(preset.name, planned.min_bytes)
        if not short:
            return planned
        holders = copy_holders(planned.members, short)
        if holders:
            return await self.deployer.plan_model(preset, copies=True, nodes=holders)
        return await self.deployer.plan_model(preset, copies=False)

    async def load(self, preset: ModelPreset) -> Deployment:
        """Deploy a measured model (its kept plan while every node of it is alive, else a new one)."""
        async with self._lock(preset.name):
            planned = self.planned.get(preset.name)
            alive = set(self.membership.alive_nodes())
            if planned is None or planned.preset != preset or not planned.members <= alive:
                planned = await self.measure(preset)
            self._set_state(ClusterState.LOADING, f"loading {preset.name} on {len(planned.route.hops)} stage(s)")
            self._last_replan = time.monotonic()
            try:
                deployment = await self._deploy(preset.name, planned.plan, planned.route, preset.store_model,
                                                preset.settings, degraded=False, holdings=self.holdings())
            except (NcmError, ShardsError):
                await self.deployer.drop_orders(preset.name)
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
            await self.deployer.drop_orders(name)
            drafting = {d.settings.draft_model for d in self.deployments.values() if d.settings.draft_model}
            for draft in self.requests.drafts.take_unused(drafting):
                await asyncio.to_thread(draft.close)  # waits for a draft still running
            self._settle_state()

    def forget_plan(self, name: str) -> None:
        """A sleeping model that is unloaded: its next load plans it afresh."""
        self.planned.pop(name, None)

    async def replan(self, name: str, reason: str) -> None:
        """Plan a loaded model again over every live node and deploy it (§8)."""
        async with self._lock(name):
            preset = self.models.preset_of(name)
            if name not in self.deployments or preset is None or not self.membership.is_orchestrator:
                return
            self._last_replan = started = time.monotonic()
            was_degraded = self.deployments[name].order.degraded
            try:
                planned = await self._plan(preset)
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

    # --- failures ------------------------------------------------------------------------------
    async def recover(self, broken: Deployment, dead: set[str]) -> Deployment:
        """Fail over from ``broken`` after ``dead`` nodes died (§6, §7), as
        :func:`agent.core.recovery.recovery_decision` decides; returns what to use now. The one
        entry of a recovery: a request whose step failed calls it once, and the failure counts
        as evidence against those nodes (the membership's own recovery then finds it done)."""
        name = broken.name
        started = time.monotonic()
        for node_id in dead:
            self.membership.mark_unreachable(node_id)
        async with self._lock(name):
            current = self.deployments.get(name)
            if current is not None and not (set(current.order.route.nodes) & dead):
                return current  # another request already recovered, or whole copies died: the others serve
            base = current or broken
            alive = set(self.membership.alive_nodes()) - dead
            holdings = {n: m for n, m in self.holdings().items() if n in alive}
            scores = {n: s for n, s in self.membership.scores().items() if n in alive}
            telemetry = self.deployer.telemetry(scores)
            try:
                decision = recovery_decision(base.order.route, dead, base.plan, alive, telemetry,
                                             allow_fallback=self.config.allow_fallback)
                if isinstance(decision, Fail):
                    raise ClusterError(f"{name}: {decision.reason}")
                if isinstance(decision, Failover):
                    plan, route, model = base.plan, decision.route, base.order.model
                    degraded = base.order.degraded
                    message = f"{name}: lost {', '.join(sorted(dead))}; replicas took over"
                else:  # Degrade: the fallback model over the survivors
                    model = self.deployer.fallback_model(holdings)
                    manifest = await self.deployer.fetch_manifest(model, holdings)
                    layout = failover(base.order.route, dead, base.plan, alive, telemetry,
                                      fallback_model=model, fallback_layers=manifest.n_layers,
                                      survivor_scores=scores)
                    assert layout.plan is not None
                    plan, route, degraded = layout.plan, layout.route, True
                    message = (f"{name}: lost {', '.join(sorted(dead))} and layers "
                               f"{describe_layers(list(layout.lost_layers))}; serving {model}")
                deployment = await self._deploy(name, plan, route, model, base.settings, degraded=degraded,
                                                holdings=holdings, failover=True)
            except (NcmError, ShardsError) as error:
                reason = str(error) if isinstance(error, ClusterError) else f"failover failed: {error}"
                self.deployments.pop(name, None)
                self.forget_plan(name)
                self._set_state(ClusterState.FAILED, reason)
                self.models.on_deployment(name, None, reason)
                self.events.record("failover", reason, model=name, node=min(dead))
                raise ClusterError(reason) from None
            self._set_state(ClusterState.DEGRADED if degraded else ClusterState.OK, message)
            self.models.on_deployment(name, deployment, message)
            self.events.record("degraded" if degraded and not base.order.degraded else "failover", message,
                               model=name, node=min(dead), duration_s=time.monotonic() - started)
            return deployment

    async def _adopt_after_election(self) -> None:
        """A new orchestrator rebuilds its view from the orders workers report (newest per model)."""
        reports = [WorkerReport.from_json(self.worker.status())] + [
            report.worker for report in self.membership.peer_reports().values()]
        for action in adoption_actions(reports, self.membership.alive_nodes()):
            order = action.order
            name = order.name
            preset = self.models.preset_of(name)
            settings = preset.settings if preset is not None else ModelSettings(
                max_context=order.max_context or self.config.max_context,
                prefill_chunk=order.prefill_chunk or self.config.prefill_chunk)
            log.info("taking over plan %d of %s (epoch %d) from the workers' reports", order.plan_version, name, order.epoch)
            try:
                adopted = Deployment(name, order, plan_from_dict(order.plan), await self.deployer.tokenizer(order.model),
                                     settings, {})
                if isinstance(action, AdoptAndRecover):
                    await self.recover(adopted, set(action.dead))
                else:
                    async with self._lock(name):
                        deployment = await self._deploy(name, adopted.plan, order.route, order.model, settings,
                                                        degraded=order.degraded, holdings=self.holdings())
                    self.models.on_deployment(name, deployment, f"took over serving {order.model}")
            except (NcmError, ShardsError) as error:
                log.warning("could not take over %s (%s); it is unloaded", name, error)
                await self.deployer.drop_orders(name)
                self.models.on_deployment(name, None, f"could not take over: {error}")
        self._settle_state()

    async def reconcile(self) -> None:
        """Drop the orders nodes hold that no deployment names: a node that was frozen or away
        during an unload, an eviction or a sleep keeps its fragments until told again."""
        reports = {self.node_id: WorkerReport.from_json(self.worker.status()),
                   **{node: report.worker for node, report in self.membership.peer_reports().items()}}
        busy = [name for name, lock in self._locks.items() if lock.locked()]
        for action in orphaned_orders(reports, self.deployments, busy):
            for name in action.models:
                log.info("node %s still holds %s, which is not deployed: dropping it there", action.node, name)
                await self.deployer.drop_orders(name, [action.node])

    async def _on_members(self, members: frozenset[str], changes: asyncio.Event) -> None:
        """Fail over, re-plan, spread the fallback as :mod:`agent.core.deployments` decides
        after the members changed."""
        deployed = dict(self.deployments)  # a failover of one may end while another's is under way
        for action in failovers(members, {name: d.order.route.nodes for name, d in deployed.items()}):
            with contextlib.suppress(ClusterError):
                await self.recover(deployed[action.name], set(action.lost))
        self.models.on_members(members)
        self._replan_pending |= self.deployer.clear_faults(members)
        decision = replan_decision(members=members, deployed_members=self._deployed_members,
                                   deployed=bool(self.deployments), replan_pending=self._replan_pending,
                                   last_replan_s=self._last_replan, now_s=time.monotonic(),
                                   replan_min_interval_s=self.config.replan_min_interval_s)
        if isinstance(decision, WaitToReplan):
            log.info("re-planning in %.1f s (minimum interval between re-plans)", decision.wait_s)
            await asyncio.sleep(decision.wait_s)
            changes.set()  # look again after the pause
            return
        if isinstance(decision, Replan):
            self._replan_pending = False
            for name in list(self.deployments):
                await self.replan(name, decision.reason)
        self._deployed_members = members
        await self.reconcile()
        await self.deployer.spread_fallback()

    async def run(self) -> None:
        """React to membership changes while this node is the orchestrator (owned by the app)."""
        changes = self.membership.subscribe()
        was_orchestrator = False
        while True:
            try:
                async with timeout(RECONCILE_INTERVAL_S):
                    await changes.wait()
            except asyncio.TimeoutError:  # quiet for a while: orders nodes missed are dropped all the same
                if was_orchestrator and self.membership.is_orchestrator:
                    await self.reconcile()
                continue
            changes.clear()
            if not self.membership.is_orchestrator:
                if was_orchestrator:
                    log.info("no longer the orchestrator")
                    self.models.on_role(False)
                was_orchestrator = False
                self.deployments.clear()
                self.planned.clear()
                self.state, self.message = ClusterState.FOLLOWER, "another node is the orchestrator"
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
                    await self.deployer.spread_fallback()
                    continue
                await self._on_members(members, changes)
            except ClusterError as error:
                log.error("%s", error)

    # --- requests ---------------------------------------------------------------------------
    def complete(self, deployment: Deployment, prompt_ids: list[int], params: SamplingParams,
                 generated: Sequence[int] = (), *, cache_prompt: bool = True,
                 draft_tokens: int | None = None,
                 draft_p_min: float | None = None) -> AsyncIterator[Completion]:
        """Generate from ``prompt_ids`` (see :meth:`agent.orchestration.token_loop.TokenLoop.complete`)."""
        return self.requests.complete(deployment, prompt_ids, params, generated, cache_prompt=cache_prompt,
                                      draft_tokens=draft_tokens, draft_p_min=draft_p_min)

    async def embed(self, deployment: Deployment, ids: list[int]) -> np.ndarray:
        """The embedding of ``ids`` (see :meth:`agent.orchestration.token_loop.TokenLoop.embed`)."""
        return await self.requests.embed(deployment, ids)
