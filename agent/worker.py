"""The worker: the layer fragments this node serves, and the step handler of the data plane
(run my layers, forward to the next stage, sample at the tail).

A worker keeps, for every model the router has loaded, the routing order it serves, plus every
older one that a request in flight still uses, so requests finish on the plan they started on;
fragments no kept order needs are freed. Unloading a model drops its order.

A new order takes two steps, so that a plan changes on every node or on none: the worker
*stages* it (fetches its weights, builds its fragments; the order it serves is untouched) and
switches to it when the orchestrator *commits* it, or drops it when the orchestrator *aborts*
it because another node could not stage it. A staged order already answers steps, and the
order a commit replaces stays usable for :data:`RETIRE_GRACE_S`, so a request routed on either
never meets a node that has let go of its plan.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import psutil

from agent.config import AgentConfig
from agent.core.errors import NcmError
from agent.core.orders import RoutingOrder
from agent.core.threads import ThreadPlan, thread_plan
from agent.dataplane import Links, StageError, error_from_header
from agent.metrics import Metrics
from agent.peer_client import PeerClient
from agent.probe import device_memory
from agent.weights import StoreWriteError, WeightTransferError, complete_models, ensure_model_files, missing_files
from shards.errors import CorruptWeightsError, ShardsError
from shards.fragment import prune_blobs
from shards.manifest import Manifest
from shards.runner import FragmentRunner, OrtFragmentRunner
from shards.sampling import Sampler, SamplingParams
from shards.store import ModelStore
from shards.verify import discard

log = logging.getLogger(__name__)
MAX_REPAIRS_KEPT = 8  # corrupt files found here, shown in the status
RETIRE_GRACE_S = 30.0  # a replaced order keeps answering this long, for steps already under way
COPY_MARGIN_BYTES = 1 << 30  # disk left free after fetching a whole copy of the fallback model
MIN_FRAME_LIMIT_BYTES = 64 << 20  # data-plane frames this size are always taken
FRAME_HEADER_BYTES = 64 << 10  # room for a frame's header on top of its tensor
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed")
RunnerKey = tuple[str, int, int, int, int]  # model, first layer, last layer, max context, prefill chunk


def _ranges(keys: set[RunnerKey]) -> str:
    return ", ".join(f"{k[1]}-{k[2]}" for k in sorted(keys))


def _rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def _free_bytes(path: Path) -> int:
    """Free bytes on the disk ``path`` is (or will be) on."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _delete_build(fragment_dir: Path) -> None:
    shutil.rmtree(fragment_dir, ignore_errors=True)
    prune_blobs(fragment_dir.parent)  # its weights, unless another fragment shares them


def _files_of(keys: list[RunnerKey]) -> Callable[[Manifest], list[str]]:
    """The weight files the fragments of ``keys`` are built from (for ensure_model_files)."""
    return lambda m: sorted({f for k in keys for f in m.fragment_files(k[1], k[2])})


class StaleOrderError(StageError):
    def __init__(self, message: str) -> None:
        super().__init__("stale_order", message, None)


_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NOT_WRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM}


def failure_cause(error: BaseException) -> str:
    """Why staging an order failed, as a short code the orchestrator and the operator see:
    ``disk_full``, ``store_not_writable``, ``out_of_memory``, ``corrupt_weights``,
    ``fetch_failed`` or ``stage_failed``."""
    seen: BaseException | None = error
    while seen is not None:
        code = seen.errno_code if isinstance(seen, StoreWriteError) else getattr(seen, "errno", None)
        if code in _FULL:
            return "disk_full"
        if code in _NOT_WRITABLE:
            return "store_not_writable"
        if isinstance(seen, MemoryError) or "Failed to allocate" in str(seen) or "bad_alloc" in str(seen):
            return "out_of_memory"
        if isinstance(seen, CorruptWeightsError):
            return "corrupt_weights"
        if isinstance(seen, WeightTransferError):
            return "fetch_failed"
        seen = seen.__cause__ or seen.__context__
    return "stage_failed"


@dataclass
class _SessionInfo:
    plan_version: int
    last_used: float
    sampler: Sampler | None = None


class Worker:
    """Runs the fragments of this node. Compute runs on one thread and fragment builds on another,
    both off the event loop."""

    def __init__(self, node_id: str, config: AgentConfig, store: ModelStore, client: PeerClient, links: Links,
                 metrics: Metrics | None = None, agents_on_host: Callable[[], int] = lambda: 1) -> None:
        self.node_id = node_id
        self.metrics = metrics or Metrics()
        self._agents_on_host = agents_on_host  # this one and the live peers on the same machine
        self._thread_plan: ThreadPlan | None = None
        self.config = config
        self.store = store
        self.client = client
        self.links = links
        self.orders: dict[int, RoutingOrder] = {}
        self.serving: dict[str, RoutingOrder] = {}  # router name -> the order it serves
        self.staged: dict[str, RoutingOrder] = {}  # router name -> an order built, not yet committed
        self.retiring: dict[int, float] = {}  # plan version -> monotonic time it may be freed after
        self.fault: dict[str, Any] | None = None  # why the last order could not be staged
        self.repairs: list[dict[str, Any]] = []  # the latest corrupt weight files found here
        self._standby_builds: set[asyncio.Task[None]] = set()  # owned here; cancelled by close()
        self._copies: asyncio.Queue[tuple[str, list[tuple[str, str]]]] = asyncio.Queue()
        self.copying: str | None = None  # the whole model being fetched now (see keep_whole_copy)
        self._declined: dict[str, int] = {}  # model -> free disk bytes when a copy was declined for room
        self.memory_bytes: dict[str, int] = {}  # router name -> what loading it took (effective)
        self.newest_epoch = 0
        self.runners: dict[RunnerKey, FragmentRunner] = {}
        self.state = "idle"
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ncm-compute")
        # Fragments are built on a thread of their own: steps go on while one is built.
        self.builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ncm-build")
        self.sessions: dict[str, _SessionInfo] = {}
        self._apply_lock = asyncio.Lock()

    # --- orders ---------------------------------------------------------------------------
    def check_epoch(self, epoch: int) -> None:
        if epoch < self.newest_epoch:
            raise StaleOrderError(f"order from epoch {epoch} ignored: epoch {self.newest_epoch} is current")

    @property
    def current(self) -> RoutingOrder | None:
        """The newest order of any model (None before the first)."""
        return max(self.serving.values(), key=lambda o: o.plan_version, default=None)

    def _key(self, order: RoutingOrder, first: int, last: int) -> RunnerKey:
        return (order.model, first, last, order.max_context or self.config.max_context,
                order.prefill_chunk or self.config.prefill_chunk)

    def _keys(self, order: RoutingOrder, *, with_standby: bool) -> set[RunnerKey]:
        ranges = order.ranges_for(self.node_id) if with_standby else {
            (h.layers.first, h.layers.last) for h in order.hops_of(self.node_id)}
        return {self._key(order, a, b) for a, b in ranges}

    async def stage(self, order: RoutingOrder) -> dict[str, Any]:
        """`set_routing`: build what ``order`` needs (fetching weights first); the order served
        does not change until :meth:`commit`. On failure :attr:`fault` says why."""
        self.check_epoch(order.epoch)
        async with self._apply_lock:
            self.check_epoch(order.epoch)
            known = self.serving.get(order.name)
            if known is not None and order.epoch == known.epoch and order.plan_version < known.plan_version:
                raise StaleOrderError(f"plan {order.plan_version} is older than plan {known.plan_version}")
            self.newest_epoch = order.epoch
            wanted = self._keys(order, with_standby=True)
            # A failover waits for nothing but its hops: the standby ranges come after the switch.
            missing = sorted((self._keys(order, with_standby=False) if order.standby_later else wanted)
                             - set(self.runners))
            previous_state, self.state = self.state, "loading"
            try:
                if missing:
                    await ensure_model_files(self.client, self.store, order.model, _files_of(missing),
                                             order.sources())
                rss_before = _rss_bytes()
                for key in missing:
                    self.runners[key] = await self._open_verified(order, key)
                grown = _rss_bytes() - rss_before
            except Exception as error:
                cause = failure_cause(error)
                self.state = previous_state
                self.fault = {"cause": cause, "message": f"{type(error).__name__}: {error}",
                              "model": order.model, "plan_version": order.plan_version}
                log.error("cannot stage plan %d (%s): %s", order.plan_version, cause, self.fault["message"])
                self._retire()  # free what was built for it
                raise
            reported = sum(self.runners[k].memory_bytes() for k in wanted if k in self.runners)
            if missing or order.name not in self.memory_bytes:
                self.memory_bytes[order.name] = max(reported, grown) + self._kv_budget_bytes(order, wanted)
            self.orders[order.plan_version] = order
            self.staged[order.name] = order
            self._retire()  # an older staged order of this model is replaced
            self.state, self.fault = "ready", None
            serving = self._keys(order, with_standby=False)
            if wanted - set(self.runners):
                self._standby_builds.add(asyncio.create_task(self._build_standby(order), name="standby-build"))
            log.info("plan %d (epoch %d) staged: %s layers %s; standby %s", order.plan_version, order.epoch,
                     order.model, _ranges(serving) or "none", _ranges(wanted - serving) or "none")
            return self.status()

    async def _build_standby(self, order: RoutingOrder) -> None:
        """Build the standby fragments of a failover's order once it is staged (they let the
        next failover go without a build); a failure only leaves that failover slower. The
        apply lock is not held meanwhile: the commit of the order must not wait for this."""
        try:
            missing = sorted(self._keys(order, with_standby=True) - set(self.runners))
            await ensure_model_files(self.client, self.store, order.model, _files_of(missing), order.sources())
            for key in missing:
                if order.plan_version not in self.orders:
                    return  # aborted or replaced meanwhile
                if key in self.runners:
                    continue
                runner = await self._open_verified(order, key)
                if key in self.runners:  # built by a stage meanwhile
                    runner.close()
                else:
                    self.runners[key] = runner
            log.info("plan %d: standby %s built", order.plan_version, _ranges(set(missing)))
            self._retire()
        except (NcmError, ShardsError, OSError) as error:
            log.warning("plan %d: standby fragments not built: %s", order.plan_version, error)
        finally:
            self._standby_builds.discard(asyncio.current_task())  # type: ignore[arg-type]

    async def commit(self, name: str, plan_version: int, epoch: int) -> dict[str, Any]:
        """Switch model ``name`` to its staged order ``plan_version``."""
        self.check_epoch(epoch)
        async with self._apply_lock:
            order = self.staged.get(name)
            if order is None or order.plan_version != plan_version:
                serving = self.serving.get(name)
                if serving is not None and serving.plan_version == plan_version:
                    return self.status()  # committed already
                raise StaleOrderError(f"plan {plan_version} of {name} is not staged here")
            del self.staged[name]
            previous = self.serving.get(name)
            self.serving[name] = order
            if previous is not None and previous.plan_version != plan_version:
                self.retiring[previous.plan_version] = time.monotonic() + RETIRE_GRACE_S
            self._retire()
            log.info("plan %d of %s committed", plan_version, name)
            return self.status()

    async def abort(self, name: str, plan_version: int, epoch: int) -> dict[str, Any]:
        """Drop the staged order ``plan_version`` of ``name`` (another node could not stage it)."""
        self.check_epoch(epoch)
        async with self._apply_lock:
            order = self.staged.get(name)
            if order is not None and order.plan_version == plan_version:
                del self.staged[name]
                self._retire()
                log.info("plan %d of %s aborted; %s", plan_version, name,
                         f"plan {self.serving[name].plan_version} goes on" if name in self.serving else "nothing changes")
            return self.status()

    async def apply(self, order: RoutingOrder) -> dict[str, Any]:
        """Stage and commit ``order`` at once (a single node, or tests)."""
        await self.stage(order)
        return await self.commit(order.name, order.plan_version, order.epoch)

    async def unload(self, name: str, epoch: int) -> dict[str, Any]:
        """Drop the order of model ``name``: its fragments are freed (sessions in flight finish)."""
        self.check_epoch(epoch)
        async with self._apply_lock:
            self.staged.pop(name, None)
            if self.serving.pop(name, None) is not None:
                log.info("model %s unloaded", name)
            self.memory_bytes.pop(name, None)
            self._retire()
            return self.status()

    def max_frame_bytes(self) -> int:
        """The largest data-plane frame this node takes: a prefill chunk of float32 hidden states
        of the widest stored model, the chunk at most its context (never under
        :data:`MIN_FRAME_LIMIT_BYTES`), plus room for the header. Larger frames are refused."""
        widest = 0
        for manifest in self.store.list():
            widest = max(widest, manifest.hidden_size * manifest.context_length * 4)
        return max(widest, MIN_FRAME_LIMIT_BYTES) + FRAME_HEADER_BYTES

    def device_memory(self) -> dict[str, int]:
        """The device the fragments live in, for the router's memory ledger."""
        return device_memory(vram_gib=self.config.vram_gib, ram_gib=self.config.ram_gib,
                             held_bytes=sum(self.memory_bytes.values()))

    def _kv_budget_bytes(self, order: RoutingOrder, keys: set[RunnerKey]) -> int:
        """KV cache of one session at full context over the layers of ``keys``."""
        try:
            manifest = self.store.manifest(order.model)
        except ShardsError:
            return 0
        layers = {layer for k in keys for layer in range(k[1], k[2] + 1)}
        return manifest.kv_bytes_per_token(len(layers)) * (order.max_context or self.config.max_context)

    def _retire(self) -> None:
        """Forget orders no request uses any more, and free the fragments none of the rest needs."""
        in_use = {info.plan_version for info in self.sessions.values()}
        now = time.monotonic()
        self.retiring = {version: until for version, until in self.retiring.items() if until > now}
        newest = {order.plan_version for order in (*self.serving.values(), *self.staged.values())}
        for version in list(self.orders):
            if version not in newest and version not in in_use and version not in self.retiring:
                del self.orders[version]
        needed: set[RunnerKey] = set()
        for order in self.orders.values():
            needed |= self._keys(order, with_standby=order.plan_version in newest)
        for key in [k for k in self.runners if k not in needed]:
            self.runners.pop(key).close()

    async def _open_verified(self, order: RoutingOrder, key: RunnerKey) -> FragmentRunner:
        """Open the runner of ``key``; weight files found corrupt while building its fragment
        are deleted and fetched again from the order's sources, once."""
        loop = asyncio.get_running_loop()
        model_dir = self.store.models_dir / order.model
        try:
            return await loop.run_in_executor(self.builder, self._open_runner, model_dir, key)
        except CorruptWeightsError as corrupt:
            await asyncio.to_thread(discard, model_dir, corrupt.paths)
            self.repairs = [*self.repairs[-(MAX_REPAIRS_KEPT - 1):],
                            {"model": order.model, "files": list(corrupt.paths), "fetched_again": False}]
            try:
                await ensure_model_files(self.client, self.store, order.model, _files_of([key]), order.sources())
            except WeightTransferError as error:
                raise CorruptWeightsError(f"{corrupt}; no peer could provide intact copies: {error}",
                                          corrupt.paths) from error
            self.repairs[-1]["fetched_again"] = True
            log.warning("fetched %s of %s again from a peer", ", ".join(corrupt.paths), order.model)
            return await loop.run_in_executor(self.builder, self._open_runner, model_dir, key)

    def _open_runner(self, model_dir: Path, key: RunnerKey) -> FragmentRunner:
        _, first, last, max_context, prefill_chunk = key
        plan = thread_plan(configured_threads=self.config.threads, spin=self.config.spin,
                           agents_on_host=self._agents_on_host(), cores=os.cpu_count() or 1)
        if plan != self._thread_plan:
            log.info("fragments run on %s thread(s), %s (%s)", plan.threads or "all",
                     "spinning between runs" if plan.spinning else "not spinning", plan.reason)
            self._thread_plan = plan
        return OrtFragmentRunner(
            model_dir, first, last,
            providers=list(self.config.providers) or None,
            threads=plan.threads,
            spinning=plan.spinning,
            max_context=max_context,
            prefill_chunk=prefill_chunk,
        )

    def status(self) -> dict[str, Any]:
        current = self.current
        models = {}
        for name, order in sorted(self.serving.items()):
            serving = self._keys(order, with_standby=False)
            models[name] = {
                "model": order.model, "plan_version": order.plan_version, "memory_bytes": self.memory_bytes.get(name, 0),
                "fragments": [{"layers": [k[1], k[2]], **self.runners[k].describe(),
                               "memory_bytes": self.runners[k].memory_bytes()} for k in sorted(serving) if k in self.runners],
                "standby": [[k[1], k[2]] for k in sorted(self._keys(order, with_standby=True) - serving)],
            }
        return {
            "state": self.state,
            "fault": self.fault,
            "repairs": self.repairs,
            "copying": self.copying,
            "staged": {name: {"plan_version": order.plan_version, "memory_bytes": self.memory_bytes.get(name, 0)}
                       for name, order in sorted(self.staged.items())},
            "model": current.model if current else None,
            "plan_version": current.plan_version if current else None,
            "epoch": self.newest_epoch,
            "fragments": [f for m in models.values() for f in m["fragments"]],
            "fragments_held": len(self.runners),  # also standby, staged and retiring ones
            "standby": [r for m in models.values() for r in m["standby"]],
            "models": models,
            "sessions": len(self.sessions),
            "orders": [order.to_json() for _, order in sorted(self.serving.items())],
        }

    # --- data plane ----------------------------------------------------------------------------
    def _compute(self, runner: FragmentRunner, sid: str, start: int, x: np.ndarray) -> np.ndarray:
        if start == 0 and sid in runner.sessions():
            runner.close_session(sid)  # a replay from the first token rebuilds the cache
        if sid not in runner.sessions():
            runner.open_session(sid)
        length = runner.session_length(sid)
        if length != start:
            raise StageError("session_out_of_sync", f"session {sid} holds {length} positions, step starts at {start}", None)
        return runner.forward(sid, x)

    async def step(self, header: dict[str, Any], tensor: np.ndarray | None) -> tuple[dict[str, Any], np.ndarray | None]:
        """Run one step through my hop and everything after it; returns the result frame."""
        sid, seq = header["sid"], header["seq"]
        order = self.orders.get(header["plan"])
        if order is None or header["epoch"] != order.epoch:
            raise StageError("stale_plan", f"node {self.node_id} does not know plan {header['plan']} of epoch {header['epoch']}", None)
        hop = order.hop_starting_at(header["layer"])
        runner = self.runners.get(self._key(order, hop.layers.first, hop.layers.last)) if hop and hop.node_id == self.node_id else None
        if hop is None or runner is None:
            raise StageError("wrong_stage", f"node {self.node_id} does not serve layers starting at {header['layer']}", None)
        if tensor is None:
            raise StageError("bad_request", "step frame without tensor", None)
        info = self.sessions.get(sid)
        fresh = info is None or info.plan_version != order.plan_version
        if fresh:
            info = self.sessions[sid] = _SessionInfo(order.plan_version, time.monotonic())
        assert info is not None
        info.last_used = started = time.monotonic()
        try:
            output = await asyncio.get_running_loop().run_in_executor(
                self.executor, self._compute, runner, sid, header["start"], tensor
            )
            self.metrics.child(self.metrics.stage_compute, order.name).observe(time.monotonic() - started)
        except (StageError, ShardsError) as error:
            if fresh:  # a step of a session this node does not hold (a late one, after its close)
                self._free(sid)
            if isinstance(error, StageError):
                raise
            raise StageError("bad_request", f"layers {hop.layers}: {error}", None) from None
        if not math.isfinite(output.sum(dtype=np.float64)):  # a NaN or Inf anywhere; no array allocated
            await self._drop_faulty(self._key(order, hop.layers.first, hop.layers.last))
            raise StageError("stage_faulty", f"layers {hop.layers} on node {self.node_id} computed NaN or Inf",
                             self.node_id)
        if hop.layers.last == order.total_layers - 1:
            token = None
            if header["sample"]:
                if header["start"] == 0 or info.sampler is None:
                    params = {k: v for k, v in (header.get("params") or {}).items() if k in SAMPLING_FIELDS}
                    try:
                        info.sampler = Sampler(SamplingParams(**params))
                    except (ShardsError, TypeError) as error:
                        raise StageError("bad_request", str(error), None) from None
                token = int(info.sampler.sample(output[0, -1]))
            return {"kind": "result", "sid": sid, "seq": seq, "token": token}, None
        next_node = order.next_after(hop.layers.last)
        assert next_node is not None
        forward = dict(header, layer=hop.layers.last + 1)
        forward.pop("tensor", None)
        return await self.forward_to(order, next_node, forward, output)

    async def forward_to(
        self, order: RoutingOrder, node_id: str, header: dict[str, Any], tensor: np.ndarray, *, timeout_s: float = 120.0
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        """Pass a step to the stage on ``node_id`` (this node: a local call) and return its result."""
        if node_id == self.node_id:
            return await self.step(header, tensor)
        link = await self.links.get(node_id, order.addresses[node_id])
        started = time.monotonic()
        result, _ = await link.call(header, tensor, timeout_s=timeout_s)
        self.metrics.child(self.metrics.hop_latency, node_id).observe(time.monotonic() - started)
        if result["kind"] == "error":
            raise error_from_header(result)
        return result, None

    async def _drop_faulty(self, key: RunnerKey) -> None:
        """A fragment that computes NaN or Inf is closed and its build deleted: the next order
        that needs it builds it again, from weight files checked against the manifest."""
        runner = self.runners.pop(key, None)
        if runner is None:
            return
        log.error("fragment %d-%d of %s computed NaN or Inf: dropped, with its build", key[1], key[2], key[0])
        build = getattr(runner, "path", None)
        runner.close()
        if isinstance(build, Path):
            await asyncio.to_thread(_delete_build, build.parent)

    def _free(self, sid: str) -> None:
        self.sessions.pop(sid, None)
        for runner in self.runners.values():
            if sid in runner.sessions():
                runner.close_session(sid)

    def close_session(self, sid: str) -> None:
        """Free ``sid`` here (the orchestrator tells every stage of the route itself)."""
        self._free(sid)
        self._retire()

    def keep_whole_copy(self, model: str, sources: list[tuple[str, str]]) -> bool:
        """Queue a fetch of every file of ``model`` (the fallback, so that losing any one node
        leaves a whole copy); False when this node holds it whole already or lacks the room."""
        if model in complete_models(self.store) or model == self.copying:
            return False
        if model in self._declined and self._declined[model] >= _free_bytes(self.store.root):
            return False  # no more room than when it was declined
        self._copies.put_nowait((model, sources))
        return True

    async def fetch_copies(self) -> None:
        """Fetch the whole models queued by :meth:`keep_whole_copy`, one at a time, when the disk
        has room for them (owned by the service's cleanup context)."""
        while True:
            model, sources = await self._copies.get()
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

    async def reap_idle_sessions(self) -> None:
        """Free sessions abandoned by their requests (owned by the service's cleanup context)."""
        while True:
            await asyncio.sleep(self.config.session_idle_timeout_s / 10)
            cutoff = time.monotonic() - self.config.session_idle_timeout_s
            for sid in [s for s, info in self.sessions.items() if info.last_used < cutoff]:
                log.info("freeing abandoned session %s", sid)
                self._free(sid)
            self._retire()

    def close(self) -> None:
        for task in self._standby_builds:
            task.cancel()
        for runner in self.runners.values():
            runner.close()
        self.runners.clear()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.builder.shutdown(wait=False, cancel_futures=True)
