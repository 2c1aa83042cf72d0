"""What a node's accelerators are credited with decides its share of the plan, on in-process
agents serving the tiny model (8 layers).

node-1 is found on a board whose table entry gives its NPU 6 TOPS (the RK3588's; the detection
of the board is the one thing stood in for, as no such board is here). Both agents have a
configured memory budget, node-0 the larger: with the table's 6 TOPS node-1 would be the
strongest, without them node-0 is.

- With no backend that runs on its NPU, node-1 is credited 0 TOPS and gets the smaller share.
- With the operator's word for the same 6 TOPS (``npu_tops``) it gets the larger one: the plan
  does follow the credited figure.
- With the RKNN simulator as its NPU backend (rknn-toolkit2's, in the converter environment)
  it is credited what that backend measured, never more than the table, and its fragment runs
  there.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agent.cluster import membership
from agent.core.npu_table import npu_tops_for
from agent.local.probe import detect_capacity
from shards.providers.rknn import has_converter
from tests.agent.inprocess import LocalAgent, call, eventually
from tests.agent.tiny import TINY, tiny_cluster

LAYERS = 8
BOARD = ["Radxa ROCK 5B", "radxa,rock-5b rockchip,rk3588"]  # /proc/device-tree/model, compatible
TABLE_TOPS, _ = npu_tops_for(BOARD)
MEMORY = [{"orchestrator": True, "ram_gib": 4.0}, {"ram_gib": 3.0}]
RKNN_PROBE_S = 240  # the RKNN simulator's self-test and calibration, its first start on a fresh machine included


@pytest.fixture
def node_1_on_an_rk3588(monkeypatch):
    """node-1's detection finds the board above (its NPU in the board table); node-0's finds
    this machine as it is."""
    def detect(node_id: str, **kwargs: Any):
        found = detect_capacity(node_id, **kwargs)
        if node_id != "node-1":
            return found
        return type(found).from_dict({**found.to_dict(), "npu_tops": npu_tops_for(BOARD)[0]})

    assert TABLE_TOPS == 6.0
    monkeypatch.setattr(membership, "detect_capacity", detect)


async def self_view(agent: LocalAgent) -> dict[str, Any]:
    status, body = await call("GET", agent.url + "/cluster/nodes")
    assert status == 200, body
    return next(node for node in body["nodes"] if node["self"])


async def layer_counts(orchestrator: LocalAgent) -> dict[str, int]:
    """The primary layers of each node in the deployed plan (replicas of the head left out),
    once both nodes are in it."""
    async def deployed() -> dict[str, int] | None:
        status, body = await call("GET", orchestrator.url + "/cluster/plan")
        if status != 200 or len(body["plan"]["nodes"]) < 2:
            return None
        return {node["id"]: node["primary"][1] - node["primary"][0] + 1 for node in body["plan"]["nodes"]}
    return await eventually(deployed, timeout_s=20, what="a plan over both nodes")


def run_cluster(tmp_path, per_agent: list[dict[str, Any]], check) -> None:
    # node-1's first round waits for its backends' self-tests and calibration: with rknn-sim,
    # the simulator's start (its toolkit's first import on a fresh machine takes most of a minute)
    probing = any(agent.get("providers") for agent in per_agent)

    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, layers=LAYERS, per_agent=per_agent,
                                election_timeout_s=RKNN_PROBE_S if probing else 20) as (orchestrator, others):
            agents = {a.node_id: a for a in [orchestrator, *others]}
            await check(orchestrator, agents)
    asyncio.run(scenario())


def test_an_npu_without_a_backend_is_credited_nothing_and_gets_the_smaller_share(tmp_path, node_1_on_an_rk3588):
    async def check(orchestrator: LocalAgent, agents: dict[str, LocalAgent]) -> None:
        node_1 = await self_view(agents["node-1"])
        assert node_1["detected"]["npu_tops"] == TABLE_TOPS  # found, ...
        assert node_1["capacity"]["npu_tops"] == 0.0  # ... but nothing runs on it
        assert node_1["accelerators"]["usable"] == ["cpu"]
        counts = await layer_counts(orchestrator)
        assert counts["node-0"] > counts["node-1"], counts
    run_cluster(tmp_path, MEMORY, check)


def test_the_operators_word_for_the_same_tops_gives_the_npu_node_the_larger_share(tmp_path, node_1_on_an_rk3588):
    async def check(orchestrator: LocalAgent, agents: dict[str, LocalAgent]) -> None:
        assert (await self_view(agents["node-1"]))["capacity"]["npu_tops"] == TABLE_TOPS
        counts = await layer_counts(orchestrator)
        assert counts["node-1"] > counts["node-0"], counts
    run_cluster(tmp_path, [MEMORY[0], {**MEMORY[1], "npu_tops": TABLE_TOPS}], check)


@pytest.mark.slow
@pytest.mark.skipif(not has_converter(), reason="no RKNN converter environment (rknn-toolkit2): "
                                                 "`./dev test` makes .venv-rknn")
def test_an_npu_backend_is_credited_what_it_measured_and_runs_the_nodes_fragment(tmp_path, node_1_on_an_rk3588):
    async def check(orchestrator: LocalAgent, agents: dict[str, LocalAgent]) -> None:
        async def calibrated() -> dict[str, Any] | None:
            view = await self_view(agents["node-1"])
            return view if view["accelerators"]["usable"][0] == "rknn-sim" else None
        node_1 = await eventually(calibrated, timeout_s=120, what="node-1's RKNN self-test and calibration")
        measured = node_1["accelerators"]["measured"][0]
        assert measured["backend"] == "rknn-sim" and measured["tops"] > 0
        credited = (await self_view(agents["node-1"]))["capacity"]["npu_tops"]
        assert credited == pytest.approx(min(measured["tops"], TABLE_TOPS), abs=1e-4)  # shown to 4 places
        counts = await layer_counts(orchestrator)
        assert counts["node-0"] > counts["node-1"], counts  # a simulator measures far below 6 TOPS

        async def on_the_npu() -> bool:
            fragments = (await self_view(agents["node-1"]))["worker"]["fragments"]
            return bool(fragments) and all(f["backend"] == "rknn-sim" for f in fragments)
        await eventually(on_the_npu, timeout_s=300, what="node-1's fragment converted and loaded on RKNN")
        status, body = await call("POST", orchestrator.url + "/v1/completions", {
            "model": TINY, "prompt": "w1 w2 w3", "max_tokens": 4, "temperature": 0}, timeout_s=120)
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
    run_cluster(tmp_path, [MEMORY[0], {**MEMORY[1], "providers": ("rknn-sim",)}], check)
