"""Whole copies (design §11), on three in-process agents serving the tiny model: a preset with
``placement = replicas`` gives every node every layer; requests arriving together spread over
the copies, each answering what the split model answers (a request alone runs on the
orchestrator's own copy), and each copy runs as many at once as its own KV memory holds; ``auto``
(the default placement) puts copies on the nodes with room for one, and on no other; the next
turn of a conversation goes back to the copy that keeps its prompt; a copy that stops (its
sockets close) leaves its request to another copy, which replays it, and a copy that stops
between requests is passed by."""

from __future__ import annotations

import asyncio

from agent.core.admission import AUTO_MOST_REQUESTS_IN_FLIGHT
from agent.http.app_keys import METRICS, ORCHESTRATOR, ROUTER
from tests.agent.inprocess import LocalAgent, call, eventually
from tests.agent.models.test_router_inprocess import HeldModel
from tests.agent.tiny import TINY, tiny_cluster

COPIES = "tiny-copies"
AUTO = "tiny-auto"
PRESETS = f"[{COPIES}]\nmodel = {TINY}\nplacement = replicas\n[{AUTO}]\nmodel = {TINY}\nplacement = auto\n"
PROMPTS = [" ".join(f"w{(7 * i + 3 * j) % 90 + 5}" for j in range(40)) for i in range(6)]


async def complete(agent: LocalAgent, model: str, prompt: str, max_tokens: int = 24) -> str:
    status, body = await call("POST", agent.url + "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}, timeout_s=60)
    assert status == 200, body
    return body["choices"][0]["text"]


def steps_run(agent: LocalAgent, model: str) -> float:
    registry = agent.app[METRICS].registry
    return registry.get_sample_value("ncm_stage_compute_seconds_count", {"model": model}) or 0.0


def test_requests_spread_over_whole_copies_and_a_stopped_copy_hands_its_request_on(tmp_path):
    presets = tmp_path / "models.ini"
    presets.write_text(PRESETS)

    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 3, layers=4, models_preset=presets) as (leader, others):
            agents = [leader, *others]
            split = [await complete(leader, TINY, p) for p in PROMPTS]
            assert await complete(leader, COPIES, PROMPTS[0]) == split[0]
            # a request alone runs on the orchestrator's own copy: no network at its tokens
            before = {a.node_id: steps_run(a, COPIES) for a in agents}
            assert await complete(leader, COPIES, PROMPTS[2]) == split[2]
            assert [steps_run(a, COPIES) > before[a.node_id] for a in agents] == [True, False, False]
            deployment = leader.app[ORCHESTRATOR].deployments[COPIES]
            assert len(deployment.order.route.hops) == 1 and len(deployment.order.copies) == 2
            assert set(deployment.serving_nodes()) == {a.node_id for a in agents}
            # each request holds a KV cache on one copy alone: three copies run three times the requests
            limits = leader.app[ROUTER].admission.limits_of
            assert limits(TINY).max_requests_in_flight == AUTO_MOST_REQUESTS_IN_FLIGHT
            assert limits(COPIES).max_requests_in_flight == 3 * AUTO_MOST_REQUESTS_IN_FLIGHT
            assert deployment.copy_sessions == {a.node_id: AUTO_MOST_REQUESTS_IN_FLIGHT for a in agents}
            status, body = await call("GET", leader.url + "/cluster/status", None, timeout_s=30)
            assert status == 200 and body["models"][COPIES]["max_requests_per_copy"] == deployment.copy_sessions
            assert body["models"][TINY]["max_requests_per_copy"] == {}

            held = HeldModel(leader, COPIES)  # six requests start together: two on each copy
            before = {a.node_id: steps_run(a, COPIES) for a in agents}
            answers = [asyncio.create_task(complete(leader, COPIES, p)) for p in PROMPTS]
            await eventually(lambda: held.started == len(PROMPTS), timeout_s=30, what="every request admitted")
            held.release()
            assert await asyncio.gather(*answers) == split
            assert all(steps_run(a, COPIES) > before[a.node_id] for a in agents), "a copy ran nothing"

            # a copy whose memory holds more caches takes more requests: six long ones at once
            requests = leader.app[ORCHESTRATOR].requests
            small, large = deployment.serving_nodes()[:2], deployment.serving_nodes()[2]
            deployment.copy_sessions = {**{node: 1 for node in small}, large: 4}
            held = HeldModel(leader, COPIES)
            running = [asyncio.create_task(complete(leader, COPIES, p, max_tokens=300)) for p in PROMPTS]
            await eventually(lambda: held.started == len(PROMPTS), timeout_s=30, what="every request admitted")
            held.release()
            await eventually(lambda: sum(requests._on_node.values()) == len(PROMPTS), timeout_s=30,
                             what="every request on a copy")
            assert dict(requests._on_node) == deployment.copy_sessions
            for answer, expected in zip(await asyncio.gather(*running), split):
                assert answer.startswith(expected)
            deployment.copy_sessions = {a.node_id: AUTO_MOST_REQUESTS_IN_FLIGHT for a in agents}

            # the next turn goes back to where its prompt is kept
            kept = {k.sid: k.node for k in leader.app[ORCHESTRATOR].requests.kept(COPIES)}
            assert len(set(kept.values())) == 3
            status, body = await call("POST", leader.url + "/v1/completions", {
                "model": COPIES, "prompt": PROMPTS[4] + " " + split[4] + " w7 w8", "max_tokens": 4,
                "temperature": 0}, timeout_s=60)
            assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 40, body

            # auto: a whole copy on every node with room for one (here all)
            assert await complete(leader, AUTO, PROMPTS[1]) == split[1]
            assert len(leader.app[ORCHESTRATOR].deployments[AUTO].order.copies) == 2

            # a copy stops while its request runs: another copy replays it and answers the same
            held = HeldModel(leader, COPIES)
            running = [asyncio.create_task(complete(leader, COPIES, p, max_tokens=300)) for p in PROMPTS[:3]]
            await eventually(lambda: held.started == 3, timeout_s=30, what="three requests admitted")
            held.release()
            await eventually(lambda: len(requests._on_node) == 3, timeout_s=30, what="a request on each copy")
            victim = next(a for a in others if a.node_id in deployment.order.copies)
            await victim.runner.cleanup()
            for answer, expected in zip(await asyncio.gather(*running), split):
                assert answer.startswith(expected)
            for prompt, answer in zip(PROMPTS, split):  # the stopped copy is passed by
                assert await complete(leader, COPIES, prompt) == answer

    asyncio.run(scenario())


def test_the_default_placement_puts_a_whole_copy_on_every_node_with_room_for_one_and_none_elsewhere(tmp_path):
    async def scenario() -> None:
        # node-2 reports less memory than the margin every node keeps free: no room for a copy
        async with tiny_cluster(tmp_path, 3, layers=4, default_placement="auto", replan_min_interval_s=0.0,
                                per_agent=[{}, {}, {"ram_gib": 0.1}]) as (leader, _):
            orchestrator = leader.app[ORCHESTRATOR]
            serving = await eventually(lambda: len(nodes := orchestrator.deployments[TINY].serving_nodes()) == 2
                                       and nodes, timeout_s=60, what="copies on the two nodes with room")
            assert set(serving) == {"node-0", "node-1"}
            answer = await complete(leader, TINY, PROMPTS[0])
            assert answer and await complete(leader, TINY, PROMPTS[0]) == answer
            assert set(orchestrator.deployments[TINY].serving_nodes()) == {"node-0", "node-1"}

    asyncio.run(scenario())
