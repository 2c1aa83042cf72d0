"""The deployer (:mod:`agent.orchestration.deployer`) through its public methods, on two
in-process agents serving copies of the tiny model; node-0, the orchestrator, stores them.
Each test makes a deployer of its own from an agent's real parts (membership, worker, peer
client, store), as the orchestrator makes its own:

- what the cluster holds: the complete models of every live node, where to fetch a model from
  (holders first), the fallback model; a node that lacks a model's manifest fetches it and its
  tokenizer, no weights; only the orchestrator plans and deploys;
- a model is planned over the live nodes with what each device needs (weights, a KV cache at
  full context, the runtime) and refused when the preset asks for other weights or more
  context than the model has;
- the two-step change of plan: every node stages the order, the deployment is published (every
  node has staged it, none serves it yet), then committed everywhere; its progress is followed
  node by node, and the orders are dropped again on request;
- a route through a node no longer alive is refused before anything is staged; a node of the
  route that cannot stage the order aborts it everywhere and is left out of plans, with its
  cause, until it changes;
- the fallback model is spread: a live node that lacks it is asked to hold it whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.cluster import membership as membership_module
from agent.core.errors import ClusterError
from agent.core.plan import LayerRange
from agent.core.presets import ModelPreset, ModelSettings
from agent.core.routing import Hop, Route
from agent.http.app_keys import CLIENT, CONFIG, MEMBERSHIP, NODE_ID, STORE, WORKER
from agent.orchestration.deployer import RUNTIME_OVERHEAD_BYTES, Deployer, Deployment, min_bytes_per_node
from agent.stage.weights import complete_models
from shards.importers.importer import import_model
from shards.store.manifest import Manifest
from shards.store.model_store import ModelStore
from tests.agent.inprocess import LocalAgent, eventually
from tests.agent.tiny import TINY, tiny_cluster
from tests.shards.fragment_helpers import write_tiny_checkpoint

B = "tiny-b"  # stored on node-0 only, not loaded
SPARE = "probe"  # the router's name of what these tests deploy (the router itself knows nothing of it)
# node-1 is the stronger (it holds layers of every plan); no fallback: no node fetches a whole
# copy by itself meanwhile (one test spreads it on purpose).
CAPACITY = [{"orchestrator": True, "vram_gib": 0.0, "ram_gib": 4.0}, {"vram_gib": 8.0, "ram_gib": 4.0}]
CLUSTER: dict[str, Any] = {"names": (TINY, B), "allow_fallback": False, "per_agent": CAPACITY}


def deployer_of(agent: LocalAgent, on_progress: Callable[[str, int, int], None] = lambda *_: None,
                **config: Any) -> Deployer:
    """A deployer on ``agent``'s parts (``config``: settings of its own)."""
    app = agent.app
    settings_ = dataclasses.replace(app[CONFIG], **config) if config else app[CONFIG]
    return Deployer(app[NODE_ID], settings_, app[MEMBERSHIP], app[WORKER], app[CLIENT], app[STORE], on_progress)


def preset(name: str = B, **settings_: Any) -> ModelPreset:
    settings_ = {"max_context": 128, "prefill_chunk": 64, "placement": "split", **settings_}  # the seed's split
    return ModelPreset(name, name, (), ModelSettings(**settings_), "store")


def worker_report(agent: LocalAgent) -> dict[str, Any]:
    return agent.app[WORKER].status()


def plan_versions(agent: LocalAgent) -> list[int]:
    report = worker_report(agent)
    return [o["plan_version"] for o in report["orders"]] + [s["plan_version"] for s in report["staged"].values()]


def test_the_holdings_are_every_live_nodes_complete_models_and_sources_put_holders_first(tmp_path):
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, **CLUSTER) as (leader, (other,)):
            deployer = deployer_of(leader)
            size = sum(f.bytes for f in ModelStore(tmp_path / "home-0").manifest(B).files.values())
            holdings = deployer.holdings()
            # node-1 holds the layers of tiny it serves, not the whole model: nothing it could share whole
            assert holdings == {"node-0": {TINY: size, B: size}, "node-1": {}}
            assert complete_models(ModelStore(tmp_path / "home-1")) == {} and TINY in worker_report(other)["models"]

            address = {n: leader.app[MEMBERSHIP].peer_address_of(n) for n in holdings}
            assert deployer.sources(B, holdings) == [("node-0", address["node-0"]), ("node-1", address["node-1"])]
            assert deployer_of(other).sources(B, holdings)[0] == ("node-0", address["node-0"])  # the holder first
            assert deployer_of(other).sources("elsewhere", holdings)[0] == ("node-1", address["node-1"])  # then itself

            assert deployer.fallback_model(holdings) == TINY  # the smallest held whole ("ncm-tiny"); ties by name
            assert deployer_of(leader, fallback_model=B).fallback_model(holdings) == B
            with pytest.raises(ClusterError, match="no live node holds a whole model"):
                deployer.fallback_model({"node-0": {}, "node-1": {}})

            telemetry = deployer.telemetry({"node-0": 2.0, "node-1": 3.0})
            assert {n: t.capacity_score for n, t in telemetry.items()} == {"node-0": 2.0, "node-1": 3.0}
            assert all(t.latency_ms >= 0 for t in telemetry.values())

    asyncio.run(scenario())


def test_a_node_lacking_a_models_manifest_fetches_it_and_its_tokenizer_and_only_the_orchestrator_plans(tmp_path):
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, **CLUSTER) as (leader, (other,)):
            deployer = deployer_of(other)
            manifest = await asyncio.wait_for(deployer.fetch_manifest(B, deployer.holdings()), timeout=30)
            assert manifest == ModelStore(tmp_path / "home-0").manifest(B)
            model_dir = tmp_path / "home-1" / "models" / B
            assert sorted(p.name for p in model_dir.iterdir() if not p.name.startswith(".")) == [
                "manifest.json", "tokenizer.json", "tokenizer_config.json"]  # no weights

            tokenizer = await asyncio.wait_for(deployer.tokenizer(B), timeout=30)
            assert await asyncio.wait_for(deployer.tokenizer(B), timeout=30) is tokenizer  # read once
            assert tokenizer.encode("w5 w6", add_special_tokens=False) == [5, 6]

            # the orchestrator may plan
            planned = await asyncio.wait_for(deployer_of(leader).plan_model(preset()), timeout=30)
            for attempt in (deployer.plan_model(preset()),
                            deployer.deploy(SPARE, planned.plan, planned.route, B, planned.preset.settings,
                                            degraded=False, holdings=deployer.holdings(), publish=lambda d: None)):
                with pytest.raises(ClusterError, match="this node is no longer the orchestrator"):
                    await attempt
            assert SPARE not in worker_report(leader)["staged"] and SPARE not in worker_report(other)["staged"]

    asyncio.run(scenario())


def test_a_model_is_planned_over_the_live_nodes_with_what_each_device_needs(tmp_path):
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, **CLUSTER) as (leader, _):
            deployer = deployer_of(leader)
            manifest = ModelStore(tmp_path / "home-0").manifest(B)
            planned = await asyncio.wait_for(deployer.plan_model(preset(max_context=128)), timeout=30)
            assert planned.members == {"node-0", "node-1"} and planned.preset == preset(max_context=128)
            assert planned.route.total_layers == planned.plan.total_layers == manifest.n_layers
            for node in planned.route.nodes:
                hops = {(h.layers.first, h.layers.last) for h in planned.route.hops if h.node_id == node}
                assert planned.min_bytes[node] >= min_bytes_per_node(manifest, {node: hops}, 128)[node]
            assert all(need > RUNTIME_OVERHEAD_BYTES for need in planned.min_bytes.values())

            longer = await asyncio.wait_for(deployer.plan_model(preset(max_context=256)), timeout=30)
            assert longer.route == planned.route and set(longer.min_bytes) == set(planned.min_bytes)
            for node, need in planned.min_bytes.items():  # a KV cache of the whole context on each device
                assert (longer.min_bytes[node] - need) % (manifest.kv_bytes_per_token() * 128) == 0
                assert longer.min_bytes[node] - need >= manifest.kv_bytes_per_token() * 128

            with pytest.raises(ClusterError, match=f"the preset of {B} asks for q4 weights but {B} is stored as f32"):
                await asyncio.wait_for(deployer.plan_model(preset(weights="q4")), timeout=30)
            with pytest.raises(ClusterError, match=f"context 512 is beyond what {B} was trained for \\(256\\)"):
                await asyncio.wait_for(deployer.plan_model(preset(max_context=512)), timeout=30)

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Manifest:
    """The manifest of a tiny model of 4 layers."""
    tmp = tmp_path_factory.mktemp("manifest")
    store = ModelStore(tmp / "home")
    import_model(write_tiny_checkpoint(tmp / "checkpoint", layers=4), name=TINY, store=store, progress=False)
    return store.manifest(TINY)


RANGES = st.sets(st.tuples(st.integers(0, 3), st.integers(0, 3)).map(lambda r: (min(r), max(r))), min_size=1,
                 max_size=4)


@settings(max_examples=100, deadline=None)
@given(RANGES, RANGES, st.integers(16, 4096), st.integers(0, 1024))
def test_what_a_node_needs_counts_each_weight_file_once_and_a_kv_cache_of_the_whole_context(
        manifest, ranges, more, context, extra_context):
    # layer files that take more once loaded than on disk (a GGUF file's blocks kept as they are)
    manifest = dataclasses.replace(manifest, files={key: dataclasses.replace(f, memory_bytes=f.bytes * 4 // 3
                                                                             if key.startswith("layer") else 0)
                                                    for key, f in manifest.files.items()})
    need = min_bytes_per_node(manifest, {"a": ranges, "b": ranges | more}, context)
    layers = {layer for a, b in ranges for layer in range(a, b + 1)}
    files = {key for a, b in ranges for key in manifest.fragment_files(a, b)}
    weights = sum(manifest.files[key].loaded_bytes for key in files)
    assert weights > sum(manifest.files[key].bytes for key in files) or not layers
    assert need["a"] == weights + manifest.kv_bytes_per_token(len(layers)) * context \
        + RUNTIME_OVERHEAD_BYTES * len(ranges)
    assert need["a"] <= need["b"]  # more ranges never need less
    assert min_bytes_per_node(manifest, {"a": ranges}, context) == {"a": need["a"]}  # nodes are independent
    longer = min_bytes_per_node(manifest, {"a": ranges}, context + extra_context)["a"]
    assert longer - need["a"] == manifest.kv_bytes_per_token(len(layers)) * extra_context


def test_a_plan_is_staged_on_every_node_published_then_committed_and_dropped_on_request(tmp_path):
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, **CLUSTER) as (leader, (other,)):
            agents = (leader, other)
            progress: list[tuple[str, int, int]] = []
            deployer = deployer_of(leader, lambda *step: progress.append(step))
            newest = max(v for agent in agents for v in plan_versions(agent))
            planned = await asyncio.wait_for(deployer.plan_model(preset()), timeout=30)
            seen_at_publish: list[tuple[bool, bool]] = []
            published: list[Deployment] = []

            def publish(deployment: Deployment) -> None:
                published.append(deployment)
                seen_at_publish.extend((SPARE in worker_report(a)["staged"], SPARE in worker_report(a)["models"])
                                       for a in agents)

            deployment = await asyncio.wait_for(deployer.deploy(
                SPARE, planned.plan, planned.route, B, planned.preset.settings, degraded=False,
                holdings=deployer.holdings(), publish=publish), timeout=60)

            order = deployment.order
            assert published == [deployment] and seen_at_publish == [(True, False), (True, False)]
            assert (deployment.name, order.name, order.model, order.degraded) == (SPARE, SPARE, B, False)
            assert order.plan_version == newest + 1 == deployer.plan_version  # newer than any the workers hold
            assert order.epoch == leader.app[MEMBERSHIP].election.epoch and order.orchestrator == "node-0"
            assert order.weight_sources[0] == "node-0" and set(order.addresses) == {"node-0", "node-1"}
            assert (order.max_context, order.prefill_chunk) == (128, 64) and order.route == planned.route
            assert progress == [(SPARE, 1, 2), (SPARE, 2, 2)]
            assert set(deployment.effective_bytes) == set(planned.route.nodes)
            assert all(b > 0 for b in deployment.effective_bytes.values())
            assert deployment.tokenizer.encode("w7", add_special_tokens=False) == [7]
            for agent in agents:  # committed everywhere
                report = worker_report(agent)
                assert report["staged"] == {} and report["models"][SPARE]["plan_version"] == order.plan_version
            manifest = ModelStore(tmp_path / "home-0").manifest(B)
            needed = {manifest.files[key].path
                      for a, b in order.ranges_for("node-1") for key in manifest.fragment_files(a, b)}
            fetched = {str(p.relative_to(tmp_path / "home-1" / "models" / B))
                       for p in (tmp_path / "home-1" / "models" / B / "weights").iterdir()}
            assert needed and fetched == needed  # node-1 fetched the files of its layers from node-0, no more

            await asyncio.wait_for(deployer.drop_orders(SPARE), timeout=30)
            for agent in agents:
                assert SPARE not in worker_report(agent)["models"] and SPARE not in worker_report(agent)["staged"]
            assert all(TINY in worker_report(agent)["models"] for agent in agents)  # the other model goes on

    asyncio.run(scenario())


def test_a_route_through_a_node_no_longer_alive_is_refused_before_anything_is_staged(tmp_path):
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, **CLUSTER) as (leader, (other,)):
            deployer = deployer_of(leader)
            planned = await asyncio.wait_for(deployer.plan_model(preset()), timeout=30)
            before = [plan_versions(a) for a in (leader, other)]
            gone = Route((Hop("node-1", LayerRange(0, 0)), Hop("node-7", LayerRange(1, 1))))
            with pytest.raises(ClusterError, match=f"the route of {SPARE} goes through node\\(s\\) no longer alive: "
                                                   "node-7"):
                await asyncio.wait_for(deployer.deploy(SPARE, planned.plan, gone, B, planned.preset.settings,
                                                       degraded=False, holdings=deployer.holdings(),
                                                       publish=lambda d: None), timeout=30)
            assert [plan_versions(a) for a in (leader, other)] == before and deployer.plan_version == 0

    asyncio.run(scenario())


def test_a_node_that_cannot_stage_aborts_the_plan_everywhere_and_is_left_out_until_it_changes(tmp_path, monkeypatch):
    # What a node advertises is measured again every CAPACITY_REFRESH_S; its free RAM in whole
    # GiB counts as a change (its latency and load do not): pinned here, so that the node
    # changes only as the test changes it.
    monkeypatch.setattr(membership_module, "CAPACITY_REFRESH_S", 3600.0)

    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, **CLUSTER) as (leader, (other,)):
            blocked = tmp_path / "home-1" / "models" / B / "weights"
            blocked.parent.mkdir(parents=True)
            blocked.write_text("a file where node-1's weights of tiny-b go")
            deployer = deployer_of(leader)
            planned = await asyncio.wait_for(deployer.plan_model(preset()), timeout=30)
            assert "node-1" in planned.route.nodes, "premise: node-1 serves layers of the plan"

            published: list[Deployment] = []
            with pytest.raises(ClusterError) as failed:
                await asyncio.wait_for(deployer.deploy(
                    SPARE, planned.plan, planned.route, B, planned.preset.settings, degraded=False,
                    holdings=deployer.holdings(), publish=published.append), timeout=60)
            version = deployer.plan_version
            message = str(failed.value)
            assert message.startswith(f"node(s) node-1 could not stage plan {version} (stage_failed): ")
            assert "cannot write" in message and published == []
            for agent in (leader, other):  # aborted where it was staged; served nowhere
                assert SPARE not in worker_report(agent)["staged"] and SPARE not in worker_report(agent)["models"]
            fault = deployer.faults["node-1"]
            assert list(deployer.faults) == ["node-1"]
            assert fault.cause == "stage_failed" and "cannot write" in fault.message
            assert worker_report(other)["fault"]["cause"] == "stage_failed"  # the node reports it itself

            again = await asyncio.wait_for(deployer.plan_model(preset()), timeout=30)
            assert again.members == {"node-0"} and again.route.nodes == ("node-0",)  # left out of plans
            assert not deployer.clear_faults(frozenset(("node-0", "node-1")))  # node-1 is as it was
            assert "node-1" in deployer.faults

            # node-1 changes: it frees its store and imports a model (what it holds whole changes)
            blocked.unlink()
            import_model(tmp_path / "checkpoint", name="extra", store=ModelStore(tmp_path / "home-1"), progress=False)
            await eventually(lambda: "extra" in deployer.holdings()["node-1"], timeout_s=10,
                             what="node-1's advert of the new model")
            assert deployer.clear_faults(frozenset(("node-0", "node-1"))) and deployer.faults == {}
            planned = await asyncio.wait_for(deployer.plan_model(preset()), timeout=30)
            assert planned.members == {"node-0", "node-1"}
            deployment = await asyncio.wait_for(deployer.deploy(
                SPARE, planned.plan, planned.route, B, planned.preset.settings, degraded=False,
                holdings=deployer.holdings(), publish=lambda d: None), timeout=60)
            assert worker_report(other)["models"][SPARE]["plan_version"] == deployment.order.plan_version
            assert worker_report(other)["fault"] is None

    asyncio.run(scenario())


def test_a_fault_of_a_node_that_left_is_forgotten(tmp_path):
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, **CLUSTER) as (leader, (other,)):
            blocked = tmp_path / "home-1" / "models" / B / "weights"
            blocked.parent.mkdir(parents=True)
            blocked.write_text("in the way")
            deployer = deployer_of(leader)
            planned = await asyncio.wait_for(deployer.plan_model(preset()), timeout=30)
            with pytest.raises(ClusterError):
                await asyncio.wait_for(deployer.deploy(SPARE, planned.plan, planned.route, B, planned.preset.settings,
                                                       degraded=False, holdings=deployer.holdings(),
                                                       publish=lambda d: None), timeout=60)
            assert list(deployer.faults) == ["node-1"]
            assert not deployer.clear_faults(frozenset(("node-0",)))  # it left: no live node may be planned again
            assert deployer.faults == {}

    asyncio.run(scenario())


def test_the_fallback_model_is_spread_to_the_live_nodes_that_lack_it(tmp_path):
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, **CLUSTER) as (leader, (other,)):
            home = ModelStore(tmp_path / "home-1")
            assert B not in complete_models(home)
            await asyncio.wait_for(deployer_of(leader, fallback_model=B).spread_fallback(), timeout=30)  # off
            nobody_has_it = deployer_of(leader, allow_fallback=True, fallback_model="ghost")
            await asyncio.wait_for(nobody_has_it.spread_fallback(), timeout=30)
            assert worker_report(other)["copying"] is None and not (home.models_dir / B).exists()

            deployer = deployer_of(leader, allow_fallback=True, fallback_model=B)
            await asyncio.wait_for(deployer.spread_fallback(), timeout=30)
            await eventually(lambda: B in complete_models(home), timeout_s=20, what="node-1 holding the fallback whole")
            manifest = home.manifest(B)
            assert manifest == ModelStore(tmp_path / "home-0").manifest(B)
            await eventually(lambda: B in deployer.holdings()["node-1"], timeout_s=10,
                             what="node-1's advert of its whole copy")

    asyncio.run(scenario())
