"""The cluster views and membership endpoints of the public port (agent/http/cluster_endpoints.py)
on in-process agents: two serving the tiny model (the orchestrator, and a worker that passes
the orchestrator's views on), and one alone with no model. `/health`, `/openapi.json`,
`/cluster/nodes`, `/cluster/status` and its throughput, `/cluster/plan` (and its 503 while no
plan is deployed), invites created, listed and revoked on each agent, `/cluster/events`
streaming the history and then new events, `/cluster/join` of a URL or a damaged invite, and
`/cluster/remove` handing a new key to the members that stay. Pairing's own checks are
`tests/agent/cluster/test_pairing_endpoint.py`'s; the events a real failover records,
`test_metrics_endpoint.py`'s."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from agent.core.invites import DEFAULT_INVITE_TTL_S, JoinString, fingerprint, pairing_proof
from agent.http.app_keys import EVENTS, INVITES, LIFECYCLE, MEMBERSHIP, ORCHESTRATOR
from agent.http.openapi import openapi_document
from tests.agent.agents import ADMIN, CLUSTER_KEY, free_ports
from tests.agent.inprocess import LocalAgent, Loop, call, eventually, local_agents, share_calibration
from tests.agent.tiny import TINY, tiny_cluster

SSE_TIMEOUT = aiohttp.ClientTimeout(total=30, sock_connect=5, sock_read=10)


class Agents:
    def __init__(self, loop: Loop, leader: LocalAgent, worker: LocalAgent, alone: LocalAgent) -> None:
        self.loop, self.leader, self.worker, self.alone = loop, leader, worker, alone

    @property
    def pair(self) -> tuple[LocalAgent, LocalAgent]:
        return self.leader, self.worker


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agents]:
    loop = Loop()
    try:
        with pytest.MonkeyPatch.context() as patch:
            share_calibration(patch)
            leader, (worker,) = loop.enter(tiny_cluster(tmp_path_factory.mktemp("tiny"), 2))
            (alone,) = loop.enter(local_agents(tmp_path_factory.mktemp("alone"), 1))
            loop.run(eventually(lambda: alone.app[MEMBERSHIP].election, timeout_s=20, what="the lone agent's election"))
            yield Agents(loop, leader, worker, alone)
    finally:
        loop.close()


async def get(agent: LocalAgent, path: str, **kwargs: Any) -> Any:
    status, body = await call("GET", agent.url + path, **kwargs)
    assert status == 200, (agent.node_id, path, body)
    return body


# --- health and the OpenAPI document --------------------------------------------------------------
def test_health_names_the_node_its_role_the_orchestrator_and_the_peer_port(agents):
    async def scenario() -> None:
        for agent, role in ((agents.leader, "orchestrator"), (agents.worker, "worker"), (agents.alone, "orchestrator")):
            membership = agent.app[MEMBERSHIP]
            body = await get(agent, "/health")
            assert body == {"status": "ok", "node_id": agent.node_id, "role": role,
                            "orchestrator": agents.leader.node_id if agent is not agents.alone else agent.node_id,
                            "peer_port": membership.peer_port}, body
            assert isinstance(body["peer_port"], int) and body["peer_port"] not in (0, agent.port)

    agents.loop.run(scenario())


def test_the_openapi_document_is_served_as_built_on_every_agent(agents):
    async def scenario() -> None:
        expected = json.loads(json.dumps(openapi_document()))
        for agent in (*agents.pair, agents.alone):
            body = await get(agent, "/openapi.json")
            assert body == expected
            assert {"/health", "/cluster/nodes", "/cluster/status", "/models"} <= set(body["paths"])

    agents.loop.run(scenario())


# --- nodes, status, plan ---------------------------------------------------------------------------
def test_cluster_nodes_lists_the_agent_first_then_its_peers_with_what_they_report(agents):
    async def scenario() -> None:
        await eventually(lambda: all(len(a.app[MEMBERSHIP].peer_reports()) == 1 for a in agents.pair), timeout_s=20,
                         what="each agent to have the other's report")
        for agent, other in (agents.pair, agents.pair[::-1]):
            body = await get(agent, "/cluster/nodes")
            assert (body["node_id"], body["cluster"], body["orchestrator"], body["epoch"]) == (
                agent.node_id, "test", agents.leader.node_id, agent.app[MEMBERSHIP].election.epoch)
            assert body["epoch"] >= 1 and body["rejected"] == []
            me, peer = body["nodes"]
            assert me["id"] == agent.node_id and me["self"] is True and me["alive"] is True
            assert me["url"] == agent.url and me["latency_ms"] == 0.0
            assert me["role"] == ("orchestrator" if agent is agents.leader else "worker")
            assert me["score"] > 0 and me["capacity"]["id"] == agent.node_id
            assert "cpu" in me["accelerators"]["usable"] and me["worker"]["state"] == "ready"
            assert peer["id"] == other.node_id and peer["self"] is False and peer["alive"] is True
            assert peer["url"] == other.url and peer["source"] == "static" and 0 <= peer["failures"] < 3
            assert peer["role"] == ("orchestrator" if other is agents.leader else "worker")
            assert peer["capacity"]["id"] == other.node_id and peer["score"] > 0 and peer["latency_ms"] >= 0
            assert peer["worker"]["state"] == "ready" and peer["worker"]["model"] == TINY  # from its report
            assert "cpu" in peer["accelerators"]["usable"] and peer["detected"]["id"] == other.node_id

    agents.loop.run(scenario())


def test_a_peer_that_never_answered_is_listed_without_what_only_it_could_say(agents):
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"

    async def scenario() -> None:
        status, answer = await call("POST", agents.alone.url + "/cluster/join", {"url": url + "/"}, headers=ADMIN)
        assert status == 200 and answer == {"message": f"contacting {url}/ now"}, answer

        async def failing() -> dict[str, Any] | None:
            nodes = (await get(agents.alone, "/cluster/nodes"))["nodes"]
            found = [n for n in nodes if n["url"] == url]  # its trailing slash dropped
            return found[0] if found and found[0]["failures"] > 0 else None

        entry = await eventually(failing, timeout_s=10, what="the dead peer's failures to be counted")
        assert entry["alive"] is False and entry["self"] is False and entry["source"] == "static"
        for key in ("id", "role", "score", "capacity", "worker", "detected", "accelerators"):
            assert entry[key] is None, (key, entry)

    agents.loop.run(scenario())


def test_cluster_status_is_the_orchestrators_on_every_agent_with_its_throughput(agents):
    async def scenario() -> None:
        status, answer = await call("POST", agents.worker.url + "/v1/completions", {
            "model": TINY, "prompt": "w7 w8", "max_tokens": 6, "temperature": 0, "logit_bias": {"2": -100}})
        assert status == 200 and answer["usage"]["completion_tokens"] == 6, answer
        leader_view = await get(agents.leader, "/cluster/status")
        worker_view = await get(agents.worker, "/cluster/status")
        for body in (leader_view, worker_view):
            assert body["orchestrator"] == agents.leader.node_id
            assert body["nodes_alive"] == sorted(a.node_id for a in agents.pair)
            assert body["state"] == "ok" and body["model"] == TINY and body["models"][TINY]["serving"] == TINY
            assert body["throughput"]["window_s"] > 0 and body["throughput"]["tokens_per_s"] > 0, body
        expected = agents.leader.app[ORCHESTRATOR].status()
        assert {k: worker_view[k] for k in expected} == json.loads(json.dumps(expected))

    agents.loop.run(scenario())


def test_cluster_plan_shows_every_layer_with_its_holders_and_the_route(agents):
    async def scenario() -> None:
        orchestrator = agents.leader.app[ORCHESTRATOR]
        for agent in agents.pair:
            body = await get(agent, "/cluster/plan")
            assert body["model"] == TINY and body["uncovered_layers"] == []
            assert (body["plan_version"], body["epoch"]) == (orchestrator.order.plan_version, orchestrator.order.epoch)
            assert body["plan"] == json.loads(json.dumps(orchestrator.plan.to_dict()))
            assert body["route"] == orchestrator.order.route.to_list()
            assert [layer["layer"] for layer in body["layers"]] == list(range(body["plan"]["total_layers"]))
            members = {a.node_id for a in agents.pair}
            for layer in body["layers"]:
                assert layer["coverage"] == len(layer["holders"]) >= 1 and set(layer["holders"]) <= members
            routed = [layer for stage in body["route"] for layer in range(stage["layers"][0], stage["layers"][1] + 1)]
            assert routed == list(range(body["plan"]["total_layers"]))  # the route runs every layer once, in order
            for stage in body["route"]:
                for layer in range(stage["layers"][0], stage["layers"][1] + 1):
                    assert stage["node"] in body["layers"][layer]["holders"]

    agents.loop.run(scenario())


def test_without_a_deployed_plan_cluster_plan_is_a_503_to_retry(agents):
    async def scenario() -> None:
        async with aiohttp.ClientSession() as session, session.get(
                agents.alone.url + "/cluster/plan", timeout=aiohttp.ClientTimeout(total=10)) as response:
            assert response.status == 503 and response.headers["Retry-After"] == "5"
            error = (await response.json())["error"]
        assert error["type"] == "service_unavailable" and error["code"] == "cluster_unavailable"
        assert error["message"].startswith("no plan is deployed (") and error["param"] is None

    agents.loop.run(scenario())


# --- invites ---------------------------------------------------------------------------------------
def test_invites_are_created_listed_and_revoked_on_the_agent_that_issued_them(agents):
    async def scenario() -> None:
        issued = {}
        for agent in agents.pair:
            status, made = await call("POST", agent.url + "/cluster/invites", {"ttl_s": 120, "uses": 2}, headers=ADMIN)
            assert status == 200, made
            join = JoinString.decode(made["join"])
            assert (join.cluster, join.url, join.invite_id) == ("test", agent.url, made["id"])
            assert join.fingerprint == fingerprint(CLUSTER_KEY.encode())
            assert made["uses_left"] == 2 and 119 <= made["expires_in_s"] <= 120
            assert made["expires_at"] - made["created_at"] == pytest.approx(120)
            issued[agent.node_id] = made["id"]
        for agent in agents.pair:  # each agent lists its own, never a secret
            listed = (await get(agent, "/cluster/invites", headers=ADMIN))["data"]
            assert [i["id"] for i in listed] == [issued[agent.node_id]], listed
            assert set(listed[0]) == {"id", "created_at", "expires_at", "expires_in_s", "uses_left"}
        status, answer = await call("POST", agents.worker.url + "/cluster/invites", None, headers=ADMIN)
        assert status == 200 and answer["uses_left"] == 1, answer  # no body: the defaults
        assert DEFAULT_INVITE_TTL_S - 1 <= answer["expires_in_s"] <= DEFAULT_INVITE_TTL_S
        for agent in agents.pair:
            for invite in (await get(agent, "/cluster/invites", headers=ADMIN))["data"]:
                status, answer = await call("DELETE", agent.url + f"/cluster/invites/{invite['id']}", headers=ADMIN)
                assert status == 200 and answer == {"revoked": invite["id"]}, answer
            assert (await get(agent, "/cluster/invites", headers=ADMIN))["data"] == []
            status, answer = await call("DELETE", agent.url + f"/cluster/invites/{issued[agent.node_id]}",
                                        headers=ADMIN)
            assert status == 404 and answer["error"]["code"] == "invite_not_found", answer

    agents.loop.run(scenario())


def test_a_revoked_invite_pairs_no_one(agents):
    def pair_body(join: JoinString) -> dict[str, str]:
        nonce = secrets.token_hex(8)
        return {"invite": join.invite_id, "nonce": nonce, "proof": pairing_proof(join.secret, join.invite_id, nonce),
                "cluster": join.cluster, "fingerprint": join.fingerprint}

    async def scenario() -> None:
        agent = agents.worker
        status, made = await call("POST", agent.url + "/cluster/invites", {"uses": 3}, headers=ADMIN)
        assert status == 200, made
        join = JoinString.decode(made["join"])
        status, paired = await call("POST", agent.url + "/cluster/pair", pair_body(join))
        assert status == 200 and paired["cluster"] == "test" and agents.leader.url in paired["peers"], paired
        assert (await call("DELETE", agent.url + f"/cluster/invites/{join.invite_id}", headers=ADMIN))[0] == 200
        status, refused = await call("POST", agent.url + "/cluster/pair", pair_body(join))
        assert status == 403 and refused["error"]["code"] == "invite_refused", refused
        assert agent.app[INVITES].active() == []

    agents.loop.run(scenario())


# --- events -----------------------------------------------------------------------------------------
async def read_events(response: aiohttp.ClientResponse, into: list[tuple[str, dict[str, Any]]]) -> None:
    kind = None
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            kind = line[len("event: "):]
        elif line.startswith("data: "):
            into.append((kind, json.loads(line[len("data: "):])))


def test_cluster_events_streams_the_orchestrators_history_then_each_new_event_on_every_agent(agents):
    async def scenario() -> None:
        log = agents.leader.app[EVENTS]
        history = [event.to_json() for event in log.history]
        assert {"election", "load"} <= {event["kind"] for event in history}
        async with aiohttp.ClientSession(timeout=SSE_TIMEOUT) as session:
            for agent in agents.pair:
                received: list[tuple[str, dict[str, Any]]] = []
                async with session.get(agent.url + "/cluster/events") as response:
                    assert response.status == 200 and response.content_type == "text/event-stream"
                    reader = asyncio.create_task(read_events(response, received))
                    try:
                        await eventually(lambda: len(received) >= len(history), timeout_s=10, what="the history")
                        assert received[:len(history)] == [("cluster", event) for event in history]
                        new = ("cluster", log.record("replan", f"a test event for {agent.node_id}", model=TINY,
                                                     duration_s=0.25).to_json())
                        await eventually(lambda: new in received, timeout_s=10, what="the new event")
                        assert received.index(new) >= len(history) and received.count(new) == 1
                        assert new[1]["kind"] == "replan" and new[1]["duration_s"] == 0.25
                    finally:
                        reader.cancel()
                history = [event.to_json() for event in log.history]
        # the worker's own log is not the cluster's: its stream was the orchestrator's
        assert all(e.message != "a test event for node-1" for e in agents.worker.app[EVENTS].history)

    agents.loop.run(scenario())


# --- join and remove ---------------------------------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"url": "ftp://peer:8000"}, "url"), ({"url": "peer:8000"}, "url"), ({"url": 8000}, "url"), ({}, "url"),
    ({"url": "http://" + "p" * 250}, "url"), ([], "url"), ({"invite": "ncm1.garbage"}, "invite"),
    ({"invite": "not a join string"}, "invite"),
])
def test_join_refuses_what_is_neither_a_url_nor_a_join_string_by_name(agents, body, param):
    async def scenario() -> None:
        before = set(agents.alone.app[MEMBERSHIP].table.entries)
        status, answer = await call("POST", agents.alone.url + "/cluster/join", body, headers=ADMIN)
        assert status == 400 and answer["error"]["param"] == param, answer
        assert answer["error"]["type"] == "invalid_request_error"
        if param == "invite":
            assert answer["error"]["code"] == "invite_refused" and "join string" in answer["error"]["message"]
        assert set(agents.alone.app[MEMBERSHIP].table.entries) == before
        assert agents.alone.app[LIFECYCLE].restart is False

    agents.loop.run(scenario())


def test_remove_refuses_a_node_that_is_not_in_the_cluster(agents):
    async def scenario() -> None:
        for agent in agents.pair:
            for body in ({"node": "node-9"}, {"node": 1}, {}, ["node-1"]):
                status, answer = await call("POST", agent.url + "/cluster/remove", body, headers=ADMIN)
                assert status == 400 and answer["error"]["param"] == "node", answer
                assert "GET /cluster/nodes" in answer["error"]["message"]
        assert not any(agent.app[LIFECYCLE].restart for agent in agents.pair)

    agents.loop.run(scenario())


def test_removing_a_node_hands_a_new_key_to_those_that_stay_and_voids_the_invites(tmp_path):
    async def scenario() -> None:
        async with local_agents(tmp_path, 3) as trio:
            await eventually(lambda: all(len(a.app[MEMBERSHIP].alive_nodes()) == 3 and a.app[MEMBERSHIP].election
                                         for a in trio), timeout_s=20, what="three agents to see each other")
            leader = trio[0].app[MEMBERSHIP].election.orchestrator
            orchestrator = next(a for a in trio if a.node_id == leader)
            removed = next(a for a in trio if a is not orchestrator)
            stays = next(a for a in trio if a not in (orchestrator, removed))
            status, made = await call("POST", orchestrator.url + "/cluster/invites", {}, headers=ADMIN)
            assert status == 200, made
            status, answer = await call("POST", stays.url + "/cluster/remove", {"node": removed.node_id},
                                        headers=ADMIN)  # through a worker: done by the orchestrator
            assert status == 200, answer
            assert answer == {"removed": removed.node_id, "rekeyed": sorted([orchestrator.node_id, stays.node_id]),
                              "unreachable": {}}
            assert orchestrator.app[INVITES].active() == []  # issued under the key the removed one holds
            assert orchestrator.app[LIFECYCLE].restart and stays.app[LIFECYCLE].restart  # to take the new key
            assert not removed.app[LIFECYCLE].restart

    asyncio.run(scenario())
