"""A cluster with a node whose fragments run on OpenVINO (its CPU device, through the real
OpenVINO runtime in the `.venv-openvino` environment) answers as one device does, and says
where each fragment runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shards.runtime.generate import LocalModel
from tests.agent.agents import cluster_ready, make_agents, shut_down, wait_for

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_a_plan_over_an_openvino_node_gives_the_single_device_text(smollm2_store, tmp_path):
    python = os.environ.get("NCM_OPENVINO_PYTHON", "")
    if not python or not Path(python).exists():
        pytest.skip("no OpenVINO environment (NCM_OPENVINO_PYTHON; `./dev test` makes .venv-openvino)")
    agents = make_agents(tmp_path, smollm2_store.root, 2, start=False)
    agents[1].python = python
    agents[1].env["NCM_PROVIDERS"] = "OpenVINOExecutionProvider"
    for agent in agents:
        agent.start([f"--peer={other.url}" for other in agents if other is not agent])
    try:
        def both_serve():  # the OpenVINO node may start after the first plan: wait for the re-plan over both
            status = cluster_ready(agents[0], 2) or cluster_ready(agents[1], 2)
            return status and len({hop["node"] for hop in status["route"]}) == 2
        wait_for(both_serve, timeout_s=300, what="the 2-agent cluster to serve with a stage on each node")
        status, body = agents[0].post("/v1/chat/completions", {"messages": QUESTION, "temperature": 0, "max_tokens": 24})
        assert status == 200, body
        with LocalModel.open("smollm2-135m", store=smollm2_store) as model:
            assert body["choices"][0]["message"]["content"] == model.greedy_chat(QUESTION, 24)
        _, nodes = agents[0].get("/cluster/nodes")
        fragments = {node["id"]: node["worker"]["fragments"] for node in nodes["nodes"] if node["worker"]}
        ov_node, cpu_node = agents[1].node_id(), agents[0].node_id()
        assert fragments[ov_node] and fragments[cpu_node]
        assert {(f["backend"], f["provider"], f["options"].get("device_type")) for f in fragments[ov_node]} == {
            ("openvino-cpu", "OpenVINOExecutionProvider", "CPU")}
        assert {f["backend"] for f in fragments[cpu_node]} == {"cpu"}
        # What the capacity was credited from: the backends that passed their self-tests, and why
        # OpenVINO's NPU and GPU are not among them on this machine.
        accelerators = {node["id"]: node["accelerators"] for node in nodes["nodes"]}
        assert accelerators[ov_node]["usable"] == ["openvino-cpu", "cpu"]
        assert {u["backend"] for u in accelerators[ov_node]["unusable"]} >= {"openvino-npu", "openvino-gpu"}
        assert accelerators[cpu_node]["usable"] == ["cpu"]
        measured = accelerators[ov_node]["measured"][0]
        assert measured["backend"] == "openvino-cpu" and measured["tops"] > 0 and measured["decode_ms"] > 0
        assert all(node["detected"] is not None for node in nodes["nodes"])
    finally:
        shut_down(agents, keep_store=smollm2_store.root)
