"""The embedding models this node serves: opened on first use, each whole, on this node.

An embedding model is small (all-MiniLM-L6-v2: 90 MB) and needs no pipeline: the
orchestrator, which every API request reaches, opens it from its own store and keeps it open.
Batches run off the event loop, one at a time per model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np

from agent.core.errors import InvalidRequestError, ModelLoadError
from agent.models.router import LATEST_TAG
from shards.errors import ShardsError
from shards.runtime.embedder import Embedder
from shards.store.model_store import ModelStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Embeddings:
    """What one request got: a vector per text, the tokens read and the time spent opening
    the model (0 when it was open) and embedding."""

    vectors: np.ndarray
    prompt_tokens: int
    load_s: float
    embed_s: float


class EmbeddingModels:
    """The embedding models of this node's store, opened when first asked for."""

    def __init__(self, store: ModelStore, threads: int) -> None:
        self.store = store
        self.threads = threads
        self._open: dict[str, Embedder] = {}
        self._locks: dict[str, asyncio.Lock] = {}

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

    async def embed(self, name: str, texts: list[str], *, truncate: bool = True) -> Embeddings:
        """Embed ``texts`` with stored model ``name``; ``truncate`` false refuses a text longer
        than the model reads (InvalidRequestError naming ``input``)."""
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
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

__all__ = ["Embeddings", "EmbeddingModels"]
