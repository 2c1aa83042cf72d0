"""The model router on a real 3-agent cluster with three small models where only two fit.

The models are copies of the q4 SmolLM2 under three names. Every agent has the same memory
budget (``ram_gib``, no external use counted) and NPU figures that pin the plan: agent-0 is
the strongest, so it holds the embedding and most layers of every model, and it is the device
where a third model does not fit. The budget is checked against the measured need in the
test itself, so the premise cannot drift silently.

The rough edges of the router (presets without weights, what a failed load shows, refusals,
the order of states) are checked at the end on in-process agents serving a tiny random model.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from agent.http.app_keys import ROUTER
from tests.agent.agents import ADMIN, FALLBACK, REPO, Agent, ModelEvents, linked_copy, make_agents, shut_down, wait_for
from tests.agent.inprocess import SseEvents, call, eventually
from tests.agent.models.test_admission_gate import Gate, complete
from tests.agent.tiny import TINY, tiny_cluster

pytestmark = pytest.mark.slow
MODELS = ("alpha", "beta", "gamma")
BUDGET_GIB = 0.4
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PRESETS = """
[*]
context = 1024
prefill-chunk = 128

[alpha]
aliases = a, first

[beta]
context = 512

[gamma]
context = 4096

[chat]
model = gamma
aliases = assistant
"""
ROUTER_ENV = {"NCM_VRAM_GIB": "0", "NCM_RAM_GIB": str(BUDGET_GIB), "NCM_REPLICATE_HEAD_RATIO": "0",
              "NCM_MODELS_MEMORY_MARGIN_MIB": "0", "NCM_MODEL": "alpha", "NCM_PREFILL_CHUNK": "64",
              "NCM_REPLAN_MIN_INTERVAL_S": "600",
              # fifty requests at once for one model all wait their turn; this test process is one
              # client, given the whole model (by default a client gets all slots but one, half the queue)
              "NCM_MAX_QUEUED_REQUESTS": "64", "NCM_MAX_QUEUED_REQUESTS_PER_CLIENT": "64",
              "NCM_MAX_REQUESTS_IN_FLIGHT_PER_CLIENT": "4"}
NPU_TOPS = ("100", "30", "0")


def copy_model(source: Path, target: Path) -> None:
    """The model in ``source`` under the name of ``target``: weights hard-linked, manifest renamed."""
    for path in source.rglob("*"):
        if path.is_file() and path.name != "manifest.json" and "fragments" not in path.relative_to(source).parts:
            (target / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target / path.relative_to(source))
    manifest = json.loads((source / "manifest.json").read_text())
    manifest["name"] = target.name
    (target / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def cluster(full_store, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    models_dir = tmp / "models-source" / "models"
    models_dir.mkdir(parents=True)
    for name in MODELS:
        copy_model(full_store.models_dir / FALLBACK, models_dir / name)
    presets = tmp / "models.ini"
    presets.write_text(PRESETS)
    homes = [linked_copy(models_dir.parent, tmp / f"home-{i}") for i in range(3)]
    agents = make_agents(tmp, homes, 3, extra_env={**ROUTER_ENV, "NCM_MODELS_PRESET": str(presets)}, start=False)
    for index, agent in enumerate(agents):
        agent.env["NCM_NPU_TOPS"] = NPU_TOPS[index]
    agents[0].env["NCM_ORCHESTRATOR"] = "true"
    try:
        for agent in agents:
            agent.start([f"--peer={other.url}" for other in agents if other is not agent])
        wait_for(lambda: state_of(agents[0], "alpha") == "ready" and len(agents[0].get("/cluster/status")[1].get("nodes_alive", [])) == 3,
                 timeout_s=300, what="alpha loaded at start")
        yield agents, presets
    finally:
        shut_down(agents, log_chars=6000)
        shutil.rmtree(models_dir.parent, ignore_errors=True)


def models_of(agent: Agent, query: str = "") -> dict[str, dict]:
    status, body = agent.get("/models" + query, headers=ADMIN if "reload" in query else None)
    assert status == 200, body
    return {m["id"]: m for m in body["data"]}


def state_of(agent: Agent, name: str) -> str | None:
    status, body = agent.get("/models")
    return {m["id"]: m["state"] for m in body["data"]}.get(name) if status == 200 else None


def ask(agent: Agent, model: str, max_tokens: int = 2) -> tuple[int, dict]:
    return agent.post("/v1/chat/completions", {"model": model, "messages": QUESTION, "max_tokens": max_tokens,
                                               "temperature": 0}, timeout_s=300)


def unload_all(agent: Agent) -> None:
    for name, info in models_of(agent).items():
        if info["state"] not in ("unloaded", "failed"):
            status, body = agent.post("/models/unload", {"model": name}, headers=ADMIN)
            assert status == 200, body


class LongStream:
    """A streamed request that keeps its model busy until it ends."""

    def __init__(self, agent: Agent, model: str, max_tokens: int = 160) -> None:
        self.started = threading.Event()
        self.result: tuple[int, list[str]] | None = None
        self.thread = threading.Thread(target=self._run, args=(agent, model, max_tokens), daemon=True)
        self.thread.start()
        assert self.started.wait(120), "the stream never started"

    def _run(self, agent: Agent, model: str, max_tokens: int) -> None:
        import urllib.request

        body = json.dumps({"model": model, "messages": QUESTION, "max_tokens": max_tokens, "stream": True,
                           "temperature": 0.8, "seed": 1, "stop": []}).encode()
        request = urllib.request.Request(agent.url + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        lines: list[str] = []
        with urllib.request.urlopen(request, timeout=300) as response:
            for raw in response:
                if raw.startswith(b"data: "):
                    lines.append(raw.decode().strip())
                    self.started.set()
            self.result = (response.status, lines)

    def join(self) -> tuple[int, list[str]]:
        self.thread.join(300)
        assert self.result is not None, "the stream broke"
        return self.result


def test_presets_and_aliases_take_effect_in_the_documented_order(cluster):
    agents, presets = cluster
    models = models_of(agents[1])  # any agent answers: this one asks the orchestrator
    assert set(models) == {*MODELS, "chat"}
    alpha, beta, gamma, chat = (models[n]["settings"] for n in ("alpha", "beta", "gamma", "chat"))
    assert alpha["max_context"] == 1024 and chat["max_context"] == 1024  # [*] over the model default (2048)
    assert beta["max_context"] == 512 and gamma["max_context"] == 4096  # the model's section over [*]
    assert all(s["prefill_chunk"] == 64 for s in (alpha, beta, gamma, chat))  # the agent's setting over [*]
    assert alpha["load_on_startup"] and not beta["load_on_startup"]  # the agent's main model
    assert models["chat"]["store_model"] == "gamma" and models["chat"]["aliases"] == ["assistant"]
    assert models["alpha"]["aliases"] == ["a", "first"]

    status, body = ask(agents[2], "first")  # an alias resolves to its model
    assert status == 200 and body["model"] == "alpha", body
    status, body = ask(agents[2], "nope")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert "alpha" in body["error"]["message"] and "chat" in body["error"]["message"]

    presets.write_text(PRESETS + "\n[delta]\nmodel = beta\n")
    assert "delta" not in models_of(agents[0])
    reloaded = models_of(agents[0], "?reload=1")
    assert reloaded["delta"]["state"] == "unloaded"  # listed, not loaded
    assert {n for n, m in reloaded.items() if m["state"] != "unloaded"} <= {"alpha"}

    status, body = agents[0].get("/v1/models")
    assert status == 200 and {m["id"] for m in body["data"]} == {*MODELS, "chat", "delta"}


def test_fifty_requests_for_an_unloaded_model_cause_one_load(cluster):
    agents, _ = cluster
    unload_all(agents[0])
    events = ModelEvents(agents[0])
    try:
        with ThreadPoolExecutor(50) as pool:
            answers = list(pool.map(lambda i: ask(agents[i % 3], "beta"), range(50)))
        assert all(status == 200 and body["model"] == "beta" for status, body in answers), answers[:3]
        states = [e["state"] for e in events.events if e["model"] == "beta"]
        entered = [b for a, b in zip(states, states[1:]) if a != b]  # progress events repeat a state
        assert entered.count("measuring") == 1 and entered.count("loading") == 1, states
        assert models_of(agents[0])["beta"]["state"] == "ready"
    finally:
        events.close()


def test_a_third_model_evicts_the_idle_lru_never_the_busy_one(cluster):
    agents, _ = cluster
    unload_all(agents[0])
    assert ask(agents[0], "beta")[0] == 200  # beta: used first (the least recently used)
    assert ask(agents[0], "alpha")[0] == 200  # alpha: used last, idle
    models = models_of(agents[0])
    node = agents[0].node_id()
    budget = BUDGET_GIB * 2**30
    held = sum(models[n]["memory"]["effective_bytes"][node] for n in ("alpha", "beta"))
    assert held <= budget, f"premise: alpha and beta fit on {node[:8]} ({held} bytes)"

    events = ModelEvents(agents[0])
    try:
        busy = LongStream(agents[1], "beta")  # beta is busy: it must not be the victim
        status, body = ask(agents[2], "gamma")
        assert status == 200 and body["model"] == "gamma", body
        need = models_of(agents[0])["gamma"]["memory"]["min_bytes"][node]
        assert held + need > budget, f"premise: gamma does not fit next to alpha and beta ({held} + {need})"
        evicted = events.wait(lambda e: e["model"] == "alpha" and e["state"] == "unloaded", what="alpha evicted")
        assert evicted["detail"] == "evicted for gamma"
        assert not any(e["model"] == "beta" and e["state"] != "ready" for e in events.events)
        status, lines = busy.join()
        assert status == 200 and lines[-1] == "data: [DONE]"  # the busy model's stream was never cut

        # Both loaded models busy: a fourth load has nothing to evict and is refused clearly.
        first, second = LongStream(agents[1], "beta"), LongStream(agents[2], "gamma")
        status, body = ask(agents[0], "alpha")
        assert status == 503 and body["error"]["code"] == "model_capacity", body
        assert "retry later" in body["error"]["message"]
        first.join(), second.join()
    finally:
        events.close()
    models = models_of(agents[0])
    assert {n for n, m in models.items() if m["state"] == "ready"} == {"beta", "gamma"}


def test_autoload_off_and_management_endpoints(cluster):
    agents, _ = cluster
    unload_all(agents[0])
    status, body = agents[1].post("/v1/chat/completions?autoload=false",
                                  {"model": "beta", "messages": QUESTION, "max_tokens": 2})
    assert status == 400 and body["error"]["code"] == "model_not_loaded", body
    for path in ("/models/load", "/models/unload"):  # changing the cluster needs the admin token
        status, body = agents[1].post(path, {"model": "a"})
        assert status == 401 and body["error"]["code"] == "admin_token_required", body
    status, body = agents[1].post("/models/load", {"model": "a"}, headers=ADMIN)
    assert status == 200 and body["model"]["id"] == "alpha" and body["model"]["state"] == "ready"
    status, body = agents[1].post("/v1/chat/completions?autoload=false",
                                  {"model": "alpha", "messages": QUESTION, "max_tokens": 2})
    assert status == 200, body
    status, body = agents[1].post("/models/unload", {"model": "alpha"}, headers=ADMIN)
    assert status == 200 and body["model"]["state"] == "unloaded"
    status, body = agents[1].post("/models/load", {"modle": "alpha"}, headers=ADMIN)
    assert status == 400 and body["error"]["param"] == "model"


def test_an_idle_model_sleeps_and_the_next_request_wakes_it_on_the_same_plan(cluster):
    agents, presets = cluster
    unload_all(agents[0])
    presets.write_text(PRESETS.replace("[chat]\n", "[chat]\nsleep-idle-seconds = 1\n"))
    assert models_of(agents[0], "?reload=1")["chat"]["settings"]["sleep_idle_s"] == 1.0
    events = ModelEvents(agents[0])
    try:
        status, body = ask(agents[0], "assistant")
        assert status == 200 and body["model"] == "chat", body
        route = agents[0].get("/cluster/status")[1]["models"]["chat"]["route"]
        events.wait(lambda e: e["model"] == "chat" and e["state"] == "sleeping", timeout_s=30, what="chat asleep")

        def released() -> bool:
            nodes = agents[0].get("/cluster/nodes")[1]["nodes"]
            return all("chat" not in ((n["worker"] or {}).get("models") or {}) for n in nodes if n["alive"])
        wait_for(released, timeout_s=30, what="every worker to free chat's fragments")
        assert models_of(agents[0])["chat"]["memory"]["effective_bytes"] == {}

        status, body = ask(agents[1], "chat")  # wakes it
        assert status == 200 and body["model"] == "chat", body
        assert agents[0].get("/cluster/status")[1]["models"]["chat"]["route"] == route  # the plan it kept
    finally:
        events.close()


def test_a_client_that_leaves_leaves_the_queue_and_the_load_still_completes(cluster):
    agents, _ = cluster
    unload_all(agents[0])
    for agent in agents:  # no fragments cached: the load builds them again and takes a while
        shutil.rmtree(Path(agent.env["NCM_HOME"]) / "models" / "gamma" / "fragments", ignore_errors=True)
    events = ModelEvents(agents[0])
    try:
        # The client asks a worker for gamma, then hangs up while gamma loads.
        connection = http.client.HTTPConnection("127.0.0.1", agents[1].port, timeout=10)
        connection.request("POST", "/v1/chat/completions", json.dumps({"model": "gamma", "messages": QUESTION}),
                           {"Content-Type": "application/json"})
        events.wait(lambda e: e["model"] == "gamma" and e["state"] == "loading", what="gamma loading")
        connection.close()
        ready = events.wait(lambda e: e["model"] == "gamma" and e["state"] == "ready", what="gamma loaded")
        assert ready["waiters"] == 0
        loading = [e["waiters"] for e in events.events if e["model"] == "gamma" and e["state"] == "loading"]
        assert loading and loading[-1] == 0, loading  # the waiter left before the load ended
    finally:
        events.close()

    result = subprocess.run([sys.executable, "-m", "agent.cli", "models", "--remote", agents[2].url],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split()[1] for line in result.stdout.splitlines()[1:]}
    assert rows["gamma"] == "ready" and rows["alpha"] == "unloaded" and set(MODELS) <= set(rows)


# --- rough edges, on in-process agents serving a tiny random model -------------------------------
def entered_states(events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    states = [data["state"] for kind, data in events if kind == "status_change"]
    return [b for a, b in zip(states, states[1:]) if a != b]


def test_a_preset_section_without_weights_is_left_out_at_start_and_refused_on_reload(tmp_path):
    async def scenario():
        presets = tmp_path / "models.ini"
        presets.write_text("[chat]\nmodel = tiny\n[orphan]\ncontext = 64\n")
        async with tiny_cluster(tmp_path, models_preset=presets) as (leader, others):
            status, body = await call("GET", others[0].url + "/v1/models")
            assert status == 200 and {m["id"] for m in body["data"]} == {"chat", TINY}, body  # the rest is served

            status, body = await call("GET", others[0].url + "/models?reload=1", headers=ADMIN)
            assert status == 400 and body["error"]["code"] == "invalid_presets", body
            message = body["error"]["message"]
            assert "[orphan] names no weights" in message and "model =" in message and "orphan" in message

            presets.write_text("[chat]\nmodel = tiny\n[other]\nmodel = ghost\n")
            status, body = await call("GET", leader.url + "/models?reload=1", headers=ADMIN)
            assert status == 400 and "[other] takes its weights from 'ghost'" in body["error"]["message"], body
            status, body = await call("GET", leader.url + "/models")
            assert {m["id"] for m in body["data"]} == {"chat", TINY}  # the previous settings stay

    asyncio.run(scenario())


def test_a_failed_load_tells_what_to_do_without_internal_addresses(tmp_path):
    """Weights that vanished after the model was listed: the answer says so, with no node's
    URL or answer in it, and no Retry-After (retrying cannot help until a node has them)."""

    async def scenario():
        # No fallback: no node keeps a whole copy of the smallest model ("gone") either.
        async with tiny_cluster(tmp_path, names=(TINY, "gone"), allow_fallback=False) as (leader, others):
            shutil.rmtree(tmp_path / "home-0" / "models" / "gone")
            status, headers, body = await complete(others[0].url, "w5", model="gone")
            assert status == 503 and body["error"]["code"] == "model_load_failed", body
            message = body["error"]["message"]
            assert "no live node stores the weights of 'gone'" in message and "import" in message
            assert "://" not in message and "HTTP 404" not in message and "{" not in message, message
            assert "Retry-After" not in headers and "retry the request" not in message
            status, body = await call("GET", leader.url + "/models")
            gone = {m["id"]: m for m in body["data"]}["gone"]
            assert gone["state"] == "failed" and "://" not in gone["reason"]

    asyncio.run(scenario())


def test_a_refused_load_is_its_own_event_and_gives_the_real_reason(tmp_path):
    """models_max 1 and the loaded model busy: the load is refused, naming why the loaded model
    stays; a refusal that changes no state is a `load_refused` event, not a `status_change`."""

    async def scenario():
        async with tiny_cluster(tmp_path, names=(TINY, "spare"), models_max=1) as (leader, _):
            events = SseEvents(leader.url)
            try:
                await eventually(lambda: events.of("spare"), timeout_s=10, what="the first events")
                gate = Gate(leader)
                busy = asyncio.create_task(complete(leader.url, "w5"))
                await eventually(lambda: gate.started, timeout_s=10, what="a request in flight on tiny")
                for attempt in range(2):
                    mark = len(events.items)
                    status, headers, body = await complete(leader.url, "w6", model="spare")
                    assert status == 503 and body["error"]["code"] == "model_capacity", body
                    message = body["error"]["message"]
                    assert "models_max=1 is reached by models that cannot be evicted: tiny (serving 1 request)" \
                        in message and "retry later" in message, message
                    assert int(headers["Retry-After"]) > 0
                    refused = await eventually(lambda m=mark: [d for k, d in events.of("spare", after=m)
                                                               if k == "load_refused"],
                                               timeout_s=10, what="the load_refused event")
                    assert refused[0]["detail"] == message and refused[0]["state"] == "unloaded"
                    changes = [d["state"] for k, d in events.of("spare", after=mark) if k == "status_change"]
                    if attempt == 0:
                        assert changes[0] == "measuring" and changes[-1] == "unloaded", changes  # measured, then back
                    else:
                        assert changes == [], changes  # measured before: nothing changed
                gate.open()
                assert (await busy)[0] == 200
            finally:
                await events.close()

    asyncio.run(scenario())


def test_the_states_of_a_load_follow_the_documented_order(tmp_path):
    """unloaded -> measuring -> loading -> ready, also when an idle model is evicted first."""

    async def scenario():
        async with tiny_cluster(tmp_path, names=(TINY, "spare"), models_max=1) as (leader, others):
            events = SseEvents(leader.url)
            try:
                await eventually(lambda: events.of("spare"), timeout_s=10, what="the first events")
                status, _, body = await complete(others[0].url, "w5", model="spare")
                assert status == 200 and body["model"] == "spare", body
                await eventually(lambda: entered_states(events.of(TINY))[-1:] == ["unloaded"], timeout_s=10,
                                 what="tiny evicted")
                assert events.of("spare")[0][1]["state"] == "unloaded"
                assert entered_states(events.of("spare")) == ["measuring", "loading", "ready"], events.of("spare")
                assert leader.app[ROUTER].registry.entries[TINY].state == "unloaded"
            finally:
                await events.close()

    asyncio.run(scenario())
