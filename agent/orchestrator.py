"""The orchestrator: plans the model over the live nodes, deploys the plan (set_routing on
every worker) and drives requests through the pipeline, one step per token."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

import numpy as np

from agent.config import AgentConfig
from agent.core.errors import ClusterError, NcmError
from agent.core.orders import RoutingOrder
from agent.core.plan import ShardingPlan, make_plan
from agent.core.routing import Telemetry, choose_route
from agent.dataplane import StageError
from agent.membership import Membership
from agent.peer_client import PeerClient, PeerError
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


class NotServingError(ClusterError):
    """The cluster has no deployed model right now (starting, re-planning, or failed)."""


@dataclass(frozen=True)
class Completion:
    """One event of a completion as the API streams it."""

    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Orchestrator:
    def __init__(self, node_id: str, config: AgentConfig, membership: Membership, worker: Worker,
                 client: PeerClient, store: ModelStore) -> None:
        self.node_id = node_id
        self.config = config
        self.membership = membership
        self.worker = worker
        self.client = client
        self.store = store
        self.order: RoutingOrder | None = None
        self.plan: ShardingPlan | None = None
        self.tokenizer: Tokenizer | None = None
        self.plan_version = 0
        self.state = "starting"
        self.message = "waiting for the membership to settle"
        self._deployed_members: frozenset[str] = frozenset()
        self._deploy_lock = asyncio.Lock()

    # --- status ---------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "message": self.message,
            "model": self.order.model if self.order else self.config.model,
            "plan_version": self.order.plan_version if self.order else None,
            "epoch": self.order.epoch if self.order else None,
            "route": self.order.route.to_list() if self.order else None,
        }

    # --- deployment ------------------------------------------------------------------------
    def self_url(self) -> str:
        return self.membership.self_url()

    def _sources(self, model: str) -> list[str]:
        """URLs of live nodes holding the whole model (this one first)."""
        sources = []
        if model in complete_models(self.store):
            sources.append(self.self_url())
        for node_id, extra in self.membership.peer_extras().items():
            url = self.membership.url_of(node_id)
            if url and model in extra.get("models", []):
                sources.append(url)
        return sources

    async def deploy(self, reason: str) -> None:
        async with self._deploy_lock:
            if not self.membership.is_orchestrator:
                return
            election = self.membership.election
            assert election is not None
            alive = self.membership.alive_nodes()
            model = self.config.model
            self.state, self.message = "loading", f"planning {model} over {len(alive)} node(s): {reason}"
            log.info("%s", self.message)
            try:
                sources = self._sources(model)
                manifest = await ensure_model_files(self.client, self.store, model, lambda m: [], sources)
                scores = self.membership.scores()
                plan = make_plan(
                    scores, manifest.n_layers,
                    replicate_head_ratio=self.config.replicate_head_ratio,
                    replica_count=self.config.replica_count,
                    min_layers_per_node=self.config.min_layers_per_node,
                )
                telemetry = {
                    node_id: Telemetry(latency_ms=self.membership.latency_ms(node_id), capacity_score=scores[node_id])
                    for node_id in scores
                }
                route = choose_route(plan, scores, telemetry)
                self.plan_version += 1
                addresses = {node_id: self.membership.address_of(node_id) for node_id in scores}
                order = RoutingOrder(
                    epoch=election.epoch, orchestrator=self.node_id, plan_version=self.plan_version,
                    model=model, total_layers=manifest.n_layers, route=route, addresses=addresses,
                    weight_sources=tuple(sources), plan=plan.to_dict(),
                )
                await asyncio.gather(*(self._send_order(node_id, order) for node_id in scores))
                self.tokenizer = await asyncio.to_thread(Tokenizer.from_model_dir, self.store.models_dir / model)
            except (NcmError, ShardsError, PeerError) as error:
                self.state, self.message = "failed", f"cannot serve {model}: {error}"
                log.error("%s", self.message)
                return
            self.order, self.plan = order, plan
            self._deployed_members = frozenset(scores)
            self.state, self.message = "ok", f"serving {model} on {len(route.hops)} stage(s)"
            log.info("plan %d deployed: %s", order.plan_version,
                     " -> ".join(f"{h.node_id[:8]}[{h.layers}]" for h in route.hops))

    async def _send_order(self, node_id: str, order: RoutingOrder) -> None:
        if node_id == self.node_id:
            await self.worker.apply(order)
            return
        await self.client.request_json("POST", self.membership.address_of(node_id), ROUTING_PATH, order.to_json(), timeout_s=DEPLOY_TIMEOUT_S)

    async def run(self) -> None:
        """React to membership changes while this node is the orchestrator (owned by the app)."""
        changes = self.membership.subscribe()
        while True:
            await changes.wait()
            changes.clear()
            if not self.membership.is_orchestrator:
                if self.order is not None:
                    log.info("no longer the orchestrator")
                self.order, self.state, self.message = None, "follower", "another node is the orchestrator"
                continue
            # Let a burst of joins settle before planning.
            await asyncio.sleep(SETTLE_S)
            members = frozenset(self.membership.alive_nodes())
            epoch_changed = self.order is not None and self.membership.election and self.order.epoch != self.membership.election.epoch
            if members != self._deployed_members or self.order is None or epoch_changed:
                await self.deploy("membership changed" if self.order else "first deployment")

    # --- requests ---------------------------------------------------------------------------
    def require_serving(self) -> tuple[RoutingOrder, Tokenizer]:
        if self.order is None or self.tokenizer is None or self.state not in ("ok", "degraded"):
            raise NotServingError(f"the cluster is not serving yet ({self.state}: {self.message})")
        return self.order, self.tokenizer

    async def _step(self, order: RoutingOrder, header: dict[str, Any], tensor: np.ndarray, timeout_s: float) -> int | None:
        head = order.route.hops[0].node_id
        try:
            async with asyncio.timeout(timeout_s):
                result, _ = await self.worker.forward_to(order, head, header, tensor, timeout_s=timeout_s)
        except StageError as error:
            if error.node is not None and error.node != self.node_id:
                self.membership.mark_unreachable(error.node)
            raise
        except TimeoutError:
            raise StageError("stage_timeout", f"the pipeline did not answer within {timeout_s:g} s", head) from None
        return result["token"]

    async def complete(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Completion]:
        """Generate from ``prompt_ids``: yields text pieces, the last event has the finish reason."""
        order, tokenizer = self.require_serving()
        if len(prompt_ids) + 1 > self.config.max_context:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; this cluster's context is {self.config.max_context}")
        sid = uuid.uuid4().hex
        stream = TextStream(tokenizer, params)
        sampling = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p, "seed": params.seed}
        base = {"kind": "step", "sid": sid, "layer": 0, "epoch": order.epoch, "plan": order.plan_version}
        chunk = self.config.prefill_chunk
        try:
            seq, token = 0, None
            for start in range(0, len(prompt_ids), chunk):
                ids = np.asarray([prompt_ids[start : start + chunk]], dtype=np.int64)
                last = start + chunk >= len(prompt_ids)
                header = dict(base, seq=seq, start=start, sample=last, params=sampling)
                token = await self._step(order, header, ids, PREFILL_STEP_TIMEOUT_S)
                seq += 1
            position = len(prompt_ids)
            while True:
                assert token is not None
                text = stream.push(token)
                if stream.done:
                    yield Completion(text, stream.finish_reason, len(prompt_ids), stream.completion_tokens)
                    return
                if position + 1 >= self.config.max_context:
                    yield Completion(text + stream.finish(FINISH_LENGTH), FINISH_LENGTH, len(prompt_ids), stream.completion_tokens)
                    return
                if text:
                    yield Completion(text)
                header = dict(base, seq=seq, start=position, sample=True)
                token = await self._step(order, header, np.asarray([[token]], dtype=np.int64), DECODE_STEP_TIMEOUT_S)
                seq += 1
                position += 1
        finally:
            await self._close(order, sid)

    async def _close(self, order: RoutingOrder, sid: str) -> None:
        head = order.route.hops[0].node_id
        if head == self.node_id:
            await self.worker.close_session(sid, 0)
        else:
            link = await self.worker.links.get(head, order.addresses[head])
            await link.send({"kind": "close", "sid": sid, "layer": 0})
