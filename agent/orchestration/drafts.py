"""The draft models this node runs for the requests it orchestrates: a model's ``model-draft``
preset names a smaller model with its vocabulary, whose greedy tokens each step verifies in
one trip through the pipeline (:class:`shards.runtime.speculation.DraftModel`).

A draft model is opened here, where requests are sampled, at the first request that drafts
with it: its files are fetched from a peer where this node lacks them, and it runs on this
node's compute threads. One that cannot be used (no node holds it, another vocabulary, a
runner that fails to open) is logged once and not tried again for :data:`RETRY_S`: requests
draft by prompt lookup meanwhile. A draft model is closed when no loaded model names it any
more, and with the agent.
"""

from __future__ import annotations

import asyncio
import logging
import math

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

    def take_unused(self, in_use: set[str]) -> list[DraftModel]:
        """The draft models not named in ``in_use``, no longer held here: the caller closes them
        (a model was unloaded)."""
        return [self._models.pop(name) for name in [n for n in self._models if n not in in_use]]

    def close(self) -> None:
        """Close every draft model (the agent is stopping)."""
        for model in self.take_unused(set()):
            model.close()
