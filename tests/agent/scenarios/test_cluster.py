"""Three real agent processes on loopback serving the default model together."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time

import pytest

from agent.core.auth import sign
from agent.core.plan import make_plan
from shards.runtime.generate import LocalModel, generate
from shards.runtime.sampling import SamplingParams
from tests.agent.agents import (
    ADMIN,
    CLUSTER_KEY,
    REPO,
    cluster_ready,
    free_ports,
    http,
    linked_copy,
    make_agents,
    member_tls,
    shut_down,
    wait_for,
)
from tests.agent.impostor import NODE_ID as IMPOSTOR_ID
from tests.agent.impostor import SEEN_PATH

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence, then name two museums there."}]


@pytest.fixture(scope="module")
def cluster(smollm2_store, tmp_path_factory):
    agents = make_agents(tmp_path_factory.mktemp("cluster"), smollm2_store.root, 3)
    try:
        wait_for(lambda: cluster_ready(agents[0], 3) or cluster_ready(agents[1], 3), timeout_s=300,
                 what="the 3-agent cluster to serve the model")
        yield agents
    finally:
        shut_down(agents, keep_store=smollm2_store.root)


def test_every_agent_sees_one_orchestrator(cluster):
    views = [agent.get("/cluster/nodes")[1] for agent in cluster]
    orchestrators = {view["orchestrator"] for view in views}
    assert len(orchestrators) == 1 and None not in orchestrators
    ids = {view["node_id"] for view in views}
    assert orchestrators <= ids
    for view in views:
        assert sum(1 for node in view["nodes"] if node["alive"]) == 3


def test_cluster_answer_is_token_for_token_the_single_device_answer(cluster, smollm2_store):
    status, body = cluster[0].post("/v1/chat/completions", {"messages": QUESTION, "temperature": 0, "max_tokens": 48})
    assert status == 200, body
    model = LocalModel.open("smollm2-135m", store=smollm2_store)
    try:
        ids = model.tokenizer.encode_chat(QUESTION, add_generation_prompt=True)
        events = list(generate(model.runners, model.tokenizer, ids, SamplingParams(temperature=0.0, max_tokens=48)))
    finally:
        model.close()
    reference = "".join(event.text for event in events)
    assert body["choices"][0]["message"]["content"] == reference
    assert body["usage"]["completion_tokens"] == events[-1].usage.completion_tokens
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert "Paris" in reference


def test_any_agent_accepts_requests_and_streams(cluster):
    answers = []
    for agent in cluster:
        status, body = agent.post("/v1/chat/completions", {"messages": QUESTION, "temperature": 0, "max_tokens": 12})
        assert status == 200, body
        answers.append(body["choices"][0]["message"]["content"])
    assert len(set(answers)) == 1
    status, text = http("POST", cluster[2].url + "/v1/chat/completions",
                        {"messages": QUESTION, "temperature": 0, "max_tokens": 12, "stream": True})
    assert status == 200
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1] if json.loads(e)["choices"])
    assert streamed == answers[0]


def test_plan_held_by_workers_is_the_planning_core_plan(cluster):
    orchestrator_id = cluster[0].get("/cluster/nodes")[1]["orchestrator"]
    status, plan = cluster[1].get("/cluster/plan")
    assert status == 200, plan
    scores = {node["id"]: node["score"] for node in plan["plan"]["nodes"]}
    expected = make_plan(scores, 30)
    assert plan["plan"] == json.loads(json.dumps(expected.to_dict()))
    assert plan["uncovered_layers"] == []
    # What each worker actually holds is its hops of the route.
    for agent in cluster:
        nodes = agent.get("/cluster/nodes")[1]
        me = next(node for node in nodes["nodes"] if node["self"])
        held = [f["layers"] for f in me["worker"]["fragments"]]
        assert held == [hop["layers"] for hop in plan["route"] if hop["node"] == me["id"]]
    assert orchestrator_id in scores


def test_bad_requests_get_4xx_and_the_cluster_keeps_serving(cluster):
    url = cluster[1].url + "/v1/chat/completions"
    cases = [
        (b"{not json", 400, None),
        (json.dumps({"messages": []}).encode(), 400, "messages"),
        (json.dumps({"messages": QUESTION, "temperature": 7}).encode(), 400, "temperature"),
        (json.dumps({"messages": QUESTION, "n": 3}).encode(), 400, "n"),
        (json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(), 400, "messages[0].role"),
        (json.dumps({"model": "gpt-9", "messages": QUESTION}).encode(), 404, "model"),
        (json.dumps({"messages": QUESTION, "max_tokens": -1}).encode(), 400, "max_tokens"),
    ]
    for raw, expected_status, param in cases:
        status, body = http("POST", url, raw=raw)
        assert status == expected_status, (raw, body)
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["param"] == param
    status, body = http("POST", url, raw=json.dumps({"model": "gpt-9", "messages": QUESTION}).encode())
    assert "smollm2-135m" in body["error"]["message"]
    status, body = cluster[0].post("/v1/chat/completions", {"messages": QUESTION, "temperature": 0, "max_tokens": 4})
    assert status == 200 and body["choices"][0]["message"]["content"]


def test_sessions_are_freed_on_every_stage_after_a_request(cluster):
    cluster[0].post("/v1/chat/completions", {"messages": QUESTION, "temperature": 0, "max_tokens": 4})

    def all_free():
        nodes = cluster[0].get("/cluster/nodes")[1]["nodes"]
        return all(node["worker"] and node["worker"]["sessions"] == 0 for node in nodes if node["alive"])

    wait_for(all_free, timeout_s=10, what="every stage to free the request's KV cache")


def _describe(agent, headers, tls):
    return http("POST", agent.peer_url() + "/internal/describe", raw=b"{}", headers=headers, timeout_s=5, tls=tls)


def test_internal_endpoints_need_the_cluster_key_and_reject_replays(cluster, tmp_path):
    agent, other = cluster[0], cluster[1]
    tls = member_tls(tmp_path)
    status, body = _describe(agent, {}, tls)
    assert status == 401 and "cluster key" in body["error"]["message"]

    def signed(key=CLUSTER_KEY.encode(), now=None, target="*"):
        return sign(key, "POST", "/internal/describe", b"{}", now=time.time() if now is None else now,
                    nonce=secrets.token_hex(12), node_id="tester", target=target)

    assert _describe(agent, signed(key=b"not-the-cluster-key-at-all"), tls)[0] == 401
    assert _describe(agent, signed(now=time.time() - 3600), tls)[0] == 401
    good = signed(target=agent.node_id())
    status, body = _describe(agent, good, tls)
    assert status == 200 and body["advert"]["cluster"] == "test"
    assert "cluster_key" not in json.dumps(body) and CLUSTER_KEY not in json.dumps(body)
    status, body = _describe(agent, good, tls)  # the very same signed request again
    assert status == 401 and "replay" in body["error"]["message"]
    status, body = _describe(other, good, tls)  # ... or sent to another node
    assert status == 401 and "addressed to node" in body["error"]["message"]
    # Routing orders too: unsigned ones never reach the worker.
    status, _ = http("POST", agent.peer_url() + "/internal/routing", {"epoch": 99}, timeout_s=5, tls=tls)
    assert status == 401
    # And the public port serves no internal endpoint at all.
    status, body = http("POST", agent.url + "/internal/describe", raw=b"{}", headers=good, timeout_s=5)
    assert status == 403 and body["error"]["code"] == "peer_port_only"


def test_a_stranger_joined_without_credentials_takes_nothing_over(cluster, tmp_path):
    """The takeover that worked before answers were signed: a keyless server that claims to
    be a newer orchestrator is joined through the public API of one node. No node follows it,
    contacts it again or forwards a prompt to it, and every node answers as before."""
    port, peer_port = free_ports(2)
    impostor = subprocess.Popen([sys.executable, "-m", "tests.agent.impostor", "--port", str(port), "--peer-port",
                                 str(peer_port), "--host", "127.0.0.1", "--cluster", "test"], cwd=REPO)
    impostor_url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http("GET", impostor_url + SEEN_PATH, timeout_s=2)[0] == 200, timeout_s=30,
                 what="the impostor to listen")
        orchestrator = cluster[0].get("/cluster/nodes")[1]["orchestrator"]
        before = cluster[0].post("/v1/chat/completions", {"messages": QUESTION, "temperature": 0,
                                                          "max_tokens": 12})[1]["choices"][0]["message"]["content"]
        # Without the admin token the public API does not even take the URL; with it (an
        # operator fooled into pasting a stranger's address) the stranger still gets nothing.
        status, body = cluster[1].post("/cluster/join", {"url": impostor_url})
        assert status == 401 and body["error"]["code"] == "admin_token_required"
        assert cluster[1].post("/cluster/join", {"url": impostor_url}, headers=ADMIN)[0] == 200
        wait_for(lambda: impostor_url in [r["url"] for r in cluster[1].get("/cluster/nodes")[1]["rejected"]],
                 timeout_s=30, what="the impostor to be rejected")
        for agent in cluster:
            for _ in range(3):
                status, body = agent.post("/v1/chat/completions", {"messages": QUESTION, "temperature": 0,
                                                                   "max_tokens": 12})
                assert status == 200 and body["choices"][0]["message"]["content"] == before
            view = agent.get("/cluster/nodes")[1]
            assert view["orchestrator"] == orchestrator
            assert IMPOSTOR_ID not in [node["id"] for node in view["nodes"]]
        _, seen = http("GET", impostor_url + SEEN_PATH, timeout_s=5)
        # Its public health check, then a TLS handshake that failed on its certificate: nothing else.
        assert [(s["method"], s["path"]) for s in seen] == [("GET", "/health")]
    finally:
        impostor.terminate()
        impostor.wait(timeout=10)


def test_the_official_openai_client_gets_answers_streams_and_clear_errors(cluster):
    import openai

    client = openai.OpenAI(base_url=cluster[1].url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert "smollm2-135m" in [model.id for model in client.models.list()]

    chat = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=16, temperature=0)
    assert chat.model == "smollm2-135m" and chat.choices[0].finish_reason in ("stop", "length")
    assert 0 < chat.usage.completion_tokens <= 16 and "Paris" in chat.choices[0].message.content

    pieces, usage = [], None
    for chunk in client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=16, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        pieces += [choice.delta.content or "" for choice in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == chat.choices[0].message.content  # greedy: the same answer streamed
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens
    assert usage.prompt_tokens == chat.usage.prompt_tokens

    text = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=12,
                                     temperature=0, stop=["\n"])
    assert text.choices[0].finish_reason in ("stop", "length") and "\n" not in text.choices[0].text
    seeded = [client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=8, temperature=0.9,
                                             top_p=0.9, seed=7).choices[0].message.content for _ in range(2)]
    assert seeded[0] == seeded[1]

    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert "smollm2-135m" in unknown.value.message  # the error lists the models there are
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=-1)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2-135m", messages=QUESTION, n=2)


def test_an_agent_sweeps_stale_fragment_builds_when_it_starts(smollm2_store, tmp_path):
    home = linked_copy(smollm2_store.root, tmp_path / "home")
    cache = home / "models" / "smollm2-135m" / "fragments"
    older = cache / "smollm2-135m-000-001-cpu-c32-p0-0123456789abcdef0123"
    older.mkdir(parents=True)
    (older / "fragment.json").write_text(json.dumps({"key": "0123", "weight_bytes": 1}))  # no builder: older
    abandoned = cache / ".tmp-frag-crashed"
    abandoned.mkdir()
    os.utime(abandoned, (0, 0))
    agent = make_agents(tmp_path, home, 1)[0]
    try:
        wait_for(lambda: agent.node_id(), timeout_s=60, what="the agent to start")
        assert not older.exists() and not abandoned.exists()
    finally:
        shut_down([agent])


def test_prompts_and_answers_cross_internal_links_only_encrypted(cluster):
    """A capture of the loopback interface during a request that enters at a worker: the
    prompt and the answer appear in clear only between the client and that agent's public
    port; every hop between agents (the request passed on, routing, activations) is TLS."""
    if os.geteuid() != 0:
        pytest.skip("capturing packets needs root")
    from tests.agent.sniff import LoopbackCapture

    orchestrator = cluster[0].get("/cluster/nodes")[1]["orchestrator"]
    entry = next(agent for agent in cluster if agent.node_id() != orchestrator)
    marker = f"zebra{secrets.token_hex(4)}"
    question = [{"role": "user", "content": f"Repeat this word exactly: {marker}"}]
    with LoopbackCapture() as capture:
        status, body = entry.post("/v1/chat/completions", {"messages": question, "temperature": 0, "max_tokens": 24})
    assert status == 200, body
    answer = body["choices"][0]["message"]["content"]
    client_side = {p for s, d, _ in capture.segments if entry.port in (s, d) for p in (s, d)}
    assert entry.port in capture.ports_carrying(marker.encode())  # the capture sees the client's request
    assert capture.ports_carrying(marker.encode()) <= client_side
    if len(answer) >= 8:
        assert capture.ports_carrying(answer.encode()) <= client_side
    peer_ports = {int(agent.peer_url().rsplit(":", 1)[1]) for agent in cluster}
    assert any(peer_ports & {s, d} for s, d, _ in capture.segments)  # the agents did talk, over TLS
