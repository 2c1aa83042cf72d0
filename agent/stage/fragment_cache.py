"""The fragment cache: the layer fragments this node holds open, one runner per
:class:`RunnerKey`, built on a thread of their own so that steps go on meanwhile. Opening one
checks its weight files: corrupt ones are deleted and fetched again from a peer, once. A
fragment that computes NaN or Inf is dropped with its build, so the next order that needs it
builds it again."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, NamedTuple

from agent.cluster.peer_client import PeerClient
from agent.core.orders import RoutingOrder
from agent.core.threads import ThreadPlan, thread_plan
from agent.local.config import AgentConfig
from agent.stage.weights import Source, WeightTransferError, ensure_model_files
from shards.errors import CorruptWeightsError
from shards.graph.fragment import prune_blobs
from shards.providers.backends import backend_chain, detect_platform
from shards.runtime.chain import open_range
from shards.runtime.load_cuts import MAX_LOAD_PARTS
from shards.runtime.runner import FragmentRunner
from shards.store.manifest import Manifest
from shards.store.model_store import ModelStore
from shards.store.verify import discard

log = logging.getLogger(__name__)
MAX_REPAIRS_KEPT = 8  # corrupt files found here, shown in the status
# A draft model's 4-bit products all take int8 activations, however small, whatever the agent's
# activation_bits (with 8, as every model's do): the model checks every draft, so only speed
# counts, and on an AVX2 CPU SmolLM2's q4 store drafts 1.55-1.8x as fast so (bench/cluster.py
# --delays 5 --speculative: 3.24-3.70x plain decoding, from 1.48-1.55x).
DRAFT_INT8_MIN_WEIGHTS = 0


class RunnerKey(NamedTuple):
    """What a fragment runner is built for: its model, its layers and its context limits."""

    model: str
    first_layer: int
    last_layer: int
    max_context: int
    prefill_chunk: int


def _files_of(keys: list[RunnerKey]) -> Callable[[Manifest], list[str]]:
    """The weight files the fragments of ``keys`` are built from (for ensure_model_files)."""
    return lambda m: sorted({f for k in keys for f in m.fragment_files(k.first_layer, k.last_layer)})


def _delete_build(fragment_dir: Path) -> None:
    shutil.rmtree(fragment_dir, ignore_errors=True)
    prune_blobs(fragment_dir.parent)  # its weights, unless another fragment shares them


class FragmentCache:
    """The runners this node holds open (:attr:`runners`) and the thread that builds them."""

    def __init__(self, config: AgentConfig, store: ModelStore, client: PeerClient,
                 agents_on_host: Callable[[], int] = lambda: 1) -> None:
        self.config = config
        self.store = store
        self.client = client  # fetches weight files again when some are found corrupt
        self.agents_on_host = agents_on_host  # this one and the live peers on the same machine
        self.thread_plan: ThreadPlan | None = None  # the one the last runner was opened with
        self.repairs: list[dict[str, Any]] = []  # the latest corrupt weight files found here
        self.runners: dict[RunnerKey, FragmentRunner] = {}
        self.builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ncm-build")

    async def fetch_weights(self, order: RoutingOrder, keys: list[RunnerKey]) -> None:
        """Fetch the weight files the fragments of ``keys`` are built from, from the order's sources."""
        await ensure_model_files(self.client, self.store, order.model, _files_of(keys), order.sources())

    async def open(self, order: RoutingOrder, key: RunnerKey) -> None:
        """Open the runner of ``key`` and hold it, unless one is held already; when another build
        (a stage, a standby build) opened it meanwhile, that one stays and this one is closed."""
        if key in self.runners:
            return
        runner = await self._open_verified(order, key)
        if key in self.runners:
            runner.close()
        else:
            self.runners[key] = runner

    async def open_whole(self, model: str, max_context: int, prefill_chunk: int,
                         sources: list[Source]) -> FragmentRunner:
        """A runner of the whole of ``model`` (a draft model), its files fetched from ``sources``
        where this node lacks some; not held in :attr:`runners`: the caller closes it. It runs
        while the stages wait for its draft, so on every core (or the configured threads)."""
        manifest = await ensure_model_files(self.client, self.store, model, lambda m: sorted(m.files), sources)
        key = RunnerKey(model, 0, manifest.n_layers - 1, min(max_context, manifest.context_length),
                        min(prefill_chunk, max_context))
        return await asyncio.get_running_loop().run_in_executor(self.builder, self._open_runner,
                                                                self.store.models_dir / model, key, True)

    def memory_bytes(self, keys: set[RunnerKey]) -> int:
        """What the runners of ``keys`` held here report they take."""
        return sum(self.runners[k].memory_bytes() for k in keys if k in self.runners)

    def describe(self, keys: set[RunnerKey]) -> list[dict[str, Any]]:
        """The runners of ``keys`` held here, in layer order, for the status."""
        return [{"layers": [k.first_layer, k.last_layer], **self.runners[k].describe(),
                 "memory_bytes": self.runners[k].memory_bytes()} for k in sorted(keys) if k in self.runners]

    def close_all_but(self, needed: set[RunnerKey]) -> None:
        """Close the runners of every key but those ``needed``."""
        for key in [k for k in self.runners if k not in needed]:
            self.runners.pop(key).close()

    def note_repair(self, repair: dict[str, Any]) -> None:
        """Keep ``repair`` (corrupt files found here, by a build or the scrub) among the latest shown."""
        self.repairs = [*self.repairs[-(MAX_REPAIRS_KEPT - 1):], repair]

    async def _open_verified(self, order: RoutingOrder, key: RunnerKey) -> FragmentRunner:
        """Open the runner of ``key``; weight files found corrupt while building its fragment
        are deleted and fetched again from the order's sources, once."""
        loop = asyncio.get_running_loop()
        model_dir = self.store.models_dir / order.model
        try:
            return await loop.run_in_executor(self.builder, self._open_runner, model_dir, key)
        except CorruptWeightsError as corrupt:
            await asyncio.to_thread(discard, model_dir, corrupt.paths)
            self.note_repair({"model": order.model, "files": list(corrupt.paths), "fetched_again": False,
                              "found_by": "build"})
            try:
                await self.fetch_weights(order, [key])
            except WeightTransferError as error:
                raise CorruptWeightsError(f"{corrupt}; no peer could provide intact copies: {error}",
                                          corrupt.paths) from error
            self.repairs[-1]["fetched_again"] = True
            log.warning("fetched %s of %s again from a peer", ", ".join(corrupt.paths), order.model)
            return await loop.run_in_executor(self.builder, self._open_runner, model_dir, key)

    def _open_runner(self, model_dir: Path, key: RunnerKey, every_core: bool = False) -> FragmentRunner:
        plan = thread_plan(configured_threads=self.config.threads, spin=self.config.spin,
                           agents_on_host=self.agents_on_host(), cores=os.cpu_count() or 1)
        if every_core:  # a draft model: one session on the configured threads, else every core, all int8
            return open_range(model_dir, key.first_layer, key.last_layer, 1,
                              providers=list(self.config.providers) or None,
                              threads=self.config.threads or os.cpu_count() or 1, spinning=plan.spinning,
                              spin_after_run=plan.spin_after_run, max_context=key.max_context,
                              prefill_chunk=key.prefill_chunk, activation_bits=self.config.activation_bits,
                              int8_min_weights=DRAFT_INT8_MIN_WEIGHTS)
        if plan != self.thread_plan:
            log.info("fragments run on %s thread(s), %s, %s (%s)", plan.threads or "all",
                     "not spinning" if not plan.spinning else
                     "spinning between runs" if plan.spin_after_run else "spinning within a run only",
                     "a range opened in parts side by side" if plan.load_side_by_side else "a range as one session",
                     plan.reason)
            self.thread_plan = plan
        return open_range(
            model_dir, key.first_layer, key.last_layer, self._load_parts(plan),
            providers=list(self.config.providers) or None,
            threads=plan.threads,
            spinning=plan.spinning,
            spin_after_run=plan.spin_after_run,
            max_context=key.max_context,
            prefill_chunk=key.prefill_chunk,
            activation_bits=self.config.activation_bits,
        )

    def _load_parts(self, plan: ThreadPlan) -> int:
        """How many runners a range opens as, side by side: on the CPU provider of an agent
        alone on its host, one per core it computes on (onnxruntime repacks a session's weights
        on one core), at most MAX_LOAD_PARTS; an accelerator's range, and one on a host that
        agents share (:mod:`agent.core.threads`), stays one session."""
        best = backend_chain(detect_platform(), self.config.providers)[0]
        if not best or best[0].kind != "cpu" or not plan.load_side_by_side:
            return 1
        return max(1, min(plan.threads or os.cpu_count() or 1, MAX_LOAD_PARTS))

    async def drop_faulty(self, key: RunnerKey) -> None:
        """A fragment that computes NaN or Inf is closed and its build deleted: the next order
        that needs it builds it again, from weight files checked against the manifest."""
        runner = self.runners.pop(key, None)
        if runner is None:
            return
        log.error("fragment %d-%d of %s computed NaN or Inf: dropped, with its build",
                  key.first_layer, key.last_layer, key.model)
        builds = runner.builds()
        runner.close()
        for build in builds:
            await asyncio.to_thread(_delete_build, build.parent)

    def free_session(self, sid: str) -> None:
        """Free the KV cache of session ``sid`` on every runner that holds one."""
        for runner in self.runners.values():
            if sid in runner.sessions():
                runner.close_session(sid)

    def close(self) -> None:
        """Close every runner and stop the builds not started yet."""
        for runner in self.runners.values():
            runner.close()
        self.runners.clear()
        self.builder.shutdown(wait=False, cancel_futures=True)
