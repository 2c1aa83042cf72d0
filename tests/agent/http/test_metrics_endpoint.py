"""`/metrics` in Prometheus' format and `/cluster/events`, on a 3-agent loopback cluster
serving the tiny model: the output parses with prometheus_client's parser, the counters move
as requests run, and loads, sleeps, a lost node and its failover show as events and counts."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from agent.http.app_keys import ADMIN_TOKEN, EVENTS, MEMBERSHIP
from agent.local.events import EventLog
from agent.local.metrics import ClusterStateCollector, Metrics
from tests.agent.inprocess import LocalAgent, call, eventually
from tests.agent.tiny import TINY, tiny_cluster


async def scrape(agent: LocalAgent) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the agent's /metrics: (name, sorted labels) -> value."""
    async with aiohttp.ClientSession() as session, session.get(agent.url + "/metrics") as response:
        assert response.status == 200 and response.content_type == "text/plain"
        text = await response.text()
    samples = {}
    for family in text_string_to_metric_families(text):  # raises on anything that is not the format
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: dict, name: str, **labels: str) -> float:
    """The sum of ``name`` over every sample whose labels include ``labels``."""
    return sum(v for (n, l), v in samples.items() if n == name and set(labels.items()) <= set(l))


async def read_events(response: aiohttp.ClientResponse, events: list[dict[str, Any]]) -> None:
    async for line in response.content:
        if line.startswith(b"data: "):
            events.append(json.loads(line[6:]))


def test_metrics_move_with_requests_and_cluster_events_are_streamed(tmp_path):
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 3, layers=4) as (leader, others):
            assert leader.app[MEMBERSHIP].agents_on_host() == 3  # all on loopback: they share the cores
            before = await scrape(leader)
            assert value(before, "ncm_is_orchestrator") == 1.0 and value(before, "ncm_nodes_alive") == 3.0
            assert value(before, "ncm_model_state", model=TINY, state="ready") == 1.0
            assert total(before, "ncm_model_loads_total", model=TINY, outcome="loaded") == 1.0
            assert total(before, "ncm_model_memory_bytes", model=TINY) > 0

            for stream in (False, True):  # one answered here, one handed over by another agent
                status, _ = await call("POST", (others[0] if stream else leader).url + "/v1/chat/completions", {
                    "model": TINY, "messages": [{"role": "user", "content": "w7 w8"}], "max_tokens": 5,
                    "temperature": 0, "stream": stream})
                assert status == 200
            after = await scrape(leader)
            assert value(after, "ncm_requests_total", endpoint="/v1/chat/completions", model=TINY, status="200") == 2
            assert value(after, "ncm_generated_tokens_total", model=TINY) - value(before, "ncm_generated_tokens_total",
                                                                                   model=TINY) == 10
            assert value(after, "ncm_time_to_first_token_seconds_count", model=TINY) == 2
            assert value(after, "ncm_token_latency_seconds_count", model=TINY) == 8
            assert value(after, "ncm_prompt_tokens_total", model=TINY) > 0
            handed_over = await scrape(others[0])
            assert value(handed_over, "ncm_requests_total", endpoint="/v1/chat/completions", model=TINY,
                         status="200") == 1
            assert value(handed_over, "ncm_is_orchestrator") == 0.0
            # every stage computed, and the orchestrator timed each step through the route
            stages = [await scrape(agent) for agent in (leader, *others)]
            assert all(total(s, "ncm_stage_compute_seconds_count", model=TINY) > 0 for s in stages)
            assert value(after, "ncm_step_seconds_count", model=TINY) >= 10  # a prefill step, then one a token
            # a name that is no model's is not a label (the label values stay a bounded set)
            status, _ = await call("POST", leader.url + "/v1/chat/completions", {
                "model": "nope", "messages": [{"role": "user", "content": "w7"}]})
            assert status == 404
            refused = await scrape(leader)
            assert value(refused, "ncm_requests_total", endpoint="/v1/chat/completions", model="", status="404") == 1
            assert not any(("model", "nope") in labels for _, labels in refused)

            # events: the history (elections, joins, the load), then a sleep asked for now
            events: list[dict[str, Any]] = []
            async with aiohttp.ClientSession() as session, session.get(others[1].url + "/cluster/events") as response:
                assert response.status == 200 and response.content_type == "text/event-stream"
                reader = asyncio.create_task(read_events(response, events))
                await eventually(lambda: {"election", "join", "load"} <= {e["kind"] for e in events}, timeout_s=10,
                                 what="the recent history")
                token = {"Authorization": f"Bearer {leader.app[ADMIN_TOKEN]}"}
                assert (await call("POST", others[1].url + "/models/sleep", {"model": TINY}))[0] == 401
                status, answer = await call("POST", others[1].url + "/models/sleep", {"model": TINY}, headers=token)
                assert status == 200 and answer["model"]["state"] == "sleeping", answer
                await eventually(lambda: any(e["kind"] == "sleep" and e["model"] == TINY for e in events), timeout_s=10,
                                 what="the sleep event")
                reader.cancel()
            slept = await scrape(leader)
            assert total(slept, "ncm_model_stops_total", model=TINY, how="sleep") == 1
            assert value(slept, "ncm_model_stop_seconds_count", how="sleep") == 1
            assert value(slept, "ncm_model_state", model=TINY, state="sleeping") == 1.0

            # a lost node: its death is an event, counted (the model woken first, on all three)
            status, _ = await call("POST", leader.url + "/v1/completions", {"model": TINY, "prompt": "w7", "max_tokens": 2})
            assert status == 200
            await others[1].runner.cleanup()
            await eventually(lambda: any(e.kind == "death" for e in leader.app[EVENTS].history), timeout_s=15,
                             what="the lost node's death event")
            dead = await scrape(leader)
            assert total(dead, "ncm_cluster_events_total", kind="death") >= 1
            assert value(dead, "ncm_nodes_alive") == 2.0

            # the next request finds a stage gone: the failover (here: no replica of its layers
            # and no fallback model, so it fails) is an event and a count
            status, _ = await call("POST", leader.url + "/v1/completions", {"model": TINY, "prompt": "w7", "max_tokens": 2})
            assert status in (200, 503)
            await eventually(lambda: any(e.kind in ("failover", "degraded") for e in leader.app[EVENTS].history),
                             timeout_s=30, what="the failover event")
            assert value(await scrape(leader), "ncm_failovers_total", model=TINY) >= 1

    asyncio.run(scenario())


def test_degraded_seconds_count_the_time_a_model_was_served_by_its_fallback():
    """Accounted at each cluster event (a change is always one) and each scrape."""
    now = [100.0]
    degraded: set[str] = set()
    metrics = Metrics(clock=lambda: now[0])
    state = ClusterStateCollector(
        models=list, degraded=lambda: set(degraded), worker_status=dict, device_memory=dict, alive_nodes=lambda: 1,
        is_orchestrator=lambda: False, clock=lambda: now[0])
    metrics.registry.register(state)
    events = EventLog(clock=lambda: now[0])
    events.listen(metrics.count_event)
    events.listen(state.account)

    now[0] += 5.0  # ok for 5 s, then degraded
    degraded.add("m")
    events.record("degraded", "m: serving m-tiny", model="m", duration_s=1.5)
    now[0] += 7.0
    assert metrics.registry.get_sample_value("ncm_degraded_seconds_total", {"model": "m"}) == 7.0  # a scrape
    now[0] += 3.0  # planned whole again
    degraded.clear()
    events.record("recovered", "re-planned m", model="m")
    now[0] += 50.0
    assert metrics.registry.get_sample_value("ncm_degraded_seconds_total", {"model": "m"}) == 10.0
    assert metrics.registry.get_sample_value("ncm_failovers_total", {"model": "m"}) == 1.0
    assert metrics.registry.get_sample_value("ncm_failover_seconds_sum", {"model": "m"}) == 1.5
    assert metrics.registry.get_sample_value("ncm_replans_total", {"model": "m"}) == 1.0
