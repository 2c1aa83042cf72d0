"""The worker: the layer fragments this node serves for the current routing order, and the
step handler of the data plane (run my layers, forward to the next stage, sample at the tail)."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent.config import AgentConfig
from agent.core.orders import RoutingOrder
from agent.dataplane import Links, StageError, error_from_header
from agent.peer_client import PeerClient
from agent.weights import ensure_model_files
from shards.errors import ShardsError
from shards.runner import FragmentRunner, OrtFragmentRunner
from shards.sampling import Sampler, SamplingParams
from shards.store import ModelStore

log = logging.getLogger(__name__)
SESSION_IDLE_TIMEOUT_S = 300.0
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed")


class StaleOrderError(StageError):
    def __init__(self, message: str) -> None:
        super().__init__("stale_order", message, None)


@dataclass
class _SessionInfo:
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
        self.order: RoutingOrder | None = None
        self.newest_epoch = 0
        self.runners: dict[tuple[int, int], FragmentRunner] = {}
        self.state = "idle"
        self.error: str | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ncm-compute")
        self.sessions: dict[str, _SessionInfo] = {}
        self._apply_lock = asyncio.Lock()

    # --- orders ---------------------------------------------------------------------------
    def check_epoch(self, epoch: int) -> None:
        if epoch < self.newest_epoch:
            raise StaleOrderError(f"order from epoch {epoch} ignored: epoch {self.newest_epoch} is current")

    async def apply(self, order: RoutingOrder) -> dict[str, Any]:
        """`set_routing`: hold the fragments of my hops in ``order`` (fetching weights first)."""
        self.check_epoch(order.epoch)
        self.newest_epoch = order.epoch
        async with self._apply_lock:
            self.check_epoch(order.epoch)
            wanted = {(hop.layers.first, hop.layers.last) for hop in order.hops_of(self.node_id)}
            self.state = "loading"
            try:
                if wanted:
                    await ensure_model_files(
                        self.client, self.store, order.model,
                        lambda m: sorted({k for a, b in wanted for k in m.fragment_files(a, b)}),
                        list(order.weight_sources),
                    )
                model_dir = self.store.models_dir / order.model
                for first, last in sorted(wanted - set(self.runners)):
                    self.runners[(first, last)] = await asyncio.get_running_loop().run_in_executor(
                        self.executor, self._open_runner, model_dir, first, last
                    )
            except Exception as error:
                self.state, self.error = "failed", str(error)
                raise
            previous = self.order
            self.order = order
            stale = [key for key in self.runners if key not in wanted or (previous and previous.model != order.model)]
            for key in stale:
                self.runners.pop(key).close()
            if previous is None or previous.model != order.model:
                self.sessions.clear()
            self.state, self.error = "ready", None
            log.info("serving %s layers %s (plan %d, epoch %d)", order.model,
                     ", ".join(f"{a}-{b}" for a, b in sorted(wanted)) or "none", order.plan_version, order.epoch)
            return self.status()

    def _open_runner(self, model_dir: Path, first: int, last: int) -> FragmentRunner:
        return OrtFragmentRunner(
            model_dir, first, last,
            providers=list(self.config.providers) or None,
            threads=self.config.threads or None,
            max_context=self.config.max_context,
            prefill_chunk=self.config.prefill_chunk,
        )

    def status(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "error": self.error,
            "model": self.order.model if self.order else None,
            "plan_version": self.order.plan_version if self.order else None,
            "epoch": self.newest_epoch,
            "fragments": [
                {"layers": [a, b], "provider": r.provider, "memory_bytes": r.memory_bytes()} for (a, b), r in sorted(self.runners.items())
            ],
            "sessions": len(self.sessions),
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
        order = self.order
        if order is None or header["plan"] != order.plan_version or header["epoch"] != order.epoch:
            raise StageError("stale_plan", f"node {self.node_id} is not on plan {header['plan']} (epoch {header['epoch']})", None)
        hop = order.hop_starting_at(header["layer"])
        if hop is None or hop.node_id != self.node_id or (hop.layers.first, hop.layers.last) not in self.runners:
            raise StageError("wrong_stage", f"node {self.node_id} does not serve layers starting at {header['layer']}", None)
        runner = self.runners[(hop.layers.first, hop.layers.last)]
        info = self.sessions.setdefault(sid, _SessionInfo(time.monotonic()))
        info.last_used = time.monotonic()
        if tensor is None:
            raise StageError("bad_request", "step frame without tensor", None)
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
                    except ShardsError as error:
                        raise StageError("bad_request", str(error), None) from None
                token = int(info.sampler.sample(output[0, -1]))
            return {"kind": "result", "sid": sid, "seq": seq, "token": token}, None
        next_node = order.next_after(hop.layers.last)
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

    async def close_session(self, sid: str, layer: int) -> None:
        """Free ``sid`` on my hop starting at ``layer`` and pass the close down the route."""
        order = self.order
        self.sessions.pop(sid, None)
        for runner in self.runners.values():
            if sid in runner.sessions():
                runner.close_session(sid)
        if order is None:
            return
        hop = order.hop_starting_at(layer)
        if hop is None:
            return
        next_node = order.next_after(hop.layers.last)
        if next_node is None:
            return
        header = {"kind": "close", "sid": sid, "layer": hop.layers.last + 1}
        if next_node == self.node_id:
            await self.close_session(sid, hop.layers.last + 1)
        else:
            link = await self.links.get(next_node, order.addresses[next_node])
            await link.send(header)

    async def reap_idle_sessions(self) -> None:
        """Free sessions abandoned by their requests (owned by the service's cleanup context)."""
        while True:
            await asyncio.sleep(SESSION_IDLE_TIMEOUT_S / 10)
            cutoff = time.monotonic() - SESSION_IDLE_TIMEOUT_S
            for sid in [s for s, info in self.sessions.items() if info.last_used < cutoff]:
                log.info("freeing abandoned session %s", sid)
                self.sessions.pop(sid, None)
                for runner in self.runners.values():
                    if sid in runner.sessions():
                        runner.close_session(sid)

    def close(self) -> None:
        for runner in self.runners.values():
            runner.close()
        self.runners.clear()
        self.executor.shutdown(wait=False, cancel_futures=True)
