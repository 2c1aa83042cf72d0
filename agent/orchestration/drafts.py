"""The draft models this node runs for the requests it orchestrates: a model's ``model-draft``
preset names a smaller model with its vocabulary, whose greedy tokens each step verifies in
one trip through the pipeline (:class:`shards.runtime.speculation.DraftModel`).

A draft model is opened here, where requests are sampled, at the first request that drafts
with it: its files are fetched from a peer where this node lacks them, and it runs on this
node's compute threads. One that cannot be used (no node holds it, another vocabulary, a
runner that fails to open) is logged once and not tried again for :data:`RETRY_S`: requests
draft by prompt lookup meanwhile. What the open draft models hold is counted in the router's
ledger of this node's memory beside the fragments (:meth:`Drafts.held_bytes`), as its
embedding models are. A draft model is closed when no loaded model names it any more, and
with the agent.

A request drafts through a :class:`RequestDraft`, which writes the next draft while a step
is being verified: it guesses that the step keeps the whole draft and that the token after
it is the draft model's own, and drafts on from there on its thread. Where the guess was
right (a draft model that agrees with the served one) the next step leaves at once, so a
step costs the longer of the trip and the draft, not both.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence

from agent.core.errors import NcmError
from agent.orchestration.deployer import Deployer, Deployment
from agent.stage.fragment_cache import FragmentCache
from shards.errors import ShardsError
from shards.runtime.speculation import DraftModel

log = logging.getLogger(__name__)
RETRY_S = 60.0


class Drafts:
    """The draft models opened here, by name (:meth:`get`)."""

    def __init__(self, fragments: FragmentCache, deployer: Deployer) -> None:
        self._fragments = fragments
        self._deployer = deployer
        self._models: dict[str, DraftModel] = {}
        self._refused_at: dict[str, float] = {}  # draft model -> when it could not be used
        self._lock = asyncio.Lock()

    async def get(self, deployment: Deployment, now_s: float) -> DraftModel | None:
        """The draft model of ``deployment``'s model, opened here at the first call; None when
        the model has none, is served by its fallback, or its draft cannot be used (now)."""
        name = deployment.settings.draft_model
        if name is None or deployment.order.degraded:
            return None
        if name not in self._models and now_s - self._refused_at.get(name, -math.inf) < RETRY_S:
            return None
        async with self._lock:
            if name not in self._models:
                try:
                    self._models[name] = await self._open(name, deployment)
                except (NcmError, ShardsError, OSError) as error:
                    self._refused_at[name] = now_s
                    log.warning("model %s: its draft model %s cannot be used (%s); drafting by prompt lookup "
                                "for %g s", deployment.name, name, error, RETRY_S)
                    return None
                log.info("model %s drafts with %s", deployment.name, name)
        return self._models[name]

    async def _open(self, name: str, deployment: Deployment) -> DraftModel:
        settings = deployment.settings
        sources = self._deployer.sources(name, self._deployer.holdings())
        runner = await self._fragments.open_whole(name, settings.max_context, settings.prefill_chunk, sources)
        try:
            tokenizer = await self._deployer.tokenizer(name)
            if not tokenizer.same_vocabulary(deployment.tokenizer):
                raise ShardsError(f"its vocabulary is not {deployment.order.model}'s")
        except BaseException:
            runner.close()
            raise
        return DraftModel([runner], prefill_chunk=settings.prefill_chunk)

    def held_bytes(self) -> int:
        """What the open draft models hold (weights and KV caches), beside the fragments."""
        return sum(model.memory_bytes() for model in list(self._models.values()))

    def take_unused(self, in_use: set[str]) -> list[DraftModel]:
        """The draft models not named in ``in_use``, no longer held here: the caller closes them
        (a model was unloaded)."""
        return [self._models.pop(name) for name in [n for n in self._models if n not in in_use]]

    def close(self) -> None:
        """Close every draft model (the agent is stopping)."""
        for model in self.take_unused(set()):
            model.close()


class _DraftAhead:
    """A draft written ahead: the context it follows, its task, and when it stops (asked by the
    draft model after each token): at once when no step will read it, at its first token when
    that is not the one the step chose."""

    def __init__(self, follows: list[int]) -> None:
        self.follows = follows
        self.stopped = False
        self.chosen: int | None = None  # the token the step chose after the whole draft
        self.task: asyncio.Task[tuple[int, ...]]  # set once the draft starts

    def __call__(self, drafted: Sequence[int]) -> bool:
        return self.stopped or (self.chosen is not None and drafted[0] != self.chosen)


class RequestDraft:
    """One request's drafts with ``model`` (:meth:`draft`), the next written ahead while a
    step is verified (:meth:`draft_ahead`). Owns the request's draft session and the thread
    that drafts ahead: :meth:`close` when the request ends."""

    def __init__(self, model: DraftModel, session_id: str, p_min: float | None) -> None:
        self.model = model
        self.session_id = session_id
        self.p_min = p_min
        self.drafted_ahead = False  # the last draft was written while the step before was verified
        self._ahead: _DraftAhead | None = None

    @classmethod
    async def open(cls, model: DraftModel, context: Sequence[int], p_min: float | None) -> RequestDraft:
        return cls(model, await asyncio.to_thread(model.session, context), p_min)

    async def draft(self, context: Sequence[int], count: int) -> tuple[int, ...]:
        """Up to ``count`` tokens the draft model would choose after ``context``: the ones
        drafted ahead where the step kept what it guessed, else drafted now. Raises
        :class:`~shards.errors.ShardsError` when the draft model fails."""
        ahead = await self._settle(context)
        self.drafted_ahead = ahead is not None
        if ahead is not None:
            return ahead[:count]
        return await asyncio.to_thread(self.model.draft, self.session_id, context, count, self.p_min)

    def draft_ahead(self, context: Sequence[int], draft: Sequence[int], count: int) -> None:
        """A step is verifying ``draft`` after ``context``: draft, meanwhile, the ``count``
        tokens that would follow if it keeps the whole draft and then the draft model's own
        next token."""
        if self._ahead is not None:
            raise RuntimeError("a draft ahead is running already")
        ahead = _DraftAhead([*context, *draft])
        ahead.task = asyncio.create_task(asyncio.to_thread(self.model.draft, self.session_id, ahead.follows,
                                                           count + 1, self.p_min, ahead))
        self._ahead = ahead

    async def _settle(self, context: Sequence[int]) -> tuple[int, ...] | None:
        """The draft ahead's tokens after ``context`` (its first, the guessed one, is the last of
        ``context``), or None when there is none or it guessed otherwise (then stopped)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        follows = ahead.follows
        if len(context) == len(follows) + 1 and list(context[:len(follows)]) == follows:
            ahead.chosen = context[-1]
        else:
            ahead.stopped = True
        drafted = await ahead.task
        if ahead.stopped or not drafted or drafted[0] != ahead.chosen:
            return None
        return drafted[1:]

    async def stop_ahead(self) -> None:
        """Stop the draft ahead, if one is running: no step will read it."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.stopped = True
            try:
                await ahead.task
            except ShardsError:
                pass  # the draft model failed on a draft no one reads

    async def close(self) -> None:
        """The request ended: stop drafting ahead, keep the session for the next request."""
        await self.stop_ahead()
        await asyncio.to_thread(self.model.release, self.session_id)
