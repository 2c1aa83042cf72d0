"""The background scrub: every stored weight file and fragment blob is hashed again on a
schedule, since bytes can rot in place with their size and modification time unchanged (what a
failing SD card does) and the verification cache (:mod:`shards.store.verify`) never looks at
such a file again.

A scrub reads at most ``scrub_rate_mib_s`` on a thread of the lowest priority, once every
``scrub_interval_s`` (when it is due is kept in the state directory across restarts), and soon
after a start that follows an unclean stop (a crash, a power cut: when corruption is likeliest).
A weight file that does not match the manifest is deleted, fetched again from a peer and
reported (``worker.repairs`` in ``/cluster/nodes``, a ``corrupt`` event, ``ncm_cluster_events``):
fragments are built only from checked files, so the node serves those layers from an intact
copy once it builds them again. A fragment blob (named after its sha256) that does not match
is deleted with the fragments that use it, which are built again when next needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.cluster.peer_client import PeerClient
from agent.local.events import EventLog
from agent.local.files import write_atomic
from agent.stage.weights import Source, WeightTransferError, ensure_model_files
from shards.graph.fragment import BLOB_POOL, FRAGMENTS_DIR
from shards.store.model_store import ModelStore
from shards.store.verify import discard, hash_file

log = logging.getLogger(__name__)
SCRUB_FILE = "scrub.json"  # in state_dir: when the last scrub ended
RUNNING_FILE = "running"  # in state_dir: present while the agent runs; found at start = an unclean stop
AFTER_UNCLEAN_STOP_S = 60.0  # a scrub starts this long after such a start (the node settles first)


def next_scrub_s(*, now_s: float, last_s: float | None, interval_s: float, unclean_stop: bool) -> float:
    """Seconds from ``now_s`` until the next scrub (wall clock; pure)."""
    if unclean_stop:
        return min(AFTER_UNCLEAN_STOP_S, interval_s)
    if last_s is None:
        return interval_s
    return max(0.0, last_s + interval_s - now_s)


class Scrubber:
    """Runs the scrubs of one node (owned by the node's application)."""

    def __init__(self, store: ModelStore, state_dir: Path, client: PeerClient, events: EventLog, *,
                 sources_of: Callable[[str], list[Source]], record_repair: Callable[[dict[str, Any]], None],
                 interval_s: float, rate_bytes_s: float) -> None:
        self.store, self.state_dir, self.client, self.events = store, state_dir, client, events
        self.sources_of, self.record_repair = sources_of, record_repair
        self.interval_s, self.rate_bytes_s = interval_s, rate_bytes_s
        self.unclean_stop = (state_dir / RUNNING_FILE).exists()
        self.scrubs = 0
        self._stop = threading.Event()

    def started(self) -> None:
        """Mark the agent as running (the mark is left behind by an unclean stop)."""
        write_atomic(self.state_dir / RUNNING_FILE, f"{os.getpid()}\n", mode=0o644)

    def stopped_cleanly(self) -> None:
        self._stop.set()
        (self.state_dir / RUNNING_FILE).unlink(missing_ok=True)

    async def run(self) -> None:
        if self.interval_s <= 0:
            return
        if self.unclean_stop:
            log.warning("the agent did not stop cleanly last time: its stored files are scrubbed in %g s",
                        min(AFTER_UNCLEAN_STOP_S, self.interval_s))
        unclean = self.unclean_stop
        while True:
            wait_s = next_scrub_s(now_s=time.time(), last_s=self._last_scrub_s(), interval_s=self.interval_s,
                                  unclean_stop=unclean)
            await asyncio.sleep(wait_s)
            unclean = False
            await self.scrub()

    async def scrub(self) -> dict[str, list[str]]:
        """One whole scrub; returns the corrupt weight files found, per model, after fetching
        them again where a peer could give them."""
        started = time.monotonic()
        corrupt = await asyncio.to_thread(self._hash_everything)
        for model, paths in corrupt.items():
            await self._repair(model, paths)
        self.scrubs += 1
        write_atomic(self.state_dir / SCRUB_FILE, json.dumps({"ended_at": time.time()}), mode=0o644)
        log.info("scrub %d done in %.0f s: %s", self.scrubs, time.monotonic() - started,
                 ", ".join(f"{m}: {len(p)} corrupt" for m, p in corrupt.items()) or "every file intact")
        return corrupt

    def _last_scrub_s(self) -> float | None:
        try:
            return float(json.loads((self.state_dir / SCRUB_FILE).read_text())["ended_at"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    # --- on the scrub's thread --------------------------------------------------------------------
    def _hash_everything(self) -> dict[str, list[str]]:
        with contextlib.suppress(OSError, AttributeError):  # best effort: not every system allows it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        corrupt: dict[str, list[str]] = {}
        for manifest in self.store.list():
            model_dir = self.store.models_dir / manifest.name
            for entry in manifest.files.values():
                path = model_dir / entry.path
                if self._stop.is_set() or not path.is_file():
                    continue  # a missing file is fetched when a fragment needs it
                if path.stat().st_size != entry.bytes or self._hash(path) != entry.sha256:
                    corrupt.setdefault(manifest.name, []).append(entry.path)
            self._scrub_blobs(model_dir / FRAGMENTS_DIR)
        return corrupt

    def _hash(self, path: Path) -> str:
        """``path``'s sha256, read at most at the scrub's rate."""
        began, read = time.monotonic(), 0

        def paced(block: bytes) -> None:
            nonlocal read
            read += len(block)
            ahead_s = read / self.rate_bytes_s - (time.monotonic() - began)
            if ahead_s > 0:
                self._stop.wait(ahead_s)

        return hash_file(path, after_block=paced).hexdigest()

    def _scrub_blobs(self, cache_dir: Path) -> None:
        pool = cache_dir / BLOB_POOL
        for blob in sorted(pool.iterdir()) if pool.is_dir() else ():
            if self._stop.is_set() or len(blob.name) != 64:
                continue
            if self._hash(blob) == blob.name:
                continue
            users = [d for d in cache_dir.iterdir() if d.is_dir() and (d / f"{blob.name}.bin").exists()]
            for fragment in users:
                shutil.rmtree(fragment, ignore_errors=True)
            blob.unlink(missing_ok=True)
            log.warning("fragment blob %s of %s is corrupt: deleted with %d fragment(s), built again when needed",
                        blob.name[:12], cache_dir.parent.name, len(users))
            self.events.record("corrupt", f"a fragment blob of {cache_dir.parent.name} was corrupt: its "
                                          f"{len(users)} fragment(s) are built again", model=cache_dir.parent.name)

    # --- back on the event loop ---------------------------------------------------------------------
    async def _repair(self, model: str, paths: list[str]) -> None:
        model_dir = self.store.models_dir / model
        await asyncio.to_thread(discard, model_dir, paths)
        repair: dict[str, Any] = {"model": model, "files": paths, "fetched_again": False, "found_by": "scrub"}
        manifest = self.store.manifest(model)
        keys = [key for key, entry in manifest.files.items() if entry.path in paths]
        try:
            await ensure_model_files(self.client, self.store, model, lambda _: keys, self.sources_of(model))
            repair["fetched_again"] = True
        except WeightTransferError as error:
            log.warning("no peer could give intact copies of %s of %s: %s", ", ".join(paths), model, error)
        self.record_repair(repair)
        self.events.record("corrupt", f"scrub: {len(paths)} weight file(s) of {model} were corrupt"
                                      + ("; fetched again from a peer" if repair["fetched_again"] else
                                         "; no peer had intact copies"), model=model)
