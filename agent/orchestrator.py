"""The orchestrator: plans the model over the live nodes, deploys the plan (`set_routing` on
every worker), drives requests through the pipeline one step per token, and keeps them
going when a device dies (redundancy design §6–§8):

- a device on the route dies and every layer it served has a live holder: the cheapest
  holders are spliced into its place (their fragments were built ahead, as standby), and
  requests in flight replay their tokens so far on the new route and go on;
- some layer has no live holder: the fallback model is planned over the survivors and
  requests finish on it (degraded); with no survivor the cluster has failed;
- a device joins or comes back: the model is re-planned over every live node (no more often
  than `replan_min_interval_s`), and requests in flight finish on the plan they started on.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

import numpy as np

from agent.config import AgentConfig
from agent.core.errors import ClusterError, NcmError, RoutingFailure
from agent.core.orders import RoutingOrder
from agent.core.plan import ShardingPlan, make_plan, plan_from_dict
from agent.core.routing import Route, Telemetry, choose_route, describe_layers, failover, standby_hops
from agent.dataplane import StageError
from agent.membership import Membership
from agent.peer_client import PeerClient
from agent.weights import complete_models, ensure_model_files
from agent.worker import Worker
from shards.errors import ShardsError
from shards.generate import FINISH_LENGTH, TextStream
from shards.sampling import SamplingParams
from shards.store import ModelStore
from shards.tokenizer import Tokenizer

log = logging.getLogger(__name__)
ROUTING_PATH = "/internal/routing"
DEPLOY_TIMEOUT_S = 900.0
SETTLE_S = 0.5
PREFILL_STEP_TIMEOUT_S = 300.0
DECODE_STEP_TIMEOUT_S = 60.0
MAX_RECOVERIES_PER_REQUEST = 4
TINY_ALIAS = "ncm-tiny"


class NotServingError(ClusterError):
    """The cluster has no deployed model right now (starting, re-planning, or failed)."""


@dataclass(frozen=True)
class Completion:
    """One event of a completion as the API streams it; ``model`` is the model that produced it."""

    text: str
    model: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class _Deployment:
    order: RoutingOrder
    plan: ShardingPlan
    tokenizer: Tokenizer


class Orchestrator:
    def __init__(self, node_id: str, config: AgentConfig, membership: Membership, worker: Worker,
                 client: PeerClient, store: ModelStore) -> None:
        self.node_id = node_id
        self.config = config
        self.membership = membership
        self.worker = worker
        self.client = client
        self.store = store
        self.active: _Deployment | None = None
        self.plan_version = 0
        self.state = "starting"
        self.message = "waiting for the membership to settle"
        self._deployed_members: frozenset[str] = frozenset()
        self._last_replan = -float("inf")
        self._lock = asyncio.Lock()
        self._tokenizers: dict[str, Tokenizer] = {}

    # --- status ---------------------------------------------------------------------------
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
        }

    def _set_state(self, state: str, message: str) -> None:
        if (state, message) != (self.state, self.message):
            (log.warning if state in ("degraded", "failed") else log.info)("cluster %s: %s", state, message)
        self.state, self.message = state, message

    # --- what the cluster has -------------------------------------------------------------------
    def _holdings(self) -> dict[str, dict[str, int]]:
        """node id -> {model: bytes} of complete models, for every live node."""
        holdings = {self.node_id: complete_models(self.store)}
        for node_id, extra in self.membership.peer_extras().items():
            models = extra.get("models")
            holdings[node_id] = {k: int(v) for k, v in models.items()} if isinstance(models, dict) else {}
        return holdings

    def _sources(self, model: str, holdings: dict[str, dict[str, int]]) -> list[str]:
        """URLs to fetch ``model``'s files from: live nodes holding it whole (this node first),
        then every other live node, which may hold some of its layers."""
        ranked = sorted(holdings, key=lambda n: (model not in holdings[n], n != self.node_id, n))
        return [self.membership.address_of(n) for n in ranked]

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

    # --- deployment ------------------------------------------------------------------------
    async def _deploy(self, plan: ShardingPlan, route: Route, model: str, *, degraded: bool,
                      holdings: dict[str, dict[str, int]]) -> _Deployment:
        """Send a new order to every planned node; the new deployment is active once all hold it."""
        election = self.membership.election
        if election is None or election.orchestrator != self.node_id:
            raise ClusterError("this node is no longer the orchestrator")
        scores = {n: s for n, s in plan.scores if n in self.membership.alive_nodes()}
        alive = set(scores)
        self.plan_version = max(self.plan_version, self._newest_worker_plan()) + 1
        order = RoutingOrder(
            epoch=election.epoch, orchestrator=self.node_id, plan_version=self.plan_version, model=model,
            total_layers=plan.total_layers, route=route,
            addresses={n: self.membership.address_of(n) for n in alive},
            weight_sources=tuple(self._sources(model, holdings)), plan=plan.to_dict(), degraded=degraded,
            standby={n: tuple(sorted(r)) for n, r in standby_hops(plan, route, alive, self._telemetry(scores)).items()},
        )
        await ensure_model_files(self.client, self.store, model, lambda m: [], list(order.weight_sources))
        results = await asyncio.gather(*(self._send_order(n, order) for n in sorted(alive)), return_exceptions=True)
        failed = {n: r for n, r in zip(sorted(alive), results) if isinstance(r, BaseException)}
        if failed:
            for node_id, error in failed.items():
                log.warning("node %s did not take plan %d: %s", node_id, order.plan_version, error)
            route_failures = [n for n in failed if n in route.nodes]
            if route_failures:
                raise ClusterError(f"node(s) {', '.join(route_failures)} could not take plan {order.plan_version}: "
                                   f"{failed[route_failures[0]]}")
        deployment = _Deployment(order, plan, await self._tokenizer(model))
        self.active = deployment
        self._deployed_members = frozenset(alive)
        log.info("plan %d deployed (%s): %s", order.plan_version, model,
                 " -> ".join(f"{h.node_id[:8]}[{h.layers}]" for h in route.hops))
        return deployment

    def _newest_worker_plan(self) -> int:
        versions = [self.worker.current.plan_version if self.worker.current else 0]
        for extra in self.membership.peer_extras().values():
            worker = extra.get("worker") or {}
            if isinstance(worker.get("plan_version"), int):
                versions.append(worker["plan_version"])
        return max(versions)

    async def _send_order(self, node_id: str, order: RoutingOrder) -> None:
        if node_id == self.node_id:
            await self.worker.apply(order)
            return
        await self.client.request_json("POST", order.addresses[node_id], ROUTING_PATH, order.to_json(),
                                       timeout_s=DEPLOY_TIMEOUT_S)

    async def replan(self, reason: str) -> None:
        """Plan the main model over every live node and deploy it (§8)."""
        async with self._lock:
            if not self.membership.is_orchestrator:
                return
            model = self.config.model
            holdings = self._holdings()
            scores = self.membership.scores()
            self._set_state("loading", f"planning {model} over {len(scores)} node(s): {reason}")
            self._last_replan = time.monotonic()
            try:
                manifest = await ensure_model_files(self.client, self.store, model, lambda m: [],
                                                    self._sources(model, holdings))
                plan = make_plan(scores, manifest.n_layers, replicate_head_ratio=self.config.replicate_head_ratio,
                                 replica_count=self.config.replica_count,
                                 min_layers_per_node=self.config.min_layers_per_node)
                route = choose_route(plan, scores, self._telemetry(scores))
                await self._deploy(plan, route, model, degraded=False, holdings=holdings)
            except (NcmError, ShardsError) as error:
                self._set_state("failed", f"cannot serve {model}: {error}")
                return
            self._set_state("ok", f"serving {model} on {len(route.hops)} stage(s)")

    async def recover(self, broken: _Deployment, dead: set[str]) -> _Deployment:
        """Fail over from ``broken`` after ``dead`` nodes died (§6, §7); returns what to use now."""
        async with self._lock:
            current = self.active
            if current is not None and current is not broken and not (set(current.order.route.nodes) & dead):
                return current  # another request already recovered
            base = current or broken
            alive = set(self.membership.alive_nodes()) - dead
            holdings = {n: m for n, m in self._holdings().items() if n in alive}
            scores = {n: s for n, s in self.membership.scores().items() if n in alive}
            telemetry = self._telemetry(scores)
            try:
                try:
                    decision = failover(base.order.route, dead, base.plan, alive, telemetry, allow_fallback=False)
                    plan, route, model = base.plan, decision.route, base.order.model
                    degraded = base.order.degraded
                    message = f"lost {', '.join(sorted(dead))}; replicas took over"
                except RoutingFailure as failure:
                    if not self.config.allow_fallback:
                        self._set_state("failed", f"{failure}")
                        raise ClusterError(str(failure)) from None
                    model = self.resolve_fallback(holdings)
                    manifest = await ensure_model_files(self.client, self.store, model, lambda m: [],
                                                        self._sources(model, holdings))
                    decision = failover(base.order.route, dead, base.plan, alive, telemetry,
                                        fallback_model=model, fallback_layers=manifest.n_layers,
                                        survivor_scores=scores)
                    assert decision.plan is not None
                    plan, route, degraded = decision.plan, decision.route, True
                    message = f"lost {', '.join(sorted(dead))} and layers {describe_layers(list(decision.lost_layers))}; serving {model}"
                deployment = await self._deploy(plan, route, model, degraded=degraded, holdings=holdings)
            except ClusterError as error:
                if "no surviving node" in str(error) or not alive:
                    self._set_state("failed", str(error))
                raise
            except (NcmError, ShardsError) as error:
                self._set_state("failed", f"failover failed: {error}")
                raise ClusterError(f"failover failed: {error}") from None
            self._set_state("degraded" if degraded else "ok", message)
            return deployment

    async def _adopt_after_election(self) -> None:
        """A new orchestrator rebuilds its view from the orders workers report (newest wins)."""
        orders: list[RoutingOrder] = []
        if self.worker.current is not None:
            orders.append(self.worker.current)
        for extra in self.membership.peer_extras().values():
            raw = (extra.get("worker") or {}).get("order")
            if raw:
                try:
                    orders.append(RoutingOrder.from_json(raw))
                except NcmError:
                    continue
        if not orders:
            await self.replan("first deployment")
            return
        newest = max(orders, key=lambda o: o.plan_version)
        alive = set(self.membership.alive_nodes())
        dead = set(newest.route.nodes) - alive
        log.info("taking over plan %d of epoch %d from the workers' reports", newest.plan_version, newest.epoch)
        try:
            adopted = _Deployment(newest, plan_from_dict(newest.plan), await self._tokenizer(newest.model))
            if dead:
                await self.recover(adopted, dead)
            else:
                async with self._lock:
                    await self._deploy(adopted.plan, newest.route, newest.model, degraded=newest.degraded,
                                       holdings=self._holdings())
                    self._set_state("degraded" if newest.degraded else "ok", f"took over serving {newest.model}")
        except (NcmError, ShardsError) as error:
            log.warning("could not take over plan %d (%s); re-planning", newest.plan_version, error)
            await self.replan("new orchestrator")

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
                was_orchestrator = False
                self.active = None
                self.state, self.message = "follower", "another node is the orchestrator"
                continue
            await asyncio.sleep(SETTLE_S)  # let a burst of changes settle
            changes.clear()
            try:
                if not was_orchestrator:
                    was_orchestrator = True
                    await self._adopt_after_election()
                    continue
                members = frozenset(self.membership.alive_nodes())
                active = self.active
                lost = set(active.order.route.nodes) - members if active else set()
                if active is not None and lost:
                    await self.recover(active, lost)
                elif active is None or members - self._deployed_members:
                    wait_s = self._last_replan + self.config.replan_min_interval_s - time.monotonic()
                    if wait_s > 0:
                        log.info("re-planning in %.1f s (minimum interval between re-plans)", wait_s)
                        await asyncio.sleep(wait_s)
                        changes.set()  # look again after the pause
                        continue
                    await self.replan("a node joined" if active else "first deployment")
            except ClusterError as error:
                log.error("%s", error)

    # --- requests ---------------------------------------------------------------------------
    def require_serving(self) -> _Deployment:
        active = self.active
        if active is None or self.state not in ("ok", "degraded"):
            raise NotServingError(f"the cluster is not serving ({self.state}: {self.message})")
        return active

    async def _step(self, order: RoutingOrder, header: dict[str, Any], tensor: np.ndarray, timeout_s: float) -> int | None:
        head = order.route.hops[0].node_id
        try:
            async with asyncio.timeout(timeout_s):
                result, _ = await self.worker.forward_to(order, head, header, tensor, timeout_s=timeout_s)
        except TimeoutError:
            raise StageError("stage_timeout", f"the pipeline did not answer within {timeout_s:g} s", head) from None
        return result["token"]

    async def _prefill(self, order: RoutingOrder, sid: str, ids: list[int], sampling: dict[str, Any]) -> int:
        """Feed ``ids`` from position 0 in chunks; the last chunk samples the next token."""
        chunk = self.config.prefill_chunk
        token: int | None = None
        for seq, start in enumerate(range(0, len(ids), chunk)):
            header = {"kind": "step", "sid": sid, "seq": seq, "layer": 0, "start": start, "epoch": order.epoch,
                      "plan": order.plan_version, "sample": start + chunk >= len(ids), "params": sampling}
            token = await self._step(order, header, np.asarray([ids[start:start + chunk]], dtype=np.int64), PREFILL_STEP_TIMEOUT_S)
        assert token is not None
        return token

    async def complete(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Completion]:
        """Generate from ``prompt_ids``: yields text pieces, the last event has the finish reason.

        When a stage fails, the request continues on what :meth:`recover` returns, after
        replaying its tokens so far (prompt + generated) there: nothing is lost or repeated.
        """
        deployment = self.require_serving()
        if len(prompt_ids) + 1 > self.config.max_context:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; this cluster's context is {self.config.max_context}")
        sampling = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p, "seed": params.seed}
        stream = TextStream(deployment.tokenizer, params)
        context = list(prompt_ids)  # every token whose KV the stages must hold before the next step
        recoveries = 0
        sid = uuid.uuid4().hex
        try:
            token = None
            while True:
                order = deployment.order
                try:
                    if token is None:
                        token = await self._prefill(order, sid, context, sampling)
                    text = stream.push(token)
                    if stream.done:
                        yield Completion(text, order.model, stream.finish_reason, len(prompt_ids), stream.completion_tokens)
                        return
                    if len(context) + 1 >= self.config.max_context:
                        yield Completion(text + stream.finish(FINISH_LENGTH), order.model, FINISH_LENGTH,
                                         len(prompt_ids), stream.completion_tokens)
                        return
                    if text:
                        yield Completion(text, order.model)
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
        head = order.route.hops[0].node_id
        if head == self.node_id:
            await self.worker.close_session(sid, 0, order.plan_version)
        elif self.membership.table.url_of(head) is not None:
            link = await self.worker.links.get(head, order.addresses[head])
            await link.send({"kind": "close", "sid": sid, "layer": 0, "plan": order.plan_version})
