"""The worker: the layer fragments this node serves, and the step handler of the data plane
(run my layers, forward to the next stage, sample at the tail).

A worker keeps, for every model the router has loaded, the newest routing order, plus every
older one that a request in flight still uses, so requests finish on the plan they started on;
fragments no kept order needs are freed. Unloading a model drops its order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from agent.config import AgentConfig
from agent.core.orders import RoutingOrder
from agent.dataplane import Links, StageError, error_from_header
from agent.peer_client import PeerClient
from agent.probe import device_memory
from agent.weights import ensure_model_files
from shards.errors import ShardsError
from shards.runner import FragmentRunner, OrtFragmentRunner
from shards.sampling import Sampler, SamplingParams
from shards.store import ModelStore

log = logging.getLogger(__name__)
SESSION_IDLE_TIMEOUT_S = 300.0
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed")
RunnerKey = tuple[str, int, int, int, int]  # model, first layer, last layer, max context, prefill chunk


def _ranges(keys: set[RunnerKey]) -> str:
    return ", ".join(f"{k[1]}-{k[2]}" for k in sorted(keys))


def _rss_bytes() -> int:
    return psutil.Process().memory_info().rss


class StaleOrderError(StageError):
    def __init__(self, message: str) -> None:
        super().__init__("stale_order", message, None)


@dataclass
class _SessionInfo:
    plan_version: int
    last_used: float
    sampler: Sampler | None = None


class Worker:
    """Runs the fragments of this node. Compute runs on one thread, off the event loop."""

    def __init__(self, node_id: str, config: AgentConfig, store: ModelStore, client: PeerClient, links: Links) -> None:
        self.node_id = node_id
        self.config = config
        self.store = store
        self.client = client
        self.links = links
        self.orders: dict[int, RoutingOrder] = {}
        self.serving: dict[str, RoutingOrder] = {}  # router name -> newest order
        self.memory_bytes: dict[str, int] = {}  # router name -> what loading it took (effective)
        self.newest_epoch = 0
        self.runners: dict[RunnerKey, FragmentRunner] = {}
        self.state = "idle"
        self.error: str | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ncm-compute")
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

    async def apply(self, order: RoutingOrder) -> dict[str, Any]:
        """`set_routing`: hold the fragments ``order`` gives me (fetching weights first)."""
        self.check_epoch(order.epoch)
        async with self._apply_lock:
            self.check_epoch(order.epoch)
            known = self.serving.get(order.name)
            if known is not None and order.epoch == known.epoch and order.plan_version < known.plan_version:
                raise StaleOrderError(f"plan {order.plan_version} is older than plan {known.plan_version}")
            self.newest_epoch = order.epoch
            wanted = self._keys(order, with_standby=True)
            missing = sorted(wanted - set(self.runners))
            self.state = "loading"
            try:
                if missing:
                    await ensure_model_files(
                        self.client, self.store, order.model,
                        lambda m: sorted({f for k in missing for f in m.fragment_files(k[1], k[2])}),
                        order.sources(),
                    )
                rss_before = _rss_bytes()
                for key in missing:
                    self.runners[key] = await asyncio.get_running_loop().run_in_executor(
                        self.executor, self._open_runner, self.store.models_dir / order.model, key
                    )
                grown = _rss_bytes() - rss_before
            except Exception as error:
                self.state, self.error = "failed", f"{type(error).__name__}: {error}"
                raise
            reported = sum(self.runners[k].memory_bytes() for k in wanted)
            if missing or order.name not in self.memory_bytes:
                self.memory_bytes[order.name] = max(reported, grown) + self._kv_budget_bytes(order, wanted)
            self.orders[order.plan_version] = order
            self.serving[order.name] = order
            self._retire()
            self.state, self.error = "ready", None
            serving = self._keys(order, with_standby=False)
            log.info("plan %d (epoch %d): %s layers %s; standby %s", order.plan_version, order.epoch, order.model,
                     _ranges(serving) or "none", _ranges(wanted - serving) or "none")
            return self.status()

    async def unload(self, name: str, epoch: int) -> dict[str, Any]:
        """Drop the order of model ``name``: its fragments are freed (sessions in flight finish)."""
        self.check_epoch(epoch)
        async with self._apply_lock:
            if self.serving.pop(name, None) is not None:
                log.info("model %s unloaded", name)
            self.memory_bytes.pop(name, None)
            self._retire()
            return self.status()

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
        newest = {order.plan_version for order in self.serving.values()}
        for version in list(self.orders):
            if version not in newest and version not in in_use:
                del self.orders[version]
        needed: set[RunnerKey] = set()
        for order in self.orders.values():
            needed |= self._keys(order, with_standby=order.plan_version in newest)
        for key in [k for k in self.runners if k not in needed]:
            self.runners.pop(key).close()

    def _open_runner(self, model_dir: Path, key: RunnerKey) -> FragmentRunner:
        _, first, last, max_context, prefill_chunk = key
        return OrtFragmentRunner(
            model_dir, first, last,
            providers=list(self.config.providers) or None,
            threads=self.config.threads or None,
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
            "error": self.error,
            "model": current.model if current else None,
            "plan_version": current.plan_version if current else None,
            "epoch": self.newest_epoch,
            "fragments": [f for m in models.values() for f in m["fragments"]],
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
        if info is None or info.plan_version != order.plan_version:
            info = self.sessions[sid] = _SessionInfo(order.plan_version, time.monotonic())
        info.last_used = time.monotonic()
        try:
            output = await asyncio.get_running_loop().run_in_executor(
                self.executor, self._compute, runner, sid, header["start"], tensor
            )
        except ShardsError as error:
            raise StageError("bad_request", f"layers {hop.layers}: {error}", None) from None
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
        result, _ = await link.call(header, tensor, timeout_s=timeout_s)
        if result["kind"] == "error":
            raise error_from_header(result)
        return result, None

    def _free(self, sid: str) -> None:
        self.sessions.pop(sid, None)
        for runner in self.runners.values():
            if sid in runner.sessions():
                runner.close_session(sid)

    async def close_session(self, sid: str, layer: int, plan_version: int | None = None) -> None:
        """Free ``sid`` here and pass the close down the route of the plan it used."""
        info = self.sessions.get(sid)
        order = self.orders.get(plan_version if plan_version is not None else (info.plan_version if info else -1))
        self._free(sid)
        self._retire()
        hop = order.hop_starting_at(layer) if order else None
        next_node = order.next_after(hop.layers.last) if order and hop else None
        if order is None or hop is None or next_node is None:
            return
        if next_node == self.node_id:
            await self.close_session(sid, hop.layers.last + 1, order.plan_version)
        else:
            link = await self.links.get(next_node, order.addresses[next_node])
            await link.send({"kind": "close", "sid": sid, "layer": hop.layers.last + 1, "plan": order.plan_version})

    async def reap_idle_sessions(self) -> None:
        """Free sessions abandoned by their requests (owned by the service's cleanup context)."""
        while True:
            await asyncio.sleep(SESSION_IDLE_TIMEOUT_S / 10)
            cutoff = time.monotonic() - SESSION_IDLE_TIMEOUT_S
            for sid in [s for s, info in self.sessions.items() if info.last_used < cutoff]:
                log.info("freeing abandoned session %s", sid)
                self._free(sid)
            self._retire()

    def close(self) -> None:
        for runner in self.runners.values():
            runner.close()
        self.runners.clear()
        self.executor.shutdown(wait=False, cancel_futures=True)
