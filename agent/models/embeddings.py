"""The embedding models this node serves: opened on first use, each whole, on this node.

An embedding model is small (all-MiniLM-L6-v2: 90 MB) and needs no pipeline: the node the
router places it on (:mod:`agent.core.embedding_placement`; the orchestrator when it has room)
opens it from its own store, fetched from the orchestrator's when it was not there. It stays open
while it is used, and closes once idle as long as the chat models' idle rule says
(``sleep_idle_s``, 0: never) or as a request's Ollama ``keep_alive`` asks; what the open ones
hold is counted in the router's ledger of this node's memory (:meth:`EmbeddingModels.held_bytes`).
Batches run off the event loop, one at a time per model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from agent.core.errors import InvalidRequestError, ModelLoadError
from agent.core.node_report import NodeReport, OpenEmbeddingModel
from agent.core.protocol import Embeddings
from agent.models.router import LATEST_TAG
from shards.errors import ShardsError
from shards.runtime.embedder import Embedder
from shards.store.model_store import ModelStore

log = logging.getLogger(__name__)


class EmbeddingModels:
    """The embedding models of this node's store, opened when first asked for.
    ``idle_s``: how long an open model stays open unused (0: until the agent stops)."""

    def __init__(self, store: ModelStore, threads: int, idle_s: float = 0.0) -> None:
        self.store = store
        self.threads = threads
        self.idle_s = idle_s
        self._open: dict[str, Embedder] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._last_used_s: dict[str, float] = {}  # monotonic, the end of the last request
        self._keep_alive_s: dict[str, float] = {}  # a request's keep_alive, over idle_s (0: never close)

    def names(self) -> list[str]:
        return self.store.encoders()

    def resolve(self, name: str) -> str | None:
        """The stored embedding model ``name`` names (``name:latest`` too), else None."""
        for candidate in (name, name[:-len(LATEST_TAG)] if name.endswith(LATEST_TAG) else None):
            if candidate and self.store.has_encoder(candidate):
                return candidate
        return None

    def memory_bytes(self) -> dict[str, int]:
        """What each open model holds (its weights, float32)."""
        return {name: embedder.manifest.weight_bytes for name, embedder in self._open.items()}

    def held_bytes(self) -> int:
        """What the open models hold together, beside the fragments."""
        return sum(self.memory_bytes().values())

    def closes_after_s(self, name: str) -> float:
        """How long open model ``name`` stays open idle (0: until asked or the agent stops)."""
        return self._keep_alive_s.get(name, self.idle_s)

    def last_used_s(self, name: str) -> float:
        return self._last_used_s.get(name, time.monotonic())

    def open_models(self, now_s: float) -> dict[str, OpenEmbeddingModel]:
        """Per open model, the memory it holds and in how many seconds it closes if left idle
        (None: not until asked), at monotonic time ``now_s``: what /api/ps lists of it."""
        models = {}
        for name, held in sorted(self.memory_bytes().items()):
            idle_s = self.closes_after_s(name)
            models[name] = OpenEmbeddingModel(held, idle_s - (now_s - self.last_used_s(name)) if idle_s > 0 else None)
        return models

    def keep_alive(self, name: str, seconds: float, *, close: bool) -> None:
        """After this request, keep ``name`` open while idle for ``seconds`` (Ollama's
        keep_alive; negative: until asked). 0 closes it now when the request may ``close``
        it (the admin token, as for a chat model's unload); from another, 0 only drops the
        model's own keep_alive, and the idle rule applies again."""
        if seconds == 0:
            self._keep_alive_s.pop(name, None)
            if close and not self._locks.get(name, asyncio.Lock()).locked():
                self._close(name, "keep_alive 0")
            return
        self._keep_alive_s[name] = seconds if seconds > 0 else 0.0

    def close_idle(self, now_s: float) -> list[str]:
        """Close the open models idle past their time; returns their names."""
        idle = [name for name in self._open if self.closes_after_s(name) > 0 and not self._locks[name].locked()
                and now_s - self._last_used_s.get(name, now_s) >= self.closes_after_s(name)]
        for name in idle:
            self._close(name, f"idle for {self.closes_after_s(name):g} s")
        return idle

    def _close(self, name: str, why: str) -> None:
        if self._open.pop(name, None) is not None:
            log.info("closed embedding model %s (%s)", name, why)
        self._keep_alive_s.pop(name, None)

    def close_all(self) -> None:
        for name in list(self._open):
            self._close(name, "the agent stops")

    async def close_when_idle(self, interval_s: float = 1.0) -> None:
        """Close idle models until cancelled (a background task of the agent)."""
        while True:
            await asyncio.sleep(interval_s)
            self.close_idle(time.monotonic())

    async def embed(self, name: str, texts: list[str], *, truncate: bool = True) -> Embeddings:
        """Embed ``texts`` with stored model ``name``; ``truncate`` false refuses a text longer
        than the model reads (InvalidRequestError naming ``input``)."""
        lock = self._locks.setdefault(name, asyncio.Lock())
        try:
            async with lock:
                return await self._embed(name, texts, truncate=truncate)
        finally:
            self._last_used_s[name] = time.monotonic()

    async def _embed(self, name: str, texts: list[str], *, truncate: bool) -> Embeddings:
        started = time.perf_counter()
        embedder = self._open.get(name)
        if embedder is None:
            try:
                embedder = await asyncio.to_thread(Embedder.open, name, self.store, threads=self.threads)
            except ShardsError as error:
                raise ModelLoadError(f"embedding model {name!r} cannot be opened: {error}", None) from None
            self._open[name] = embedder
            log.info("opened embedding model %s (%d dimensions)", name, embedder.dimensions)
        opened = time.perf_counter()
        encodings = await asyncio.to_thread(embedder.tokenize, texts)
        cut = next((index for index, e in enumerate(encodings) if e.overflowing), None)
        if not truncate and cut is not None:
            raise InvalidRequestError(f"input[{cut}] is longer than the {embedder.manifest.max_tokens} tokens "
                                      f"{name} reads (truncate: true cuts it)", "input")
        vectors = await asyncio.to_thread(embedder.run, encodings)
        return Embeddings(vectors, sum(len(e.ids) for e in encodings), opened - started,
                          time.perf_counter() - opened)


def open_everywhere(local: EmbeddingModels, node_id: str, peer_reports: Mapping[str, NodeReport],
                    now_s: float) -> dict[str, dict[str, Any]]:
    """The embedding models open in the cluster: this node's (``local``, as of monotonic
    ``now_s``) and the peers', as they last described them. Per model: its ``node``, the
    ``bytes`` it holds and ``expires_in_s``."""
    found = {name: {**model.to_json(), "node": node_id} for name, model in local.open_models(now_s).items()}
    for node, report in sorted(peer_reports.items()):
        for name, model in report.embedding_models.items():
            found.setdefault(name, {**model.to_json(), "node": node})
    return found


__all__ = ["EmbeddingModels", "open_everywhere"]
