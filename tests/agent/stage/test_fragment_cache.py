"""The fragment cache (:mod:`agent.stage.fragment_cache`): the runners of the tiny model a node
holds open, built on the cache's own thread from a real model store in tmp_path, with an
in-process agent on loopback as the weight source of the orders:

- the weight files of the keys are fetched from the order's sources, nothing more;
- a runner is opened once per key and held; the runners compute the model's layers (two
  fragments give what one over both layers gives); the cache reports them in layer order,
  with their memory, closes those no longer needed, and frees a session on every runner;
- a range opens in parts side by side when the agent is alone on its host, as one session when
  agents share it;
- a weight file found corrupt while building is deleted and fetched again, once; when no peer
  has an intact copy the build fails, saying so, and the repair is shown as not fetched again;
- a fragment that computed NaN or Inf is dropped with its build, and built again when needed;
- the latest repairs are kept, at most :data:`MAX_REPAIRS_KEPT`;
- the agent's ``activation_bits`` reach the fragments it builds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.cluster.peer_client import PeerClient
from agent.core.orders import RoutingOrder
from agent.core.plan import LayerRange
from agent.core.routing import Hop, Route
from agent.local.config import AgentConfig
from agent.stage.fragment_cache import DRAFT_INT8_MIN_WEIGHTS, MAX_REPAIRS_KEPT, FragmentCache, RunnerKey
from agent.stage.weights import Source
from shards.errors import CorruptWeightsError, RunnerError
from shards.graph.fragment import DEFAULT_ACTIVATION_BITS, INT8_MIN_WEIGHTS
from shards.importers.importer import import_model
from shards.providers.backends import backend_chain, detect_platform
from shards.store.model_store import ModelStore
from shards.store.verify import hash_file
from tests.agent.agents import CLUSTER_KEY
from tests.agent.stage.test_weights import LAYER_1, TINY, flip_a_byte, peers
from tests.shards.fragment_helpers import write_tiny_checkpoint

CONTEXT = 64
PROMPT = np.asarray([[5, 6, 7, 8]], dtype=np.int64)


def key(first: int, last: int) -> RunnerKey:
    return RunnerKey(TINY, first, last, CONTEXT, 16)


def order_from(sources: list[Source]) -> RoutingOrder:
    """An order of the tiny model whose weights come from ``sources``."""
    node = sources[0][0] if sources else "node-0"
    return RoutingOrder(epoch=1, orchestrator=node, plan_version=1, model=TINY, total_layers=2,
                        route=Route((Hop(node, LayerRange(0, 1)),)),
                        addresses={node: "https://127.0.0.1:1", **dict(sources)},
                        weight_sources=tuple(n for n, _ in sources), max_context=CONTEXT, prefill_chunk=16)


@contextlib.asynccontextmanager
async def fragment_cache(tmp: Path, *, threads: int = 1, agents_on_host: int = 1, stored: bool = True,
                         activation_bits: int = DEFAULT_ACTIVATION_BITS) -> AsyncIterator[tuple[FragmentCache, RoutingOrder]]:
    """A cache over the store ``tmp/node`` (holding the tiny model when ``stored``), with the
    order whose weight source is an in-process agent holding it too."""
    async with peers(tmp) as (sources, client):
        store = ModelStore(tmp / "node")
        if stored:
            import_model(tmp / "checkpoint", name=TINY, store=store, progress=False)
        config = AgentConfig(cluster_key=CLUSTER_KEY, threads=threads, activation_bits=activation_bits)
        cache = FragmentCache(config, store, client, agents_on_host=lambda: agents_on_host)
        try:
            yield cache, order_from(sources)
        finally:
            cache.close()


def logits(runners: list[Any], sid: str) -> np.ndarray:
    x: np.ndarray = PROMPT
    for runner in runners:
        runner.open_session(sid)
        x = runner.forward(sid, x)
    return x


def test_the_weight_files_of_the_keys_are_fetched_from_the_orders_sources(tmp_path):
    async def scenario() -> None:
        async with fragment_cache(tmp_path, stored=False) as (cache, order):
            await asyncio.wait_for(cache.fetch_weights(order, [key(1, 1)]), timeout=30)
            weights = {p.name for p in (cache.store.models_dir / TINY / "weights").iterdir()}
            assert weights == {"layer_001.safetensors", "head.safetensors"}  # the tail's files only
            await asyncio.wait_for(cache.open(order, key(1, 1)), timeout=60)
            assert list(cache.runners) == [key(1, 1)]

    asyncio.run(scenario())


def test_a_runner_is_opened_once_per_key_computes_its_layers_and_is_reported_in_layer_order(tmp_path):
    async def scenario() -> None:
        async with fragment_cache(tmp_path) as (cache, order):
            for k in (key(1, 1), key(0, 0), key(0, 1)):
                await asyncio.wait_for(cache.open(order, k), timeout=60)
            whole = cache.runners[key(0, 1)]
            await asyncio.wait_for(cache.open(order, key(0, 1)), timeout=5)
            assert cache.runners[key(0, 1)] is whole  # held: not opened again
            assert cache.thread_plan is not None and cache.thread_plan.threads == 1

            split = logits([cache.runners[key(0, 0)], cache.runners[key(1, 1)]], "split")
            one = logits([whole], "one")
            assert one.shape == (1, PROMPT.shape[1], 96) and np.isfinite(one).all()
            np.testing.assert_allclose(split, one, rtol=1e-4, atol=1e-4)

            every = {key(0, 0), key(1, 1), key(0, 1)}
            described = cache.describe(every | {key(0, 0)._replace(model="other")})
            assert [d["layers"] for d in described] == [[0, 0], [0, 1], [1, 1]]
            assert all(d["memory_bytes"] > 0 and d["provider"] for d in described)
            assert cache.memory_bytes(every) == sum(d["memory_bytes"] for d in described)
            assert cache.memory_bytes({key(0, 1)._replace(max_context=CONTEXT * 2)}) == 0  # another key: not held

            cache.free_session("split")
            assert cache.runners[key(0, 0)].sessions() == cache.runners[key(1, 1)].sessions() == []
            assert whole.sessions() == ["one"]
            cache.free_session("never-opened")

            cache.close_all_but({key(0, 1)})
            assert list(cache.runners) == [key(0, 1)] and cache.runners[key(0, 1)] is whole
            assert whole.sessions() == ["one"]

    asyncio.run(scenario())


def test_the_agents_activation_bits_reach_the_fragments_it_builds(tmp_path):
    """... a draft model's too, whose 4-bit products all take int8 activations (its drafts are
    checked: only their speed counts)."""
    async def scenario() -> None:
        async with fragment_cache(tmp_path, activation_bits=16) as (cache, order):
            await asyncio.wait_for(cache.open(order, key(0, 1)), timeout=60)
            built = json.loads((cache.runners[key(0, 1)].path.parent / "fragment.json").read_text())
            assert (built["activation_bits"], built["int8_min_weights"]) == (16, INT8_MIN_WEIGHTS[16])
            draft = await asyncio.wait_for(cache.open_whole(TINY, CONTEXT, 16, []), timeout=60)
            try:
                built = json.loads((draft.path.parent / "fragment.json").read_text())
                assert (built["activation_bits"], built["int8_min_weights"]) == (16, DRAFT_INT8_MIN_WEIGHTS)
            finally:
                draft.close()

    asyncio.run(scenario())


def test_a_range_opens_in_parts_side_by_side_only_when_its_agent_is_alone_on_the_host(tmp_path):
    if backend_chain(detect_platform())[0][0].kind != "cpu":
        pytest.skip("fragments run on an accelerator here: a range is always one session")

    async def scenario() -> None:
        async with fragment_cache(tmp_path / "alone", threads=2) as (cache, order):
            await asyncio.wait_for(cache.open(order, key(0, 1)), timeout=60)
            assert cache.describe({key(0, 1)})[0]["parts"] == [[0, 0], [1, 1]]
            assert cache.thread_plan is not None and cache.thread_plan.load_side_by_side
        async with fragment_cache(tmp_path / "shared", threads=2, agents_on_host=2) as (cache, order):
            await asyncio.wait_for(cache.open(order, key(0, 1)), timeout=60)
            assert "parts" not in cache.describe({key(0, 1)})[0]
            assert cache.thread_plan is not None and not cache.thread_plan.load_side_by_side

    asyncio.run(scenario())


def test_a_corrupt_weight_file_is_deleted_and_fetched_again_before_the_build(tmp_path):
    async def scenario() -> None:
        async with fragment_cache(tmp_path) as (cache, order):
            path = cache.store.models_dir / TINY / LAYER_1
            flip_a_byte(path, keep_mtime=False)
            await asyncio.wait_for(cache.open(order, key(1, 1)), timeout=60)
            assert list(cache.runners) == [key(1, 1)]
            assert cache.repairs == [{"model": TINY, "files": [LAYER_1], "fetched_again": True, "found_by": "build"}]
            assert hash_file(path).hexdigest() == cache.store.manifest(TINY).files["layer.1"].sha256

    asyncio.run(scenario())


def test_without_an_intact_copy_anywhere_the_build_fails_and_the_repair_shows_it(tmp_path):
    async def scenario() -> None:
        async with fragment_cache(tmp_path) as (cache, order):
            flip_a_byte(tmp_path / "home-0" / "models" / TINY / LAYER_1, keep_mtime=False)  # the source's too
            path = cache.store.models_dir / TINY / LAYER_1
            flip_a_byte(path, keep_mtime=False)
            with pytest.raises(CorruptWeightsError) as failed:
                await asyncio.wait_for(cache.open(order, key(1, 1)), timeout=60)
            assert "no peer could provide intact copies" in str(failed.value)
            assert failed.value.paths == (LAYER_1,)
            assert cache.runners == {} and not path.exists()  # the corrupt file is not kept either
            assert cache.repairs == [{"model": TINY, "files": [LAYER_1], "fetched_again": False, "found_by": "build"}]

            await asyncio.wait_for(cache.open(order, key(0, 0)), timeout=60)  # other layers still build
            assert list(cache.runners) == [key(0, 0)]

    asyncio.run(scenario())


def test_a_fragment_that_computed_nan_is_dropped_with_its_build_and_built_again_when_needed(tmp_path):
    async def scenario() -> None:
        async with fragment_cache(tmp_path) as (cache, order):
            await asyncio.wait_for(cache.open(order, key(0, 1)), timeout=60)
            await asyncio.wait_for(cache.open(order, key(1, 1)), timeout=60)
            faulty = cache.runners[key(0, 1)]
            builds = faulty.builds()
            assert builds and all(b.exists() for b in builds)
            kept = cache.runners[key(1, 1)].builds()
            await asyncio.wait_for(cache.drop_faulty(key(0, 1)), timeout=30)
            assert list(cache.runners) == [key(1, 1)]
            assert not any(b.exists() or b.parent.exists() for b in builds)  # its build is deleted
            assert all(b.exists() for b in kept)  # another fragment's stays
            with pytest.raises(RunnerError, match="runner is closed"):
                faulty.open_session("late")
            await asyncio.wait_for(cache.drop_faulty(key(0, 1)), timeout=5)  # dropped already: nothing happens

            await asyncio.wait_for(cache.open(order, key(0, 1)), timeout=60)
            assert all(b.exists() for b in cache.runners[key(0, 1)].builds())

    asyncio.run(scenario())


REPAIRS = st.lists(st.fixed_dictionaries({"model": st.sampled_from([TINY, "other"]),
                                          "files": st.lists(st.sampled_from([LAYER_1, "weights/head.safetensors"])),
                                          "fetched_again": st.booleans(),
                                          "found_by": st.sampled_from(["build", "scrub"])}), max_size=20)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> ModelStore:
    tmp = tmp_path_factory.mktemp("repairs")
    store = ModelStore(tmp / "home")
    import_model(write_tiny_checkpoint(tmp / "checkpoint"), name=TINY, store=store, progress=False)
    return store


@settings(max_examples=50, deadline=None)
@given(REPAIRS)
def test_the_latest_repairs_are_kept_in_the_order_found(store, repairs):
    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            client = PeerClient(session, CLUSTER_KEY.encode(), "node-0", None)
            cache = FragmentCache(AgentConfig(cluster_key=CLUSTER_KEY, threads=1), store, client)
            try:
                for repair in repairs:
                    cache.note_repair(repair)
                assert cache.repairs == repairs[-MAX_REPAIRS_KEPT:]
            finally:
                cache.close()

    asyncio.run(scenario())


def test_closing_the_cache_closes_every_runner(tmp_path):
    async def scenario() -> None:
        async with fragment_cache(tmp_path) as (cache, order):
            await asyncio.wait_for(cache.open(order, key(0, 1)), timeout=60)
            runner = cache.runners[key(0, 1)]
            cache.close()
            assert cache.runners == {}
            with pytest.raises(RunnerError, match="runner is closed"):
                runner.open_session("late")
            with pytest.raises(RuntimeError):  # no build starts any more
                await asyncio.wait_for(cache.open(order, key(1, 1)), timeout=30)

    asyncio.run(scenario())

