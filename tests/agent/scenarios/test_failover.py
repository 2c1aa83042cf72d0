"""Chaos tests: 3 real agents on loopback, one of them killed with SIGKILL during a streamed
request. Capacities are pinned so the plan is known: agent-0 is the strongest (the head),
agent-1 the middle, agent-2 the lightest (the tail, holding the head replica).

With 30 layers, head ratio 0.8 and one replica, the head owner's layers all have a replica
(failover keeps the main model) while the middle and the tail have layers without one
(degraded mode: the request finishes on the fallback model, the q4 copy of the model)."""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
import urllib.request
from pathlib import Path

import jsonschema
import pytest

from tests.agent.agents import (
    ADMIN,
    FALLBACK,
    MAIN,
    Agent,
    ModelEvents,
    cluster_ready,
    give_small_disk,
    linked_copy,
    make_agents,
    shut_down,
    wait_for,
)

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "Tell me about the history of Paris, the capital of France, in detail."}]
TOKENS = 40
CAPACITY = [{"NCM_VRAM_GIB": "24"}, {"NCM_VRAM_GIB": "8"}, {"NCM_VRAM_GIB": "0"}]
CHAOS_ENV = {"NCM_REPLICATE_HEAD_RATIO": "0.8", "NCM_REPLICA_COUNT": "1", "NCM_REPLAN_MIN_INTERVAL_S": "2",
             "NCM_RAM_GIB": "4"}


def start_chaos_cluster(tmp: Path, store_root: Path, orchestrator: int) -> list[Agent]:
    homes = [linked_copy(store_root, tmp / f"home-{i}") for i in range(3)]
    agents = make_agents(tmp, homes, 3, extra_env=CHAOS_ENV, start=False)
    for index, agent in enumerate(agents):
        agent.env.update(CAPACITY[index])
        if index == orchestrator:
            agent.env["NCM_ORCHESTRATOR"] = "true"
    for agent in agents:
        agent.start([f"--peer={other.url}" for other in agents if other is not agent])
    wait_for(lambda: cluster_ready(agents[orchestrator], 3), timeout_s=300, what="the chaos cluster to serve")
    return agents


class Stream:
    """A streamed chat completion read in a thread: pieces, models, error events, timings."""

    def __init__(self, agent: Agent, max_tokens: int = TOKENS, **fields: object) -> None:
        body = json.dumps({"messages": QUESTION, "temperature": 0, "max_tokens": max_tokens, "stream": True,
                           **fields}).encode()
        self.request = urllib.request.Request(agent.url + "/v1/chat/completions", data=body,
                                              headers={"Content-Type": "application/json"})
        self.pieces: list[str] = []
        self.models: list[str] = []
        self.stamps: list[float] = []
        self.errors: list[dict] = []
        self.ids: list[str] = []
        self.call_pieces: list[dict] = []  # the tool calls' streamed pieces, as they came
        self.finish: str | None = None
        self.done = False
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            self._consume()
        except Exception as error:  # noqa: BLE001 - reported by the test's assertions
            self.failure = error

    def _consume(self) -> None:
        with urllib.request.urlopen(self.request, timeout=300) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    self.done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    self.errors.append(event["error"])
                    continue
                self.ids.append(event["id"])
                assert "ncm_tokens" not in event, "internal fields must not reach the client"
                for choice in event["choices"]:
                    content = choice["delta"].get("content")
                    self.call_pieces += choice["delta"].get("tool_calls", [])
                    if content:
                        self.pieces.append(content)
                        self.models.append(event["model"])
                        self.stamps.append(time.monotonic())
                    self.finish = choice["finish_reason"] or self.finish

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def tool_calls(self) -> list[dict]:
        """The calls put together from their pieces, as a client does: by index, the first
        piece with the id and name (once: a resumed stream does not start a call again),
        then more of the arguments' text."""
        calls: dict[int, dict] = {}
        for piece in self.call_pieces:
            if "id" in piece:
                assert piece["index"] not in calls, f"call {piece['index']} started twice: {self.call_pieces}"
                calls[piece["index"]] = {"id": piece["id"], "function": dict(piece["function"])}
            else:
                calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
        return [calls[index] for index in sorted(calls)]

    def wait_pieces(self, count: int) -> None:
        wait_for(lambda: len(self.pieces) >= count or not self.thread.is_alive(), timeout_s=120,
                 what=f"{count} streamed pieces")

    def join(self) -> None:
        self.thread.join(timeout=300)
        assert not self.thread.is_alive(), "the stream never ended"
        assert self.failure is None, f"the stream broke: {self.failure!r}"


def reference(agent: Agent) -> str:
    status, body = agent.post("/v1/chat/completions", {"messages": QUESTION, "temperature": 0, "max_tokens": TOKENS})
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def route_of(agent: Agent) -> list[dict]:
    return agent.get("/cluster/plan")[1]["route"]


def node_ids(agents: list[Agent]) -> list[str]:
    return [agent.node_id() for agent in agents]


@pytest.fixture
def chaos(full_store, tmp_path):
    started: list[Agent] = []

    def start(orchestrator: int) -> list[Agent]:
        started.extend(start_chaos_cluster(tmp_path, full_store.root, orchestrator))
        return started

    yield start
    shut_down(started)


def status_of(agent: Agent) -> dict:
    return agent.get("/cluster/status", timeout_s=10)[1]


def test_killing_the_head_owner_hands_over_to_the_replica_with_the_same_tokens(chaos):
    agents = chaos(orchestrator=2)
    ids = node_ids(agents)
    route = route_of(agents[2])
    assert [hop["node"] for hop in route] == ids
    plan = agents[2].get("/cluster/plan")[1]["plan"]
    assert plan["replicas"] == [[ids[2], [0, plan["replicas"][0][1][1]]]]
    assert plan["replicas"][0][1][1] >= route[0]["layers"][1], "the head owner's layers must all have a replica"
    undisturbed = reference(agents[2])
    stream = Stream(agents[1])
    stream.wait_pieces(6)
    killed_at = time.monotonic()
    agents[0].kill()
    stream.join()
    assert stream.errors == [] and stream.done
    assert stream.text == undisturbed  # nothing lost, nothing repeated, same greedy continuation
    assert set(stream.models) == {MAIN}
    gap = max(b - a for a, b in zip(stream.stamps, stream.stamps[1:]))
    print(f"longest pause in the stream: {gap:.3f} s (kill at {killed_at:.3f})")
    status = status_of(agents[2])
    assert status["state"] == "ok" and status["model"] == MAIN and not status["degraded"]
    assert ids[0] not in [hop["node"] for hop in status["route"]]
    assert status["route"][0] == {"node": ids[2], "layers": route[0]["layers"]}  # spliced in place
    # The workers' forwarding tables follow the new route.
    nodes = agents[1].get("/cluster/nodes")[1]["nodes"]
    me = next(n for n in nodes if n["self"])
    order = next(o for o in me["worker"]["orders"] if o["name"] == MAIN)
    assert order["route"] == status["route"]
    assert reference(agents[1]) == undisturbed


@pytest.mark.parametrize("victim", [0, 1], ids=["head", "middle"])
def test_a_frozen_stage_is_blamed_itself_and_the_request_moves_on_without_waiting_out_a_timer(chaos, victim):
    agents = chaos(orchestrator=2)
    ids = node_ids(agents)
    undisturbed = reference(agents[2])
    stream = Stream(agents[1] if victim == 0 else agents[2])
    stream.wait_pieces(6)
    agents[victim].process.send_signal(signal.SIGSTOP)  # frozen: its sockets stay open, it says nothing
    try:
        stream.join()
        assert stream.errors == [] and stream.done
        gap = max(b - a for a, b in zip(stream.stamps, stream.stamps[1:]))
        assert gap < 30, f"the stream paused {gap:.1f} s: it waited out a timer instead of noticing the silence"
        blamed = [line for line in agents[2].log().splitlines() if "failing over" in line]
        assert blamed and all(f"stage {ids[victim]} failed (stage_timeout)" in line for line in blamed), blamed
        status = status_of(agents[2])
        assert ids[victim] not in [hop["node"] for hop in status["route"]]
        if victim == 0:  # its layers have a replica: the same model, the same text
            assert stream.text == undisturbed and status["model"] == MAIN
        else:  # layers nobody else holds: the fallback model finishes the request
            assert stream.models[-1] == FALLBACK and status["state"] == "degraded"
    finally:
        agents[victim].process.send_signal(signal.SIGCONT)


ANSWER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40},
    "facts": {"type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 2, "maxItems": 3}},
    "required": ["city", "facts"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.mark.parametrize("kind", ["json_schema", "tool_call"])
def test_killing_the_tail_mid_answer_still_ends_in_valid_json(chaos, kind):
    """The tail stage samples under the request's grammar: the route that takes over (the
    fallback model's) catches up with the tokens chosen so far and keeps the answer valid."""
    agents = chaos(orchestrator=0)
    fields = ({"response_format": {"type": "json_schema", "json_schema": {"name": "paris", "schema": ANSWER_SCHEMA}}}
              if kind == "json_schema" else {"tools": [WEATHER_TOOL], "tool_choice": "required"})
    stream = Stream(agents[1], max_tokens=160, **fields)
    # a tool call streams in pieces once its name is written; chunks come for every token
    wait_for(lambda: len(stream.ids) >= 8 or not stream.thread.is_alive(), timeout_s=120, what="8 chunks")
    agents[2].kill()
    stream.join()
    assert stream.errors == [] and stream.done
    if kind == "json_schema":
        assert stream.models[-1] == FALLBACK  # the rest came from the fallback model, under the same grammar
        jsonschema.validate(json.loads(stream.text), ANSWER_SCHEMA)
    else:
        assert stream.finish == "tool_calls" and len(stream.tool_calls) == 1, stream.tool_calls
        call = stream.tool_calls[0]["function"]
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), WEATHER_TOOL["function"]["parameters"])
    assert status_of(agents[0])["state"] == "degraded"


@pytest.mark.parametrize("victim", [1, 2], ids=["middle", "tail"])
def test_killing_a_node_without_replica_degrades_to_the_fallback_model(chaos, victim):
    agents = chaos(orchestrator=0)
    ids = node_ids(agents)
    route = route_of(agents[0])
    plan = agents[0].get("/cluster/plan")[1]["plan"]
    replicated = plan["replicas"][0][1][1]
    assert route[victim]["layers"][1] > replicated, "the victim must hold a layer nobody else has"
    undisturbed = reference(agents[0])
    client = agents[1 if victim == 2 else 2]
    stream = Stream(client)
    stream.wait_pieces(6)
    before = len(stream.pieces)
    agents[victim].kill()
    stream.join()
    assert stream.errors == [] and stream.done and stream.finish in ("stop", "length")
    assert undisturbed.startswith("".join(stream.pieces[:before]))
    assert stream.models[-1] == FALLBACK  # the rest came from the fallback, and says so
    status = status_of(agents[0])
    assert status["state"] == "degraded" and status["model"] == FALLBACK and status["degraded"]
    assert ids[victim] not in [hop["node"] for hop in status["route"]]
    status_code, body = client.post("/v1/chat/completions", {"messages": QUESTION, "temperature": 0, "max_tokens": 8})
    assert status_code == 200 and body["model"] == FALLBACK


def test_killing_the_orchestrator_elects_a_new_one_that_goes_on_with_the_stream(chaos):
    agents = chaos(orchestrator=0)  # the orchestrator is also the head owner
    ids = node_ids(agents)
    epoch = agents[1].get("/cluster/nodes")[1]["epoch"]
    undisturbed = reference(agents[1])
    stream = Stream(agents[2])
    stream.wait_pieces(6)
    agents[0].kill()
    stream.join()
    # The answer was being produced by the orchestrator: the agent the client is connected to
    # goes on with it on the new orchestrator, after the tokens it had: one unbroken stream.
    assert stream.errors == [] and stream.done
    assert stream.text == undisturbed and len(set(stream.ids)) == 1

    def new_orchestrator():
        views = [agent.get("/cluster/nodes", timeout_s=5)[1] for agent in agents[1:]]
        chosen = {view["orchestrator"] for view in views}
        return len(chosen) == 1 and ids[0] not in chosen and all(v["epoch"] > epoch for v in views) and views[0]

    view = wait_for(new_orchestrator, timeout_s=30, what="a new orchestrator with a higher epoch")
    assert view["orchestrator"] in ids[1:]
    wait_for(lambda: status_of(agents[1]).get("state") == "ok", timeout_s=60, what="the new orchestrator to serve")
    status = status_of(agents[2])
    assert status["model"] == MAIN and status["epoch"] > epoch
    assert ids[0] not in [hop["node"] for hop in status["route"]]
    assert reference(agents[2]) == undisturbed


def test_a_tool_call_streaming_when_the_orchestrator_dies_is_finished_by_the_new_one(chaos):
    """The call had started to stream when the orchestrator died: the new one reads on after
    the tokens it had and sends the rest of its arguments, without starting it again."""
    agents = chaos(orchestrator=0)
    stream = Stream(agents[2], max_tokens=160, tools=[WEATHER_TOOL], tool_choice="required")
    wait_for(lambda: len(stream.ids) >= 8 or not stream.thread.is_alive(), timeout_s=120, what="8 chunks")
    agents[0].kill()
    stream.join()
    assert stream.errors == [] and stream.done
    assert stream.finish == "tool_calls" and len(stream.tool_calls) == 1 and stream.text == "", (stream.text, stream.tool_calls)
    call = stream.tool_calls[0]["function"]
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER_TOOL["function"]["parameters"])


def test_a_node_that_comes_back_returns_the_cluster_to_the_main_model(chaos):
    agents = chaos(orchestrator=0)
    ids = node_ids(agents)
    undisturbed = reference(agents[0])
    agents[2].kill()
    wait_for(lambda: status_of(agents[0]).get("state") == "degraded", timeout_s=30, what="degraded mode")
    assert status_of(agents[0])["model"] == FALLBACK
    agents[2].start([f"--peer={other.url}" for other in agents if other is not agents[2]])
    wait_for(lambda: agents[2].get("/health", timeout_s=2)[0] == 200, timeout_s=60, what="the node to come back")

    def back_to_main():
        status = status_of(agents[0])
        return status.get("state") == "ok" and status.get("model") == MAIN and len(status.get("nodes_alive", [])) == 3 and status

    status = wait_for(back_to_main, timeout_s=120, what="the cluster to re-plan over 3 nodes on the main model")
    assert ids[2] in [hop["node"] for hop in status["route"]] and agents[2].node_id() == ids[2]
    assert reference(agents[1]) == undisturbed


def test_a_node_that_comes_back_with_a_corrupt_layer_file_fetches_it_again_before_serving(chaos):
    agents = chaos(orchestrator=0)
    ids = node_ids(agents)
    undisturbed = reference(agents[0])
    first = next(hop["layers"][0] for hop in route_of(agents[0]) if hop["node"] == ids[2])
    agents[2].kill()
    wait_for(lambda: status_of(agents[0]).get("state") == "degraded", timeout_s=30, what="degraded mode")
    model_dir = agents[2].home / "models" / MAIN
    manifest = json.loads((model_dir / "manifest.json").read_text())
    relative = manifest["files"][f"layer.{first}"]["path"]
    data = bytearray((model_dir / relative).read_bytes())
    data[len(data) // 2] ^= 0x40  # one flipped bit, same size
    (model_dir / relative).unlink()  # it was a link to the other stores' file
    (model_dir / relative).write_bytes(bytes(data))
    shutil.rmtree(model_dir / "fragments")  # its fragments are built again, from the files
    agents[2].start([f"--peer={other.url}" for other in agents if other is not agents[2]])

    def back_to_main():
        status = status_of(agents[0])
        return status.get("state") == "ok" and status.get("model") == MAIN and len(status.get("nodes_alive", [])) == 3

    wait_for(back_to_main, timeout_s=180, what="the cluster to serve the main model over 3 nodes again")
    assert reference(agents[1]) == undisturbed
    view = agents[0].get("/cluster/nodes")[1]
    worker = next(n for n in view["nodes"] if n["id"] == ids[2])["worker"]
    # Found when its fragment was built again, or by the scrub that follows an unclean stop.
    assert any(r["model"] == MAIN and r["files"] == [relative] and r["fetched_again"] and r["found_by"] in
               ("build", "scrub") for r in worker["repairs"]), worker
    assert f"weight file {relative} of {MAIN} is corrupt" in agents[2].log()


def test_a_new_node_given_one_peer_joins_and_the_model_is_rebalanced_over_it(chaos, tmp_path):
    agents = chaos(orchestrator=0)
    undisturbed = reference(agents[0])
    newcomer = make_agents(tmp_path / "newcomer", tmp_path / "newcomer-home", 1, extra_env=CHAOS_ENV, start=False)[0]
    newcomer.env.update(NCM_VRAM_GIB="8")
    newcomer.start([f"--peer={agents[2].url}"])  # knows one peer only
    try:
        newcomer_id = wait_for(lambda: newcomer.node_id(), timeout_s=60, what="the new agent to start")

        def rebalanced():
            status = status_of(agents[0])
            return (status.get("state") == "ok" and newcomer_id in [hop["node"] for hop in status["route"] or []]
                    and status)

        status = wait_for(rebalanced, timeout_s=180, what="the cluster to re-plan over the new node")
        assert sorted(status["nodes_alive"]) == sorted(node_ids(agents) + [newcomer_id])
        plan = agents[0].get("/cluster/plan")[1]
        assert {node["id"] for node in plan["plan"]["nodes"]} == set(status["nodes_alive"])
        assert reference(newcomer) == undisturbed  # it fetched its layers and serves them
    finally:
        shut_down([newcomer])


def test_a_joining_node_too_small_for_its_share_leaves_the_plan_as_it_is(chaos, tmp_path):
    agents = chaos(orchestrator=0)
    before = route_of(agents[0])
    undisturbed = reference(agents[0])
    # The strongest score of all (NPU) on 100 MiB of memory: any share of the model is too much.
    newcomer = make_agents(tmp_path / "newcomer", tmp_path / "newcomer-home", 1, extra_env=CHAOS_ENV, start=False)[0]
    newcomer.env.update(NCM_NPU_TOPS="40", NCM_RAM_GIB="0.1")
    newcomer.start([f"--peer={agents[2].url}"])
    try:
        newcomer_id = wait_for(lambda: newcomer.node_id(), timeout_s=60, what="the new agent to start")
        wait_for(lambda: f"{newcomer_id} lacks" in agents[0].log() or route_of(agents[0]) != before, timeout_s=120,
                 what="the orchestrator to decide about a re-plan over the new node")
        status = status_of(agents[0])
        assert newcomer_id in status["nodes_alive"] and status["state"] == "ok"
        assert route_of(agents[0]) == before
        assert reference(newcomer) == undisturbed  # it serves through the old route
    finally:
        shut_down([newcomer])


def test_a_joining_node_with_a_full_disk_leaves_the_old_plan_serving_and_is_marked(chaos, tmp_path):
    agents = chaos(orchestrator=0)
    before = route_of(agents[0])
    undisturbed = reference(agents[0])
    newcomer = make_agents(tmp_path / "newcomer", tmp_path / "newcomer-home", 1, extra_env=CHAOS_ENV, start=False)[0]
    newcomer.env.update(NCM_VRAM_GIB="8")  # a share of the model, which its disk cannot hold
    disk = give_small_disk(newcomer, 8 << 20)
    newcomer.start([f"--peer={agents[2].url}"])
    try:
        newcomer_id = wait_for(lambda: newcomer.node_id(), timeout_s=60, what="the new agent to start")
        fault = wait_for(lambda: status_of(agents[0]).get("faults", {}).get(newcomer_id), timeout_s=180,
                         what="the orchestrator to mark the node that could not stage the plan")
        assert fault["cause"] == ("disk_full" if disk == "tmpfs" else "store_not_writable"), fault
        # The nodes that staged the new plan dropped it: the old plan serves, and says so.
        for agent in agents:
            assert reference(agent) == undisturbed
        status = status_of(agents[0])
        assert status["state"] == "ok" and newcomer_id in status["nodes_alive"], status
        assert route_of(agents[0]) == before
        view = agents[1].get("/cluster/nodes")[1]
        reported = next(n for n in view["nodes"] if n["id"] == newcomer_id)["worker"]
        assert reported and reported["fault"]["cause"] == fault["cause"], reported
        assert reference(newcomer) == undisturbed  # it serves through the old route
    finally:
        shut_down([newcomer])


def test_without_fallback_a_lost_layer_fails_the_model_which_loads_again_by_itself(chaos, monkeypatch):
    monkeypatch.setitem(CHAOS_ENV, "NCM_ALLOW_FALLBACK", "false")
    agents = chaos(orchestrator=0)
    events = ModelEvents(agents[0])
    try:
        stream = Stream(agents[1])
        stream.wait_pieces(4)
        agents[2].kill()  # the tail: layers nobody else holds
        stream.join()
        assert stream.errors and not stream.done  # RoutingFailure: an error event, never a hang
        assert len(stream.errors) == 1  # one error event, then the stream ends
        failed = events.wait(lambda e: e["model"] == MAIN and e["state"] == "failed", what="the failed state on SSE")
        assert "no live holder" in failed["reason"] and failed["memory"]["effective_bytes"] == {}
        # The main model is not lost for good: the orchestrator plans it again over the
        # survivors by itself, without waiting for a request, and the status says so.
        events.wait(lambda e: e["model"] == MAIN and e["state"] == "ready", after=events.events.index(failed))
        status = wait_for(lambda: (s := status_of(agents[0]))["state"] == "ok" and s, timeout_s=60,
                          what="the status to heal")
        assert len(status["route"]) == 2
        code, body = agents[1].post("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 4})
        assert code == 200 and body["model"] == MAIN, body
    finally:
        events.close()


def worker_of(agent: Agent) -> dict:
    """What ``agent``'s worker reports of itself (its served and staged orders)."""
    nodes = agent.get("/cluster/nodes", timeout_s=10)[1]["nodes"]
    return next(node for node in nodes if node["self"])["worker"]


def test_a_node_frozen_through_an_unload_drops_the_model_once_it_wakes(chaos):
    """Reconciliation with real processes: the unload cannot reach a frozen node; once it
    wakes, the orchestrator sees it still holds the model's orders and tells it again."""
    agents = chaos(orchestrator=0)
    frozen = agents[2]
    frozen_id = frozen.node_id()
    wait_for(lambda: MAIN in worker_of(frozen)["models"], timeout_s=120, what="the third node serving its part")
    frozen.process.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: frozen_id not in status_of(agents[0]).get("nodes_alive", []), timeout_s=120,
                 what="the frozen node counted as gone")
        status, body = agents[0].post("/models/unload", {"model": MAIN}, headers=ADMIN)
        assert status == 200, body
    finally:
        frozen.process.send_signal(signal.SIGCONT)
    wait_for(lambda: not worker_of(frozen)["models"] and not worker_of(frozen)["staged"], timeout_s=180,
             what="the woken node to drop the model it kept")
    assert "which is not deployed: dropping it there" in agents[0].log()
