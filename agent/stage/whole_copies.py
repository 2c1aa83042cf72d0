"""Whole copies of the fallback model: the orchestrator asks nodes to hold every file of it, so
that losing any one node leaves a whole copy. The fetches are queued and run one at a time in
the background, and only when the disk has room (:data:`COPY_MARGIN_BYTES` left over)."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path

from agent.cluster.peer_client import PeerClient
from agent.core.errors import NcmError
from agent.stage.weights import complete_models, ensure_model_files, missing_files
from shards.errors import ShardsError
from shards.store.model_store import ModelStore

log = logging.getLogger(__name__)
COPY_MARGIN_BYTES = 1 << 30  # disk left free after fetching a whole copy of the fallback model


def _free_bytes(path: Path) -> int:
    """Free bytes on the disk ``path`` is (or will be) on."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


class WholeCopies:
    """The whole models this node was asked to hold, fetched by :meth:`fetch_copies`."""

    def __init__(self, store: ModelStore, client: PeerClient) -> None:
        self.store = store
        self.client = client
        self._queue: asyncio.Queue[tuple[str, list[tuple[str, str]]]] = asyncio.Queue()
        self.copying: str | None = None  # the whole model being fetched now
        self._declined: dict[str, int] = {}  # model -> free disk bytes when a copy was declined for room

    def keep_whole_copy(self, model: str, sources: list[tuple[str, str]]) -> bool:
        """Queue a fetch of every file of ``model`` (the fallback, so that losing any one node
        leaves a whole copy); False when this node holds it whole already or lacks the room."""
        if model in complete_models(self.store) or model == self.copying:
            return False
        if model in self._declined and self._declined[model] >= _free_bytes(self.store.root):
            return False  # no more room than when it was declined
        self._queue.put_nowait((model, sources))
        return True

    async def fetch_copies(self) -> None:
        """Fetch the whole models queued by :meth:`keep_whole_copy`, one at a time, when the disk
        has room for them (owned by the service's cleanup context)."""
        while True:
            model, sources = await self._queue.get()
            if model in complete_models(self.store):
                continue
            self.copying = model
            try:
                manifest = await ensure_model_files(self.client, self.store, model, lambda m: [], sources)
                missing = sum(manifest.files[k].bytes
                              for k in missing_files(self.store.models_dir / model, manifest, list(manifest.files)))
                free = _free_bytes(self.store.root)
                if free < missing + COPY_MARGIN_BYTES:
                    self._declined[model] = free
                    log.info("not keeping a whole copy of %s: %d MiB free, it needs %d MiB", model,
                             free >> 20, (missing + COPY_MARGIN_BYTES) >> 20)
                    continue
                await ensure_model_files(self.client, self.store, model, lambda m: list(m.files), sources)
                log.info("holding a whole copy of %s (the fallback model)", model)
            except (NcmError, ShardsError) as error:
                log.warning("could not keep a whole copy of %s: %s", model, error)
            finally:
                self.copying = None
