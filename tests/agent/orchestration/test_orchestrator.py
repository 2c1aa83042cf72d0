"""The orchestrator's failover, degraded mode, hand-over and loss of a model without fallback,
on in-process agents serving the tiny model (4 layers), in seconds: the in-process tier of
`scenarios/test_failover.py`.

Capacities are pinned so the plan is known (scores about 12, 4 and 0.5):

- node-1, the strongest, owns the head (layers 0-1);
- node-2 the middle (layer 2), which nobody else holds;
- node-0, the weakest and the configured orchestrator, the tail (layer 3); it stores the
  models and holds the replica of the head (replicate_head_ratio 0.5, one replica).

An agent is stopped for real (its sockets close: `runner.cleanup()`). To stop it in the
middle of a request, its worker is held on a step of that request first ("frozen" the moment
it goes, like a device that dies during a step); everything else is the real path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from agent.cluster.peer_client import PeerError
from agent.core.protocol import StepFrame
from agent.http.app_keys import EVENTS, MEMBERSHIP, ORCHESTRATOR, WORKER
from shards.importers.importer import import_model
from shards.store.model_store import ModelStore
from tests.agent.inprocess import LocalAgent, call, eventually
from tests.agent.tiny import TINY, tiny_cluster, write_tiny_checkpoint

FALLBACK = "tiny-fallback"  # 2 layers, other weights, the same tokenizer
PROMPT = "w7 w8 w9 w10"
TOKENS = 24
# node-0: the orchestrator and the tail; node-1: the head; node-2: the middle.
CAPACITY = [{"orchestrator": True, "vram_gib": 0.0, "ram_gib": 4.0}, {"vram_gib": 24.0, "ram_gib": 4.0},
            {"vram_gib": 8.0, "ram_gib": 4.0}]
CHAOS = {"layers": 4, "replicate_head_ratio": 0.5, "replica_count": 1, "fallback_model": FALLBACK,
         "replan_min_interval_s": 600.0, "per_agent": CAPACITY}


def store_fallback(tmp: Path) -> None:
    """The fallback model in the first agent's store, next to the tiny model."""
    source = write_tiny_checkpoint(tmp / "fallback-checkpoint", seed=1, layers=2)
    import_model(source, name=FALLBACK, store=ModelStore(tmp / "home-0"), progress=False)


@dataclass
class Streamed:
    """A streamed completion as the client saw it."""

    pieces: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    usage: dict[str, int] | None = None
    done: bool = False

    @property
    def text(self) -> str:
        return "".join(self.pieces)


async def stream(url: str, max_tokens: int = TOKENS) -> Streamed:
    body = {"model": TINY, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    seen = Streamed()
    async with aiohttp.ClientSession() as session, session.post(
            url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                seen.done = True
                continue
            event = json.loads(data)
            if "error" in event:
                seen.errors.append(event["error"])
                continue
            assert "ncm_tokens" not in event, "internal fields must not reach the client"
            seen.ids.add(event["id"])
            seen.usage = event.get("usage") or seen.usage
            for choice in event["choices"]:
                if choice["text"]:
                    seen.pieces.append(choice["text"])
                    seen.models.append(event["model"])
    return seen


async def reference(url: str, max_tokens: int = TOKENS) -> dict[str, Any]:
    status, body = await call("POST", url + "/v1/completions", {
        "model": TINY, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, body
    return body


async def cluster_status(agent: LocalAgent) -> dict[str, Any]:
    status, body = await call("GET", agent.url + "/cluster/status")
    assert status == 200, body
    return body


def route_nodes(status: dict[str, Any]) -> list[str]:
    return [hop["node"] for hop in status["route"] or []]


class Frozen:
    """Holds ``agent``'s worker on its ``at``-th step from now: a request in flight is then
    surely in the middle of its generation, waiting on this stage. Once released (after the
    agent was stopped) the held step is dropped: its answer never comes, like a dead device's."""

    def __init__(self, agent: LocalAgent, at: int, *, dies: bool = True) -> None:
        """``dies``: the held step is dropped once released; else it runs then, as a slow one would."""
        self.reached = asyncio.Event()
        self._released = asyncio.Event()
        worker = agent.app[WORKER]
        relay = worker.relay
        count = 0

        async def held(frame: StepFrame, tensor: Any) -> None:
            nonlocal count
            count += 1
            if count == at:
                self.reached.set()
                await self._released.wait()
                if dies:
                    return
            await relay(frame, tensor)

        worker.relay = held  # type: ignore[method-assign]

    def release(self) -> None:
        self._released.set()


async def stop_during(agent: LocalAgent, frozen: Frozen, request: asyncio.Task[Any]) -> Any:
    """Stop ``agent`` while ``request`` waits on its frozen step; the request's outcome."""
    await eventually(frozen.reached.is_set, timeout_s=20, what="the request to reach the frozen stage")
    assert not request.done()
    stopping = asyncio.create_task(agent.runner.cleanup())
    try:
        return await asyncio.wait_for(asyncio.shield(request), timeout=15)
    finally:
        frozen.release()
        await stopping


def events_of(agent: LocalAgent, kind: str) -> list[Any]:
    return [e for e in agent.app[EVENTS].history if e.kind == kind]


def the_plan_is_as_pinned(status: dict[str, Any]) -> None:
    assert status["state"] == "ok" and status["orchestrator"] == "node-0", status
    assert status["route"] == [{"node": "node-1", "layers": [0, 1]}, {"node": "node-2", "layers": [2, 2]},
                               {"node": "node-0", "layers": [3, 3]}], status["route"]
    assert status["models"][TINY]["replicas"] == [["node-0", [0, 1]]]


def test_a_stage_lost_mid_request_is_replaced_by_the_replica_and_the_answer_is_unchanged(tmp_path):
    """The head (node-1) dies during a streamed request that entered at node-2: the replica
    on node-0 is spliced into its place, the request replays its tokens there and goes on;
    the client sees one stream with exactly the undisturbed answer."""

    async def scenario() -> None:
        store_fallback(tmp_path)
        async with tiny_cluster(tmp_path, 3, **CHAOS) as (leader, others):
            head, middle = others
            before = await cluster_status(leader)
            the_plan_is_as_pinned(before)
            undisturbed = await reference(leader.url)
            assert undisturbed["usage"]["completion_tokens"] == TOKENS, "premise: no early end of the answer"
            expected = undisturbed["choices"][0]["text"]

            frozen = Frozen(head, at=6)  # the prefill, then the 5th token's step
            request = asyncio.create_task(stream(middle.url))  # passed on to the orchestrator
            streamed = await stop_during(head, frozen, request)

            assert streamed.done and streamed.errors == [], streamed
            assert streamed.text == expected  # nothing lost, nothing repeated
            assert streamed.usage is not None and streamed.usage["completion_tokens"] == TOKENS
            assert set(streamed.models) == {TINY} and len(streamed.ids) == 1
            failovers = events_of(leader, "failover")
            assert [e.node for e in failovers] == ["node-1"], failovers  # met by the request, blamed right

            after = await cluster_status(leader)
            assert after["state"] == "ok" and after["model"] == TINY and not after["degraded"], after
            assert after["route"] == [{"node": "node-0", "layers": [0, 1]}, {"node": "node-2", "layers": [2, 2]},
                                      {"node": "node-0", "layers": [3, 3]}]  # the replica, spliced in place
            assert after["plan_version"] > before["plan_version"]
            # the workers' forwarding follows the new route
            order = next(o for o in middle.app[WORKER].status()["orders"] if o["name"] == TINY)
            assert order["route"] == after["route"] and order["plan_version"] == after["plan_version"]
            await eventually(lambda: "node-1" not in middle.app[MEMBERSHIP].alive_nodes(), timeout_s=10,
                             what="the other agents to see node-1 gone")
            again = await reference(middle.url)
            assert again["choices"][0]["text"] == expected

    asyncio.run(scenario())


def test_an_embedding_whose_stage_dies_is_read_again_on_the_new_route_and_none_is_made_by_the_fallback(tmp_path):
    """A chat model's embedding is a prefill through the route: the head (node-1) dies while
    it reads the text, the text is read again through the replica and the vector is the
    undisturbed one. Once the middle (node-2) is gone too, the fallback serves the model and
    an embedding is refused (503): it would be another model's."""

    async def scenario() -> None:
        store_fallback(tmp_path)
        async with tiny_cluster(tmp_path, 3, **CHAOS) as (leader, others):
            head, middle = others
            the_plan_is_as_pinned(await cluster_status(leader))
            body = {"model": TINY, "input": PROMPT}
            status, undisturbed = await call("POST", leader.url + "/v1/embeddings", body)
            assert status == 200, undisturbed
            expected = np.array(undisturbed["data"][0]["embedding"])
            assert expected.shape == (64,) and abs(np.linalg.norm(expected) - 1) < 1e-5

            frozen = Frozen(head, at=1)
            request = asyncio.create_task(call("POST", middle.url + "/v1/embeddings", body, timeout_s=60))
            status, again = await stop_during(head, frozen, request)
            assert status == 200, again
            np.testing.assert_allclose(again["data"][0]["embedding"], expected, atol=1e-5)
            assert [e.node for e in events_of(leader, "failover")] == ["node-1"]

            await middle.runner.cleanup()
            status, answer = await call("POST", leader.url + "/v1/completions", {
                "model": TINY, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}, timeout_s=60)
            assert status == 200 and answer["model"] == FALLBACK, answer
            status, refused = await call("POST", leader.url + "/v1/embeddings", body)
            assert status == 503 and "fallback" in refused["error"]["message"], refused

    asyncio.run(scenario())


def test_a_layer_without_a_live_holder_degrades_to_the_fallback_model(tmp_path):
    """The middle (node-2, the only holder of layer 2) dies during a streamed request: the
    request finishes on the fallback model, planned over the survivors, and says so; the
    cluster status says degraded; new requests are served by the fallback."""

    async def scenario() -> None:
        store_fallback(tmp_path)
        async with tiny_cluster(tmp_path, 3, **CHAOS) as (leader, others):
            head, middle = others
            the_plan_is_as_pinned(await cluster_status(leader))
            expected = (await reference(leader.url))["choices"][0]["text"]

            frozen = Frozen(middle, at=6)
            request = asyncio.create_task(stream(leader.url))
            streamed = await stop_during(middle, frozen, request)

            assert streamed.done and streamed.errors == [], streamed
            assert streamed.usage is not None and len(streamed.pieces) <= streamed.usage["completion_tokens"] <= TOKENS
            assert streamed.models[0] == TINY and streamed.models[-1] == FALLBACK, streamed.models
            switched = streamed.models.index(FALLBACK)
            assert 1 <= switched <= 5 and set(streamed.models[switched:]) == {FALLBACK}
            assert expected.startswith("".join(streamed.pieces[:switched]))  # what came before is the model's
            assert [e.node for e in events_of(leader, "degraded")] == ["node-2"]

            status = await cluster_status(leader)
            assert status["state"] == "degraded" and status["degraded"], status
            assert status["model"] == FALLBACK and status["main_model"] == TINY
            assert "node-2" not in route_nodes(status) and set(route_nodes(status)) <= {"node-0", "node-1"}
            assert status["models"][TINY]["serving"] == FALLBACK and status["models"][TINY]["total_layers"] == 2
            status_code, body = await call("POST", head.url + "/v1/completions", {
                "model": TINY, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
            assert status_code == 200 and body["model"] == FALLBACK, body

    asyncio.run(scenario())


def test_a_new_orchestrator_takes_over_the_running_plan_and_serves(tmp_path):
    """The orchestrator (node-0, on no hop of the route: min_layers_per_node 0) stops: the
    strongest survivor is elected with a higher epoch, takes over the plan the workers report
    (the same route, a newer plan version) and serves the same greedy answer."""

    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 3, **{**CHAOS, "min_layers_per_node": 0}) as (leader, others):
            head, tail = others
            before = await cluster_status(leader)
            assert before["route"] == [{"node": "node-1", "layers": [0, 2]}, {"node": "node-2", "layers": [3, 3]}]
            epoch = before["epoch"]
            expected = (await reference(tail.url))["choices"][0]["text"]

            await leader.runner.cleanup()

            def new_orchestrator() -> bool:
                elections = {agent.app[MEMBERSHIP].election for agent in others}
                return len(elections) == 1 and all(e is not None and e.orchestrator == "node-1" and e.epoch > epoch
                                                   for e in elections)

            await eventually(new_orchestrator, timeout_s=15, what="node-1 elected with a higher epoch")
            orchestrator = head.app[ORCHESTRATOR]
            await eventually(lambda: orchestrator.state == "ok" and TINY in orchestrator.deployments, timeout_s=20,
                             what="the new orchestrator to take over the tiny model")
            after = await cluster_status(tail)  # passed on to the new orchestrator
            assert after["orchestrator"] == "node-1" and after["state"] == "ok", after
            assert after["route"] == before["route"] and after["model"] == TINY
            # the plan taken over as the workers reported it (a new plan would put the replica on node-2)
            assert after["models"][TINY]["replicas"] == before["models"][TINY]["replicas"] == [["node-0", [0, 1]]]
            assert after["epoch"] > epoch and after["plan_version"] > before["plan_version"]
            assert sorted(after["nodes_alive"]) == ["node-1", "node-2"]
            for agent in others:  # both workers serve the order of the new epoch
                order = next(o for o in agent.app[WORKER].status()["orders"] if o["name"] == TINY)
                assert (order["epoch"], order["orchestrator"]) == (after["epoch"], "node-1")
            for agent in others:
                again = await reference(agent.url)
                assert again["choices"][0]["text"] == expected and again["model"] == TINY

    asyncio.run(scenario())


def test_without_fallback_a_lost_layer_ends_the_stream_with_an_error_and_the_model_loads_again(tmp_path):
    """No replica, no fallback: the head (node-1) dies during a streamed request; the stream ends
    with one error event in the OpenAI shape (the headers went out already) and no [DONE]; the
    model fails, and the orchestrator plans it again over the survivor by itself."""

    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, layers=4, replica_count=0, allow_fallback=False,
                                per_agent=CAPACITY[:2]) as (leader, (head,)):
            before = await cluster_status(leader)
            assert before["route"] == [{"node": "node-1", "layers": [0, 2]}, {"node": "node-0", "layers": [3, 3]}]
            frozen = Frozen(head, at=4)
            request = asyncio.create_task(stream(leader.url))
            streamed = await stop_during(head, frozen, request)

            assert not streamed.done and len(streamed.pieces) == 3 and set(streamed.models) == {TINY}, streamed
            assert len(streamed.errors) == 1, streamed.errors
            error = streamed.errors[0]
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "service_unavailable"
            assert error["code"] == "cluster_unavailable" and "have no live holder" in error["message"], error
            assert "://" not in error["message"]  # no node's address in a public error
            failed = [e for e in events_of(leader, "failover") if e.model == TINY]
            assert len(failed) == 1 and "no fallback model is allowed" in failed[0].message, failed

            async def healed() -> dict[str, Any] | None:
                status = await cluster_status(leader)
                return status if status["state"] == "ok" and status["nodes_alive"] == ["node-0"] else None

            status = await eventually(healed, timeout_s=20, what="the model planned again over the survivor")
            assert status["route"] == [{"node": "node-0", "layers": [0, 3]}] and status["model"] == TINY
            assert any(e.kind == "load" and e.model == TINY and e.time_s >= failed[0].time_s
                       for e in leader.app[EVENTS].history)
            status_code, body = await call("POST", leader.url + "/v1/completions", {
                "model": TINY, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
            assert status_code == 200 and body["model"] == TINY, body

    asyncio.run(scenario())


def test_a_node_that_stops_answering_while_it_stages_a_plan_does_not_hold_the_plan_up(tmp_path):
    """Staging an order may take minutes (weights to fetch, fragments to build), and a re-plan
    waits for every node: one found gone meanwhile (here by a failed step, as a request's
    failover finds it) ends that wait at once, instead of holding up the failovers queued
    behind the re-plan."""

    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 3, **CHAOS) as (leader, others):
            _, middle = others
            reached, never = asyncio.Event(), asyncio.Event()

            async def stuck(order: Any) -> dict[str, Any]:
                reached.set()
                await never.wait()  # frozen in the middle of staging
                return {}

            def frozen(caller_host: str | None = None) -> dict[str, Any]:
                raise RuntimeError("frozen")  # its health answers fail from now on

            middle.app[WORKER].stage = stuck  # type: ignore[method-assign]
            deployer = leader.app[ORCHESTRATOR].deployer
            sending = asyncio.create_task(deployer._send_order(middle.node_id, leader.app[WORKER].serving[TINY]))
            await eventually(reached.is_set, timeout_s=10, what="the middle to start staging")
            middle.app[MEMBERSHIP].describe = frozen  # type: ignore[method-assign]
            leader.app[MEMBERSHIP].mark_unreachable(middle.node_id)  # a request's failover found it
            with pytest.raises(PeerError, match="stopped answering while it staged"):
                await asyncio.wait_for(sending, timeout=5)
            never.set()

    asyncio.run(scenario())


def test_an_orchestrator_that_stops_lets_the_requests_it_runs_finish_first(tmp_path):
    """The orchestrator (node-0) is stopped normally (as by SIGTERM) while a streamed request
    that entered at node-2 waits on a slow step of the head: it stops listening at once, lets
    the request finish through the stages, and only then closes its links; the client gets
    the whole undisturbed answer."""

    async def scenario() -> None:
        store_fallback(tmp_path)
        async with tiny_cluster(tmp_path, 3, **CHAOS) as (leader, others):
            head, middle = others
            expected = (await reference(leader.url))["choices"][0]["text"]
            slow = Frozen(head, at=6, dies=False)
            request = asyncio.create_task(stream(middle.url))
            await eventually(slow.reached.is_set, timeout_s=20, what="the request to reach the slow step")
            stopping = asyncio.create_task(leader.runner.cleanup())

            async def refused() -> bool:
                with contextlib.suppress(aiohttp.ClientError):
                    async with aiohttp.ClientSession() as session, session.get(leader.url + "/health"):
                        return False
                return True

            await eventually(refused, timeout_s=10, what="the stopping orchestrator to stop listening")
            assert not request.done()
            slow.release()
            answer = await asyncio.wait_for(request, timeout=30)
            await stopping
            assert answer.errors == [] and answer.done, answer
            assert answer.text == expected and answer.usage["completion_tokens"] == TOKENS

    asyncio.run(scenario())
