"""A request's token loop (design §6): prefill the prompt through the pipeline in chunks, then
one step per token, each through every stage of the route, sampled at the tail.

When a stage fails, the request asks for what to use now (the orchestrator's failover),
replays its tokens so far on that route and goes on: nothing is lost or repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.cluster.membership import Membership
from agent.cluster.peer_client import PeerClient
from agent.core.copies import pick_copy
from agent.core.errors import ClusterError, InvalidRequestError
from agent.core.orders import RoutingOrder
from agent.core.prompt_cache import KeptPrompt, PromptCache
from agent.core.protocol import CloseFrame, ResultFrame, StepFrame
from agent.dataplane.links import SILENCE_S, Links, Replies, StageError, StageLink
from agent.local.compat import timeout
from agent.orchestration.deployer import Deployment
from agent.orchestration.drafts import Drafts, RequestDraft
from agent.stage.worker import Worker
from shards.errors import ShardsError
from shards.runtime.generate import FINISH_LENGTH, TextStream
from shards.runtime.sampling import SamplingParams, TokenLogprobs
from shards.runtime.speculation import DraftLength, PromptLookup

log = logging.getLogger(__name__)
PREFILL_STEP_TIMEOUT_S = 300.0
DECODE_STEP_TIMEOUT_S = 60.0
MAX_RECOVERIES_PER_REQUEST = 4


@dataclass(frozen=True)
class Completion:
    """One event of a completion as the API streams it; ``model`` is the model that produced it."""

    text: str
    model: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tokens: tuple[int, ...] = ()  # the sampled ids behind this event's text (since the previous event)
    logprobs: tuple[TokenLogprobs, ...] = ()  # theirs, when the request asks
    cached_tokens: int = 0  # of the prompt's, read from a kept KV cache instead of computed (the last event)


class TokenLoop:
    """Runs requests through the pipeline from this node. ``recover(deployment, dead)`` fails
    over from a deployment whose ``dead`` nodes failed, and returns the one to go on with.

    Over 250 lines: prefill, decode, embedding, the prompt cache and the replay after a
    failover are one request's path, read in one place."""

    def __init__(self, node_id: str, membership: Membership, worker: Worker, client: PeerClient, results: Replies,
                 recover: Callable[[Deployment, set[str]], Awaitable[Deployment]], drafts: Drafts) -> None:
        self.node_id = node_id
        self.membership = membership
        self.worker = worker  # this node's own stage: runs a step whose head is here, frees its sessions
        self.links = Links(client)  # this node's own links to the stages of its requests' routes
        self.results = results  # the results tails send straight here (llama.cpp's response queue)
        self._recover = recover
        self.drafts = drafts  # the draft models of the models whose presets name one
        self._running = 0
        self._on_node: Counter[str] = Counter()  # requests running from here, per node they run on (design §11)
        self._caches: dict[str, PromptCache] = {}  # per model: the KV caches its stages keep
        self._none_running = asyncio.Event()
        self._none_running.set()

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        """One request running from this node while inside (what :meth:`drained` waits for)."""
        self._running += 1
        self._none_running.clear()
        try:
            yield
        finally:
            self._running -= 1
            if not self._running:
                self._none_running.set()

    def _place(self, deployment: Deployment, context: Sequence[int], cache: PromptCache | None) -> str:
        """The node a request on ``deployment`` runs on: its route's head, or of a model placed
        as whole copies the live copy :func:`agent.core.copies.pick_copy` picks; counted there
        until :meth:`_leave`."""
        head = deployment.order.route.hops[0].node_id
        node = head
        if deployment.order.copies:
            alive = self.membership.alive_nodes()
            serving = deployment.serving_nodes()
            # this node's own copy first: a request there crosses no network at its tokens
            nodes = [n for n in serving if n == self.node_id] + [n for n in serving if n != self.node_id and n in alive]
            nodes = nodes or [head]
            reuse = cache.reuse_by_node(context, deployment.order.plan_version) if cache is not None else {}
            node = pick_copy(nodes, self._on_node, reuse, deployment.copy_sessions)
        self._on_node[node] += 1  # until _leave
        return node

    def _leave(self, node: str) -> None:
        self._on_node[node] -= 1
        if not self._on_node[node]:
            del self._on_node[node]

    async def close(self) -> None:
        """Close this node's links to the stages and its draft models (the agent is stopping)."""
        await self.links.close()
        self.drafts.close()

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no request runs here (an agent that stops lets them finish); False when
        some still ran after ``timeout_s``."""
        try:
            async with timeout(timeout_s):
                await self._none_running.wait()
        except asyncio.TimeoutError:
            return False
        return True

    async def _step(self, order: RoutingOrder, step: StepFrame, tensor: np.ndarray, timeout_s: float) -> ResultFrame:
        """Hand ``step`` to the head and return the result the tail sends straight here: each
        hop is one network trip, and nothing comes back along the chain. A stage that fails,
        or whose next stage does not take the step, reports it here. One that vanishes or
        freezes says nothing: the step fails at once when this node's link to a stage of the
        route drops (a request links to every stage first), and every :data:`SILENCE_S`
        without the result the other stages are pinged, the first that does not answer blamed."""
        head = order.route.hops[0].node_id
        # the address the order gives this node (the one stage links use), else the current one
        url = order.addresses.get(self.node_id) or self.membership.peer_address_of(self.node_id)
        step = step.replying_to(self.node_id, url)
        loop = asyncio.get_running_loop()
        result = self.results.expect(step.sid, step.seq)
        lost = self.links.loss()
        sent_at = loop.time()
        deadline = sent_at + timeout_s
        try:
            if head == self.node_id:
                await self.worker.relay(step, tensor)
            else:
                await (await self.links.get(head, order.addresses[head])).post(step.header(), tensor)
            while not result.done():
                await asyncio.wait((result, lost), timeout=max(min(SILENCE_S, deadline - loop.time()), 0.0),
                                   return_when=asyncio.FIRST_COMPLETED)
                if result.done():
                    break
                if lost.done():
                    node_id = lost.result()
                    if node_id != self.node_id and node_id in order.route.nodes:
                        raise StageError("stage_unreachable", f"the link to node {node_id} dropped while a step "
                                         "was on its way", node_id)
                    lost = self.links.loss()
                elif loop.time() >= deadline:
                    raise StageError("stage_timeout", f"the pipeline did not answer within {timeout_s:g} s", head)
                else:
                    await self._probe(order)
            self.worker.metrics.child(self.worker.metrics.step_latency, order.name).observe(loop.time() - sent_at)
            return result.result()
        finally:
            self.results.forget(step.sid, step.seq)

    async def _links_to_stages(self, order: RoutingOrder) -> list[StageLink]:
        """This node's links to the other stages of ``order``'s route, in route order."""
        return [await self.links.get(node_id, order.addresses[node_id])
                for node_id in order.route.nodes if node_id != self.node_id]

    async def _probe(self, order: RoutingOrder) -> None:
        """Ping the other stages of ``order``'s route at once; the failure of the first (in
        route order) that does not answer."""
        links = await self._links_to_stages(order)
        outcomes = await asyncio.gather(*(link.ping(SILENCE_S) for link in links), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _prefill(self, deployment: Deployment, order: RoutingOrder, sid: str, ids: list[int],
                       sampling: dict[str, Any] | None, kept: KeptPrompt | None = None, reused: int = 0) -> ResultFrame:
        """Feed ``ids`` in chunks, from position 0 or, taking over the ``kept`` session's cache,
        from ``reused``; the last chunk samples the next token (with ``sampling``) or, without
        it, returns the final hidden state of the last position (an embedding)."""
        embed = sampling is None
        for link in await self._links_to_stages(order):  # linked to every stage: one that dies is noticed at once
            await link.connect()
        chunk = deployment.settings.prefill_chunk
        result: ResultFrame | None = None
        for seq, start in enumerate(range(reused if kept else 0, len(ids), chunk)):
            last = start + chunk >= len(ids)
            step = StepFrame(sid, seq, 0, start, order.epoch, order.plan_version, last and not embed,
                             sampling if last else None, reuse=kept.sid if kept is not None and seq == 0 else None,
                             embed=last and embed)
            result = await self._step(order, step, np.asarray([ids[start:start + chunk]], dtype=np.int64),
                                      PREFILL_STEP_TIMEOUT_S)
        assert result is not None
        if (result.embedding if embed else result.token) is None:
            raise StageError("bad_result", f"the tail answered step {result.seq} without its "
                             f"{'embedding' if embed else 'token'}", None)
        return result

    async def embed(self, deployment: Deployment, ids: list[int]) -> np.ndarray:
        """The final hidden state of the last of ``ids`` (the model's own, after its final
        norm), the prompt read through the pipeline in chunks, nothing sampled or kept. A
        stage that fails is failed over and the prompt read again on the new route; a model
        served by its fallback makes no embeddings (they would be another model's)."""
        if not ids or len(ids) > deployment.settings.max_context:
            raise ValueError(f"{len(ids)} tokens to embed; {deployment.name} reads 1 to {deployment.settings.max_context}")
        recoveries = 0
        with self._counted():
            while True:
                node = self._place(deployment, ids, None)
                order = deployment.order.on_copy(node)
                if order.degraded:
                    raise ClusterError(f"{deployment.name} is served by its fallback model {order.model} now: "
                                       "its embeddings would be another model's")
                sid = uuid.uuid4().hex
                try:
                    return (await self._prefill(deployment, order, sid, ids, None)).embedding
                except StageError as error:
                    if error.node is None or error.node == self.node_id or recoveries >= MAX_RECOVERIES_PER_REQUEST:
                        raise
                    recoveries += 1
                    log.warning("embedding %s: stage %s failed (%s); failing over", sid[:8], error.node, error.code)
                    deployment = await self._recover(deployment, {error.node})
                finally:
                    self._leave(node)
                    await self._close(order, sid)

    async def complete(self, deployment: Deployment, prompt_ids: list[int], params: SamplingParams,
                       generated: Sequence[int] = (), *, cache_prompt: bool = True,
                       draft_tokens: int | None = None,
                       draft_p_min: float | None = None) -> AsyncIterator[Completion]:
        """Generate from ``prompt_ids``: yields text pieces, the last event has the finish reason.

        ``generated``: the ids an earlier orchestrator sampled for this request before it was
        lost (their text was sent already): the request goes on after them. ``cache_prompt``:
        start from the KV cache of an earlier request that began the same way, where the
        stages keep one, and keep this one's for the next (:mod:`agent.core.prompt_cache`).
        ``draft_tokens``: most tokens a step drafts and verifies in one trip, with the model's
        draft model where its preset names one, else by prompt lookup
        (:mod:`shards.runtime.speculation`; None: the agent's ``draft_tokens``, 0: none); a draft
        model's token less likely than ``draft_p_min`` ends its draft (None: its default).
        """
        max_context = deployment.settings.max_context
        if len(prompt_ids) + len(generated) + 1 > max_context:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the context of {deployment.name} is {max_context}")
        sampling = params.wire()
        if params.penalised:  # the penalties' window reaches back into the prompt
            sampling["history"] = prompt_ids[-params.repeat_last_n:] if params.repeat_last_n > 0 else list(prompt_ids)
        stream = TextStream(deployment.tokenizer, params)
        for token in generated:  # their text went out already: only the stream's state matters
            stream.push(token)
            if stream.done:
                raise InvalidRequestError("the tokens to go on after end the generation already", "ncm_resume")
        context = [*prompt_ids, *generated]  # every token whose KV the stages must hold before the next step
        cache = self._cache(deployment) if cache_prompt else None
        node = self._place(deployment, context, cache)  # the route's head, or the whole copy it runs on
        try:
            kept, reused = None, 0
            if cache is not None:
                kept, reused, expired = cache.take(context, deployment.order.plan_version, time.monotonic(), node)
                for old in expired:
                    await self._close(deployment.order.on_copy(old.node), old.sid)
            finished = False  # the stages hold the KV of every token of context: it may be kept
            # Drafts (shards/runtime/speculation.py), unless the request reads log-probabilities
            most = self.worker.config.draft_tokens if draft_tokens is None else draft_tokens
            lookup = PromptLookup(context) if most and params.logprobs is None else None
            drafter = await self.drafts.get(deployment, time.monotonic()) if lookup is not None else None
            request_draft = await RequestDraft.open(drafter, context, draft_p_min) if drafter is not None else None
            draft_length = DraftLength(most)
            draft: tuple[int, ...] = ()  # what the step under way drafted
            unsent: list[int] = []  # sampled ids whose text has not gone out yet
            unsent_logprobs: list[TokenLogprobs] = []
            recoveries = 0
            sid = uuid.uuid4().hex
            with self._counted():
                try:
                    result: ResultFrame | None = None
                    while True:
                        order = deployment.order.on_copy(node)
                        served = order.model if order.degraded else order.name
                        try:
                            if result is None:  # the tail catches up with the tokens chosen so far (grammar, penalties)
                                result = await self._prefill(deployment, order, sid, context,
                                                             {**sampling, "generated": context[len(prompt_ids):]},
                                                             kept, reused)
                                draft = ()
                            if not result.tokens:
                                raise StageError("bad_result", f"the tail answered step {result.seq} without its token",
                                                 None)
                            if draft:
                                metrics = self.worker.metrics
                                metrics.child(metrics.draft_tokens, deployment.name, "drafted").inc(len(draft))
                                metrics.child(metrics.draft_tokens, deployment.name, "kept").inc(len(result.tokens) - 1)
                                draft_length.kept_of(len(draft), len(result.tokens) - 1)
                            for token in result.tokens:  # one, or a speculative step's drafted ones kept and the next
                                text = stream.push(token)
                                unsent.append(token)
                                if result.logprobs is not None:
                                    unsent_logprobs.append(TokenLogprobs(token, *result.logprobs))
                                if stream.done or len(context) + 1 >= max_context:
                                    finished = True
                                    if not stream.done:
                                        text += stream.finish(FINISH_LENGTH)
                                    yield Completion(text, served, stream.finish_reason, len(prompt_ids),
                                                     stream.completion_tokens, tuple(unsent), tuple(unsent_logprobs),
                                                     min(reused, len(prompt_ids)))
                                    return
                                if text:
                                    yield Completion(text, served, tokens=tuple(unsent),
                                                     logprobs=tuple(unsent_logprobs))
                                    unsent.clear()
                                    unsent_logprobs.clear()
                                context.append(token)
                            draft = ()
                            drafting = request_draft is not None and not deployment.order.degraded and most > 0
                            if lookup is not None:
                                lookup.extend(result.tokens)
                                # alone: with other requests, plain steps batch instead
                                count = min(draft_length.next(), max_context - len(context) - 1) \
                                    if self._running == 1 and most else 0
                                if drafting and count > 0:
                                    try:
                                        draft = await request_draft.draft(context, count)
                                        if request_draft.drafted_ahead:
                                            metrics = self.worker.metrics
                                            metrics.child(metrics.draft_tokens, deployment.name,
                                                          "ahead").inc(len(draft))
                                    except ShardsError as error:  # the request goes on with plain steps
                                        log.warning("request %s: its draft model failed (%s); no more drafts",
                                                    sid[:8], error)
                                        most, drafting = 0, False
                                else:
                                    if request_draft is not None:
                                        await request_draft.stop_ahead()  # not drafting this step
                                    draft = lookup.draft(count)
                            step = StepFrame(sid, len(context), 0, len(context) - 1, order.epoch, order.plan_version,
                                             True, draft=draft)
                            if drafting and draft:  # the next draft, written while this one is verified
                                ahead = min(draft_length.current + 1, most, max_context - len(context) - len(draft) - 2)
                                if ahead > 0:
                                    request_draft.draft_ahead(context, draft, ahead)
                            result = None
                            result = await self._step(order, step, np.asarray([[context[-1], *draft]], dtype=np.int64),
                                                      DECODE_STEP_TIMEOUT_S)
                        except StageError as error:
                            if error.code == "cache_miss" and kept is not None:  # not kept there any more: read it all
                                log.info("request %s: a stage no longer keeps the cached prompt; reading it all",
                                         sid[:8])
                                await self._close(order, kept.sid)  # what the other stages still keep of it
                                kept, reused, result = None, 0, None
                                continue
                            if error.node is None or error.node == self.node_id \
                                    or recoveries >= MAX_RECOVERIES_PER_REQUEST:
                                raise
                            recoveries += 1
                            log.warning("request %s: stage %s failed (%s); failing over", sid[:8], error.node,
                                        error.code)
                            previous = deployment
                            try:
                                deployment = await self._recover(deployment, {error.node})
                            finally:  # the stages still up free this try's session (the failed one counts as dead now)
                                await self._close(order, sid)
                                if kept is not None:  # and what they still keep of the cache it started from
                                    await self._close(order, kept.sid)
                            if deployment.order.model != previous.order.model \
                                    and deployment.tokenizer.vocab_size != previous.tokenizer.vocab_size:
                                raise ClusterError("the fallback model uses another tokenizer; the request cannot "
                                                   "continue on it") from None
                            sid = uuid.uuid4().hex
                            self._leave(node)
                            node = self._place(deployment, context, None)
                            kept, reused = None, 0  # the new route keeps nothing of this request
                            result = None  # replay everything so far on the new route
                finally:
                    if request_draft is not None:  # waits for a draft still running on its thread
                        await request_draft.close()
                    order = deployment.order.on_copy(node)
                    if finished and cache is not None and cache.entries and not recoveries \
                            and len(context) > cache.min_reused_tokens:
                        for old in cache.keep(KeptPrompt(sid, tuple(context), order.plan_version, time.monotonic(),
                                                         node)):
                            await self._close(deployment.order.on_copy(old.node), old.sid)
                        await self._close(order, sid, keep=True)
                    else:
                        await self._close(order, sid)
        finally:
            self._leave(node)

    def kept(self, model: str) -> tuple[KeptPrompt, ...]:
        """The KV caches the stages keep for ``model``'s next requests."""
        cache = self._caches.get(model)
        return cache.kept if cache is not None else ()

    def _cache(self, deployment: Deployment) -> PromptCache:
        """The prompt cache of ``deployment``'s model."""
        cache = self._caches.get(deployment.name)
        if cache is None:
            config = self.worker.config
            cache = self._caches[deployment.name] = PromptCache(config.prompt_cache_entries, config.prompt_cache_idle_s)
        return cache

    async def _close(self, order: RoutingOrder, sid: str, *, keep: bool = False) -> None:
        """Free ``sid`` on every stage of ``order``'s route (``keep``: keep its KV cache for the
        prompt cache): each is told directly, so that a dead or frozen stage does not keep the
        ones after it holding the session (its own go when it has been idle for a while)."""
        alive = self.membership.alive_nodes()
        for node_id in order.route.nodes:
            if node_id == self.node_id:
                self.worker.close_session(sid, keep=keep)
            elif node_id in alive:
                link = await self.links.get(node_id, order.addresses[node_id])
                layer = order.hops_of(node_id)[0].layers.first
                await link.send(CloseFrame(sid, layer, order.plan_version, keep).header())
