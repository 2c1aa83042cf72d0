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

The fragments themselves live in a :class:`~agent.stage.fragment_cache.FragmentCache`, and the whole
copies of the fallback model this node keeps in :class:`~agent.stage.whole_copies.WholeCopies`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import psutil

from agent.cluster.peer_client import PeerClient
from agent.core.errors import NcmError
from agent.core.node_report import StageFault
from agent.core.orders import RoutingOrder
from agent.core.protocol import ResultFrame, StepFrame
from agent.core.routing import Hop
from agent.core.state_enum import StateEnum
from agent.dataplane.links import Links, Replies, StageError
from agent.local.config import AgentConfig
from agent.local.metrics import Metrics
from agent.local.probe import device_memory
from agent.stage.fragment_cache import FragmentCache, RunnerKey
from agent.stage.step_batcher import StepBatcher
from agent.stage.weights import StoreWriteError, WeightTransferError
from agent.stage.whole_copies import WholeCopies
from shards.errors import CorruptWeightsError, ShardsError
from shards.runtime.grammar import TokenMask, grammar_tokenizer
from shards.runtime.sampling import Sampler, SamplingParams
from shards.runtime.speculation import verify
from shards.store.model_store import ModelStore
from shards.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)
RETIRE_GRACE_S = 30.0  # a replaced order keeps answering this long, for steps already under way
MIN_FRAME_LIMIT_BYTES = 64 << 20  # data-plane frames this size are always taken
FRAME_HEADER_BYTES = 64 << 10  # room for a frame's header on top of its tensor
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "min_p", "repeat_penalty", "presence_penalty",
                   "frequency_penalty", "repeat_last_n", "logit_bias", "grammar", "logprobs")


def _ranges(keys: set[RunnerKey]) -> str:
    return ", ".join(f"{k.first_layer}-{k.last_layer}" for k in sorted(keys))


def _rss_bytes() -> int:
    return psutil.Process().memory_info().rss


class StaleOrderError(StageError):
    """An order (or an unload) older than what this node serves: the sender is behind (409)."""

    http_status, public_code = 409, "stale_order"
    answer = NcmError.answer  # a refusal of the sender, not a failed stage

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
    kept: bool = False  # its request is over; its KV cache waits for one that begins the same way


def max_frame_bytes(store: ModelStore) -> int:
    """The largest data-plane frame this node takes: a prefill chunk of float32 hidden states
    of the widest stored model, the chunk at most its context (never under
    :data:`MIN_FRAME_LIMIT_BYTES`), plus room for the header. Larger frames are refused."""
    widest = 0
    for manifest in store.list():
        widest = max(widest, manifest.hidden_size * manifest.context_length * 4)
    return max(widest, MIN_FRAME_LIMIT_BYTES) + FRAME_HEADER_BYTES


def _kv_budget_bytes(store: ModelStore, order: RoutingOrder, keys: set[RunnerKey], max_context: int) -> int:
    """KV cache of one session at full context (the order's, else ``max_context``) over the
    layers of ``keys``."""
    try:
        manifest = store.manifest(order.model)
    except ShardsError:
        return 0
    layers = {layer for k in keys for layer in range(k.first_layer, k.last_layer + 1)}
    return manifest.kv_bytes_per_token(len(layers)) * (order.max_context or max_context)


def _stage_fault(order: RoutingOrder, error: BaseException) -> StageFault:
    """Why ``order`` could not be staged (the worker's :attr:`~Worker.fault`), logged."""
    fault = StageFault(failure_cause(error), f"{type(error).__name__}: {error}", order.model, order.plan_version)
    log.error("cannot stage plan %d (%s): %s", order.plan_version, fault.cause, fault.message)
    return fault


def _sampling_params(step: StepFrame) -> tuple[SamplingParams, list[int], list[int]]:
    """What a sampling step asks for: its params, the context's recent prompt ids (for the
    penalties) and the ids chosen already (a generation replayed on a new route)."""
    raw = step.params or {}
    fields = {k: v for k, v in raw.items() if k in SAMPLING_FIELDS}
    history, generated = raw.get("history", []), raw.get("generated", [])
    if not all(isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
               for ids in (history, generated)):
        raise StageError("bad_request", "'history' and 'generated' must be lists of token ids", None)
    try:
        return SamplingParams(**fields), history, generated
    except (ShardsError, TypeError) as error:
        raise StageError("bad_request", str(error), None) from None


class WorkerState(StateEnum):
    """What the worker is doing (its status' ``state``)::

        idle --an order is staged--> loading --built--> ready --the next order--> loading
        loading --it could not be staged (``fault`` says why)--> what it was before
    """

    IDLE = "idle"
    LOADING = "loading"
    READY = "ready"


class Worker:
    """Runs the fragments of this node. Compute runs on one thread (decode steps that queue for
    it together run as one batch) and fragment builds on another, both off the event loop.

    Over 250 lines: it is this node's order book and its step handler, which share the orders
    and the sessions that keep each other's fragments alive."""

    def __init__(self, node_id: str, config: AgentConfig, store: ModelStore, client: PeerClient, links: Links,
                 results: Replies, metrics: Metrics | None = None, agents_on_host: Callable[[], int] = lambda: 1,
                 beside_bytes: Callable[[], int] = lambda: 0) -> None:
        self.node_id = node_id
        self.beside_bytes = beside_bytes  # what the agent holds beside the fragments (embedding, draft models)
        self.metrics = metrics or Metrics()
        self.config = config
        self.store = store
        self.links = links  # to the next stages of the routes this node serves
        self._results = results  # where this node's own requests' results go when it is their tail
        self.fragments = FragmentCache(config, store, client, agents_on_host)
        self.copies = WholeCopies(store, client)
        self.orders: dict[int, RoutingOrder] = {}
        self.serving: dict[str, RoutingOrder] = {}  # router name -> the order it serves
        self.staged: dict[str, RoutingOrder] = {}  # router name -> an order built, not yet committed
        self.retiring: dict[int, float] = {}  # plan version -> monotonic time it may be freed after
        self.fault: StageFault | None = None  # why the last order could not be staged
        self._standby_builds: set[asyncio.Task[None]] = set()  # owned here; cancelled by close()
        self.memory_bytes: dict[str, int] = {}  # router name -> what loading it took (effective)
        self.newest_epoch = 0
        self.state = WorkerState.IDLE
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ncm-compute")
        # decode steps that meet in its queue run as one batch, prompts beside them in slices
        self.batcher = StepBatcher(self.executor, self.config.prefill_share)
        self.sessions: dict[str, _SessionInfo] = {}
        self._grammar_tokenizers: dict[str, Any] = {}  # model -> llguidance's view of its tokenizer
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
        return RunnerKey(order.model, first, last, order.max_context or self.config.max_context,
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
            wanted, serving = self._keys(order, with_standby=True), self._keys(order, with_standby=False)
            # A failover waits for nothing but its hops: the standby ranges come after the switch.
            missing = sorted((serving if order.standby_later else wanted) - set(self.fragments.runners))
            previous_state, self.state = self.state, WorkerState.LOADING
            try:
                if missing:
                    await self.fragments.fetch_weights(order, missing)
                rss_before = _rss_bytes()
                for key in missing:
                    await self.fragments.open(order, key)
                grown = _rss_bytes() - rss_before
            except Exception as error:
                self.state, self.fault = previous_state, _stage_fault(order, error)
                self._retire()  # free what was built for it
                raise
            if missing or order.name not in self.memory_bytes:
                # a request's KV cache at full context, and as many kept for the prompt cache
                kv_bytes = _kv_budget_bytes(self.store, order, wanted, self.config.max_context)
                self.memory_bytes[order.name] = (max(self.fragments.memory_bytes(wanted), grown)
                                                 + kv_bytes * (1 + self.config.prompt_cache_entries))
            self.orders[order.plan_version] = order
            self.staged[order.name] = order
            self._retire()  # an older staged order of this model is replaced
            self.state, self.fault = WorkerState.READY, None
            if wanted - set(self.fragments.runners):
                self._standby_builds.add(asyncio.create_task(self._build_standby(order), name="standby-build"))
            log.info("plan %d (epoch %d) staged: %s layers %s; standby %s", order.plan_version, order.epoch,
                     order.model, _ranges(serving) or "none", _ranges(wanted - serving) or "none")
            return self.status()

    async def _build_standby(self, order: RoutingOrder) -> None:
        """Build the standby fragments of a failover's order once it is staged (they let the
        next failover go without a build); a failure only leaves that failover slower. The
        apply lock is not held meanwhile: the commit of the order must not wait for this."""
        try:
            missing = sorted(self._keys(order, with_standby=True) - set(self.fragments.runners))
            await self.fragments.fetch_weights(order, missing)
            for key in missing:
                if order.plan_version not in self.orders:
                    return  # aborted or replaced meanwhile
                await self.fragments.open(order, key)  # a stage may have built it meanwhile
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
        return max_frame_bytes(self.store)

    def held_bytes(self) -> int:
        """The memory this worker's loaded models hold."""
        return sum(self.memory_bytes.values())

    def device_memory(self) -> dict[str, int]:
        """The device the fragments live in, for the router's memory ledger."""
        return device_memory(vram_gib=self.config.vram_gib, ram_gib=self.config.ram_gib,
                             held_bytes=self.held_bytes(), beside_bytes=self.beside_bytes())

    def _retire(self) -> None:
        """Forget orders no request uses any more, and free the fragments none of the rest needs
        (and the KV caches kept on them)."""
        in_use = {info.plan_version for info in self.sessions.values() if not info.kept}
        now = time.monotonic()
        self.retiring = {version: until for version, until in self.retiring.items() if until > now}
        newest = {order.plan_version for order in (*self.serving.values(), *self.staged.values())}
        for version in list(self.orders):
            if version not in newest and version not in in_use and version not in self.retiring:
                del self.orders[version]
        for sid in [s for s, info in self.sessions.items() if info.kept and info.plan_version not in self.orders]:
            self._free(sid)
        needed: set[RunnerKey] = set()
        for order in self.orders.values():
            needed |= self._keys(order, with_standby=order.plan_version in newest)
        self.fragments.close_all_but(needed)

    def status(self) -> dict[str, Any]:
        current = self.current
        models = {}
        for name, order in sorted(self.serving.items()):
            serving = self._keys(order, with_standby=False)
            models[name] = {
                "model": order.model, "plan_version": order.plan_version, "memory_bytes": self.memory_bytes.get(name, 0),
                "fragments": self.fragments.describe(serving),
                "standby": [[k.first_layer, k.last_layer] for k in sorted(self._keys(order, with_standby=True) - serving)],
            }
        return {
            "state": self.state,
            "fault": self.fault.to_json() if self.fault else None,
            "repairs": self.fragments.repairs,
            "copying": self.copies.copying,
            "staged": {name: {"plan_version": order.plan_version, "memory_bytes": self.memory_bytes.get(name, 0)}
                       for name, order in sorted(self.staged.items())},
            "model": current.model if current else None,
            "plan_version": current.plan_version if current else None,
            "epoch": self.newest_epoch,
            "fragments": [f for m in models.values() for f in m["fragments"]],
            "fragments_held": len(self.fragments.runners),  # also standby, staged and retiring ones
            "standby": [r for m in models.values() for r in m["standby"]],
            "models": models,
            "sessions": sum(not info.kept for info in self.sessions.values()),  # requests in flight
            "kept_sessions": sum(info.kept for info in self.sessions.values()),  # the prompt cache's
            "batches": {"calls": self.batcher.batches, "steps": self.batcher.batched_steps},
            "orders": [order.to_json() for _, order in sorted(self.serving.items())],
        }

    # --- data plane ---------------------------------------------------------------------------
    async def _compute(self, step: StepFrame, tensor: np.ndarray | None) -> tuple[RoutingOrder, Hop, np.ndarray, _SessionInfo]:
        """Run ``step`` through my hop: its order, the hop, the output and the session."""
        sid = step.sid
        order = self.orders.get(step.plan)
        if order is None or step.epoch != order.epoch:
            raise StageError("stale_plan", f"node {self.node_id} does not know plan {step.plan} of epoch {step.epoch}", None)
        hop = order.hop_at(self.node_id, step.layer)
        runner = self.fragments.runners.get(self._key(order, hop.layers.first, hop.layers.last)) if hop else None
        if hop is None or runner is None:
            raise StageError("wrong_stage", f"node {self.node_id} does not serve layers starting at {step.layer}", None)
        if tensor is None:
            raise StageError("bad_request", "step frame without tensor", None)
        if step.reuse is not None:  # the kept session is this one's now (or, on a cache miss, gone)
            self.sessions.pop(step.reuse, None)
        info = self.sessions.get(sid)
        fresh = info is None or info.plan_version != order.plan_version
        if info is None or fresh:
            info = self.sessions[sid] = _SessionInfo(order.plan_version, time.monotonic())
        info.last_used = started = time.monotonic()
        try:
            if step.draft and tensor.shape[1] <= len(step.draft):
                raise StageError("bad_request", f"a step drafting {len(step.draft)} tokens reads "
                                 f"{len(step.draft) + 1} positions, not {tensor.shape[1]}", None)
            output = await self.batcher.compute(runner, sid, step.start, tensor, step.reuse,
                                                hidden=step.embed and runner.is_tail, rows=len(step.draft) + 1)
            self.metrics.child(self.metrics.stage_compute, order.name).observe(time.monotonic() - started)
        except (StageError, ShardsError) as error:
            if fresh:  # a step of a session this node does not hold (a late one, after its close)
                self._free(sid)
            if isinstance(error, StageError):
                raise
            raise StageError("bad_request", f"layers {hop.layers}: {error}", None) from None
        if not math.isfinite(output.sum(dtype=np.float64)):  # a NaN or Inf anywhere; no array allocated
            await self.fragments.drop_faulty(self._key(order, hop.layers.first, hop.layers.last))
            raise StageError("stage_faulty", f"layers {hop.layers} on node {self.node_id} computed NaN or Inf",
                             self.node_id)
        return order, hop, output, info

    async def relay(self, step: StepFrame, tensor: np.ndarray | None) -> None:
        """Run ``step`` (one naming its reply node, the orchestrator) through my hop and hand it
        to the next stage; the tail sends the result to the reply node. Nothing goes back to
        the sender: a failure, this stage's own or the next stage not taking the step, goes
        straight to the reply node too (which finds frozen and vanished stages itself)."""
        try:
            order, hop, output, info = await self._compute(step, tensor)
            next_node = order.next_after(hop.layers.last)
            if next_node is None:
                await self._to_reply(step, (await self._sample(order, info, step, output)).header())
                return
            await self._hand_on(order, next_node, step.at_layer(hop.layers.last + 1), output)
        except StageError as error:
            await self._to_reply(step, error.frame(step).header())
        except Exception as error:  # noqa: BLE001 - reported: the request fails with it, the agent goes on
            log.exception("step failed")
            await self._to_reply(step, StageError("internal", f"{type(error).__name__}: {error}", None)
                                 .frame(step).header())

    async def _hand_on(self, order: RoutingOrder, node_id: str, step: StepFrame, tensor: np.ndarray) -> None:
        """Give ``step`` (one naming its reply node) to the next stage, on ``node_id``; this
        node's own runs here. A :class:`StageError` when that node does not take it."""
        if node_id == self.node_id:
            await self.relay(step, tensor)
            return
        link = await self.links.get(node_id, order.addresses[node_id])
        await link.post(step.header(), tensor)

    async def _to_reply(self, step: StepFrame, header: dict[str, Any]) -> None:
        """Send a step's result or error frame to its reply node (on my own link to it)."""
        assert step.reply is not None and step.reply_url is not None
        if step.reply == self.node_id:
            self._results.deliver(header)
            return
        try:
            link = await self.links.get(step.reply, step.reply_url)
            await link.post(header)
        except StageError as error:  # the orchestrator is gone: its requests are over
            log.warning("could not send the %s of step %d of session %s to %s: %s",
                        header["kind"], step.seq, step.sid[:8], step.reply, error)

    async def _sample(self, order: RoutingOrder, info: _SessionInfo, step: StepFrame, output: np.ndarray) -> ResultFrame:
        """The token this tail stage picks from ``output`` (None unless the step asks for one),
        with its log-probabilities when the request asks; the session's sampler is made on its
        first sampling step, from the step's params."""
        if step.embed:
            return ResultFrame(step.sid, step.seq, None, embedding=output[0, -1])
        if not step.sample:
            return ResultFrame(step.sid, step.seq, None)
        if step.start == 0 or info.sampler is None:
            params, history, generated = _sampling_params(step)
            mask = None
            if params.grammar is not None:
                tokenizer = await self._grammar_tokenizer(order.model)
                try:  # a large grammar takes a while to compile: off the event loop
                    mask = await asyncio.to_thread(TokenMask, tokenizer, params.grammar)
                    mask.accept_all(generated)
                except ShardsError as error:
                    raise StageError("bad_request", str(error), None) from None
            info.sampler = Sampler(params, mask, [*history, *generated])
        if step.draft and info.sampler.params.logprobs is not None:  # a result carries one token's
            raise StageError("bad_request", "a step that drafts tokens cannot report log-probabilities", None)
        try:  # a speculative step's rows: the drafted tokens kept, then the first one that differs
            chosen = verify(info.sampler.sample, output[0, -len(step.draft) - 1:], step.draft)
        except ShardsError as error:  # the grammar allows nothing more that the model can say
            raise StageError("bad_request", str(error), None) from None
        logprobs = info.sampler.last_logprobs
        return ResultFrame(step.sid, step.seq, chosen[0], None if logprobs is None else (logprobs.logprob, logprobs.top),
                           more=tuple(chosen[1:]))

    async def _grammar_tokenizer(self, model: str) -> Any:
        """llguidance's view of ``model``'s tokenizer, made once (in a thread: ~0.3 s)."""
        if model not in self._grammar_tokenizers:
            tokenizer = await asyncio.to_thread(Tokenizer.from_model_dir, self.store.model_dir(model))
            self._grammar_tokenizers[model] = await asyncio.to_thread(grammar_tokenizer, tokenizer)
        return self._grammar_tokenizers[model]

    def _free(self, sid: str) -> None:
        self.sessions.pop(sid, None)
        self.fragments.free_session(sid)

    def close_session(self, sid: str, *, keep: bool = False) -> None:
        """Free ``sid`` here (the orchestrator tells every stage of the route itself), or keep
        its KV cache for a later request's step that reuses it."""
        info = self.sessions.get(sid)
        if keep and info is not None:
            info.kept, info.last_used = True, time.monotonic()
            return
        self._free(sid)
        self._retire()

    def keep_whole_copy(self, model: str, sources: list[tuple[str, str]]) -> bool:
        return self.copies.keep_whole_copy(model, sources)

    async def reap_idle_sessions(self) -> None:
        """Free sessions abandoned by their requests (owned by the service's cleanup context)."""
        while True:
            await asyncio.sleep(self.config.session_idle_timeout_s / 10)
            now = time.monotonic()
            for sid, info in list(self.sessions.items()):
                if info.last_used < now - (self.config.prompt_cache_idle_s if info.kept
                                           else self.config.session_idle_timeout_s):
                    log.info("freeing %s session %s", "a kept" if info.kept else "an abandoned", sid[:8])
                    self._free(sid)
            self._retire()

    def close(self) -> None:
        for task in self._standby_builds:
            task.cancel()
        self.batcher.close()
        self.fragments.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
