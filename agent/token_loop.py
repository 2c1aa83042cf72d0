"""A request's token loop (design §6): prefill the prompt through the pipeline in chunks, then
one step per token, each through every stage of the route, sampled at the tail.

When a stage fails, the request asks for what to use now (the orchestrator's failover),
replays its tokens so far on that route and goes on: nothing is lost or repeated.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.compat import timeout
from agent.core.chat_request import InvalidRequestError
from agent.core.errors import ClusterError
from agent.core.orders import RoutingOrder
from agent.dataplane import StageError
from agent.deployer import Deployment
from agent.membership import Membership
from agent.protocol import CloseFrame, StepFrame
from agent.worker import Worker
from shards.generate import FINISH_LENGTH, TextStream
from shards.sampling import SamplingParams

log = logging.getLogger(__name__)
PREFILL_STEP_TIMEOUT_S = 300.0
DECODE_STEP_TIMEOUT_S = 60.0
MAX_RECOVERIES_PER_REQUEST = 4
TRAILING_WAIT_S = 2.0  # how long a finished request waits for answers still coming back along the chain


@dataclass(frozen=True)
class Completion:
    """One event of a completion as the API streams it; ``model`` is the model that produced it."""

    text: str
    model: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tokens: tuple[int, ...] = ()  # the sampled ids behind this event's text (since the previous event)


class TokenLoop:
    """Runs requests through the pipeline from this node. ``recover(deployment, dead)`` fails
    over from a deployment whose ``dead`` nodes failed, and returns the one to go on with."""

    def __init__(self, node_id: str, membership: Membership, worker: Worker,
                 recover: Callable[[Deployment, set[str]], Awaitable[Deployment]]) -> None:
        self.node_id = node_id
        self.membership = membership
        self.worker = worker
        self._recover = recover
        self._running = 0
        self._none_running = asyncio.Event()
        self._none_running.set()

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no request runs here (an agent that stops lets them finish); False when
        some still ran after ``timeout_s``."""
        try:
            async with timeout(timeout_s):
                await self._none_running.wait()
        except asyncio.TimeoutError:
            return False
        return True

    async def _step(self, order: RoutingOrder, step: StepFrame, tensor: np.ndarray, timeout_s: float,
                    trailing: set[asyncio.Task[Any]]) -> int | None:
        """Send ``step`` to the head and return the tail's token. The tail sends its result
        straight here as well as back along the chain: the first copy settles the step (one
        network trip per hop), and the answer still on its way back joins ``trailing`` (the
        request awaits those when it ends). Failures come back along the chain, each stage
        watching the next, as before."""
        head = order.route.hops[0].node_id
        # the address the order gives this node (the one stage links use), else the current one
        url = order.addresses.get(self.node_id) or self.membership.peer_address_of(self.node_id)
        step = step.replying_to(self.node_id, url)
        direct = self.worker.replies.expect(step.sid, step.seq)
        chain = asyncio.ensure_future(self.worker.forward_to(order, head, step, tensor, timeout_s=timeout_s))
        for task in [t for t in trailing if t.done()]:
            trailing.discard(task)
            if not task.cancelled():
                task.exception()  # retrieved: an answer that failed after its token came
        try:
            async with timeout(timeout_s):
                await asyncio.wait((direct, chain), return_when=asyncio.FIRST_COMPLETED)
        except BaseException as error:
            chain.cancel()
            trailing.add(chain)
            if isinstance(error, asyncio.TimeoutError):
                raise StageError("stage_timeout", f"the pipeline did not answer within {timeout_s:g} s", head) from None
            raise
        finally:
            self.worker.replies.forget(step.sid, step.seq)
        if direct.done() and not direct.cancelled():
            trailing.add(chain)
            return direct.result().token
        return chain.result().token

    @staticmethod
    async def _settle(trailing: set[asyncio.Task[Any]]) -> None:
        """Let the answers still coming back along the chain arrive (briefly), then stop them."""
        if not trailing:
            return
        _, late = await asyncio.wait(trailing, timeout=TRAILING_WAIT_S)
        for task in late:
            task.cancel()
        await asyncio.gather(*trailing, return_exceptions=True)
        trailing.clear()

    async def _prefill(self, deployment: Deployment, order: RoutingOrder, sid: str, ids: list[int],
                       sampling: dict[str, Any], trailing: set[asyncio.Task[Any]]) -> int:
        """Feed ``ids`` from position 0 in chunks; the last chunk samples the next token."""
        chunk = deployment.settings.prefill_chunk
        token: int | None = None
        for seq, start in enumerate(range(0, len(ids), chunk)):
            step = StepFrame(sid, seq, 0, start, order.epoch, order.plan_version, start + chunk >= len(ids), sampling)
            token = await self._step(order, step, np.asarray([ids[start:start + chunk]], dtype=np.int64),
                                     PREFILL_STEP_TIMEOUT_S, trailing)
        assert token is not None
        return token

    async def complete(self, deployment: Deployment, prompt_ids: list[int], params: SamplingParams,
                       generated: Sequence[int] = ()) -> AsyncIterator[Completion]:
        """Generate from ``prompt_ids``: yields text pieces, the last event has the finish reason.

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
        trailing: set[asyncio.Task[Any]] = set()  # answers coming back after their token came straight here
        sid = uuid.uuid4().hex
        self._running += 1
        self._none_running.clear()
        try:
            token = None
            while True:
                order = deployment.order
                served = order.model if order.degraded else order.name
                try:
                    if token is None:
                        token = await self._prefill(deployment, order, sid, context, sampling, trailing)
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
                    step = StepFrame(sid, len(context), 0, len(context) - 1, order.epoch, order.plan_version, True)
                    token = None
                    token = await self._step(order, step, np.asarray([[context[-1]]], dtype=np.int64),
                                             DECODE_STEP_TIMEOUT_S, trailing)
                except StageError as error:
                    if error.node is None or error.node == self.node_id or recoveries >= MAX_RECOVERIES_PER_REQUEST:
                        raise
                    recoveries += 1
                    log.warning("request %s: stage %s failed (%s); failing over", sid[:8], error.node, error.code)
                    self.membership.mark_unreachable(error.node)
                    await self._close(order, sid)
                    previous = deployment
                    deployment = await self._recover(deployment, {error.node})
                    if deployment.order.model != previous.order.model and deployment.tokenizer.vocab_size != previous.tokenizer.vocab_size:
                        raise ClusterError("the fallback model uses another tokenizer; the request cannot continue on it") from None
                    sid = uuid.uuid4().hex
                    token = None  # replay everything so far on the new route
        finally:
            try:
                await self._settle(trailing)
            finally:
                self._running -= 1
                if not self._running:
                    self._none_running.set()
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
                await link.send(CloseFrame(sid, layer, order.plan_version).header())
