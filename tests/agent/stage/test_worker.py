"""The worker's side of a plan change (stage, then commit or abort) and of a fragment that
computes NaN, on the real default model in this test's event loop."""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp
import numpy as np
import pytest

from agent.cluster.peer_client import PeerClient
from agent.core.orders import RoutingOrder
from agent.core.plan import LayerRange
from agent.core.protocol import ResultFrame, StepFrame
from agent.core.routing import Hop, Route
from agent.dataplane.links import Links, Replies, StageError
from agent.local.config import AgentConfig
from agent.stage.worker import StaleOrderError, Worker
from shards.store.manifest import WeightFile
from shards.store.model_store import ModelStore
from shards.store.tensorfile import read_tensors, write_tensors
from tests.agent.agents import CLUSTER_KEY, MAIN, linked_copy

pytestmark = pytest.mark.slow
NODE = "node-0"


def order(version: int, cuts: list[tuple[int, int]], layers: int) -> RoutingOrder:
    route = Route(tuple(Hop(NODE, LayerRange(a, b)) for a, b in cuts))
    return RoutingOrder(epoch=1, orchestrator=NODE, plan_version=version, model=MAIN, total_layers=layers,
                        route=route, addresses={NODE: "https://127.0.0.1:1"})


def step_of(o: RoutingOrder, sid: str) -> StepFrame:
    return StepFrame(sid, 0, 0, 0, o.epoch, o.plan_version, True, {"temperature": 0}).replying_to(NODE, o.addresses[NODE])


results = Replies()  # the node's result registry: the worker is its own reply node here


async def run(worker: Worker, step: StepFrame, tensor: np.ndarray) -> ResultFrame:
    """``step`` through the worker (its own reply node): the tail's result, or the StageError a stage sent."""
    outcome = results.expect(step.sid, step.seq)
    await worker.relay(step, tensor)
    return await outcome


async def with_worker(home, body) -> None:
    async with aiohttp.ClientSession() as session:
        client = PeerClient(session, CLUSTER_KEY.encode(), NODE, None)
        worker = Worker(NODE, AgentConfig(cluster_key=CLUSTER_KEY, threads=1), ModelStore(home), client, Links(client),
                        results)
        try:
            await body(worker)
        finally:
            worker.close()


def test_a_plan_is_served_only_once_committed_and_an_aborted_one_leaves_the_served_one(smollm2_store, tmp_path):
    home = linked_copy(smollm2_store.root, tmp_path / "home")
    layers = smollm2_store.manifest(MAIN).n_layers
    prompt = np.asarray([[1, 2, 3]], dtype=np.int64)

    async def body(worker: Worker) -> None:
        first, second = order(1, [(0, layers - 1)], layers), order(2, [(0, 9), (10, layers - 1)], layers)
        await worker.apply(first)
        await worker.stage(second)
        assert worker.serving[MAIN].plan_version == 1 and worker.status()["staged"][MAIN]["plan_version"] == 2
        # Both answer steps meanwhile, with the same token.
        one = await run(worker, step_of(first, "a"), prompt)
        two = await run(worker, step_of(second, "b"), prompt)
        assert one.token == two.token
        await worker.abort(MAIN, 2, 1)
        assert worker.status()["staged"] == {} and sorted(worker.orders) == [1, 2]  # "b" is still open
        worker.close_session("b")
        assert sorted(worker.orders) == [1]
        with pytest.raises(StaleOrderError):
            await worker.commit(MAIN, 2, 1)  # an aborted plan cannot be committed
        await worker.stage(second)
        await worker.commit(MAIN, 2, 1)
        assert worker.serving[MAIN].plan_version == 2
        # The replaced plan still answers the steps already under way, for a grace period.
        again = await run(worker, step_of(first, "c"), prompt)
        assert again.token == one.token

    asyncio.run(with_worker(home, body))


def test_a_fragment_that_computes_nan_is_a_faulty_stage_and_is_dropped(smollm2_store, tmp_path):
    home = linked_copy(smollm2_store.root, tmp_path / "home")
    manifest = smollm2_store.manifest(MAIN)
    model_dir = home / "models" / MAIN
    # A layer whose numbers are broken in a way no checksum sees (the manifest agrees with them).
    entry = manifest.files["layer.3"]
    path = model_dir / entry.path
    tensors = read_tensors(path)
    name = next(n for n, t in tensors.items() if t.ndim == 2 and t.dtype == np.float32)
    tensors[name] = np.full_like(tensors[name], np.nan)
    path.unlink()
    write_tensors(path, tensors)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    files = dict(manifest.files) | {"layer.3": WeightFile(entry.path, path.stat().st_size, digest)}
    (model_dir / "manifest.json").unlink()
    ModelStore(home).write_manifest(model_dir, manifest.__class__(**{**manifest.__dict__, "files": files}))
    layers = manifest.n_layers

    async def body(worker: Worker) -> None:
        o = order(1, [(0, layers - 1)], layers)
        await worker.apply(o)
        with pytest.raises(StageError) as caught:
            await run(worker, step_of(o, "a"), np.asarray([[1, 2, 3]], dtype=np.int64))
        assert caught.value.code == "stage_faulty" and caught.value.node == NODE
        assert worker.fragments.runners == {}  # closed, and its build deleted: the next order builds it again
        assert not list((model_dir / "fragments").glob(f"{MAIN}-000-*"))

    asyncio.run(with_worker(home, body))
