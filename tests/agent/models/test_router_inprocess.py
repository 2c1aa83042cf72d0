"""The model router on two in-process agents serving copies of the tiny model, in seconds: the
in-process tier of `test_router.py`.

- with ``models_max`` reached, a load evicts the least recently used idle model, never one
  serving a request (even when it is the least recently used), and refuses when every loaded
  model is busy;
- `POST /models/sleep` frees a ready model's memory on every worker and keeps its plan: the
  next request wakes it without measuring again, on the same route, with the same answer; a
  model serving a request is neither put to sleep nor unloaded (409 model_busy);
- `GET /models/sse` (read through the agent that is not the orchestrator) streams each
  model's state changes in order.

A request is kept in flight by holding its generation on the orchestrator (see
:class:`HeldModel`); everything else is the real path.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from agent.http.app_keys import ADMIN_TOKEN, ORCHESTRATOR, ROUTER, WORKER
from tests.agent.inprocess import LocalAgent, SseEvents, call, eventually
from tests.agent.tiny import TINY, tiny_cluster

B, C = "tiny-b", "tiny-c"
RAM = {"ram_gib": 2.0}  # a memory budget of its own on every agent: only models_max decides


@contextlib.asynccontextmanager
async def sse(url: str, models: tuple[str, ...]) -> AsyncIterator[SseEvents]:
    events = SseEvents(url)
    try:
        await eventually(lambda: all(events.states(m) for m in models), timeout_s=10, what="every model's first state")
        yield events
    finally:
        await events.close()


class HeldModel:
    """Holds every generation of model ``name`` on the orchestrator until released: its
    requests stay in flight (the model is busy) while others run."""

    def __init__(self, orchestrator: LocalAgent, name: str) -> None:
        self.name = name
        self.started = 0
        self._released = asyncio.Event()
        target = orchestrator.app[ORCHESTRATOR]
        complete = target.complete

        async def held(deployment: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            if deployment.name == self.name:
                self.started += 1
                await self._released.wait()
            async for event in complete(deployment, *args, **kwargs):
                yield event

        target.complete = held  # type: ignore[method-assign]

    def release(self) -> None:
        self._released.set()


async def ask(agent: LocalAgent, model: str, prompt: str = "w5 w6", max_tokens: int = 3) -> tuple[int, dict[str, Any]]:
    return await call("POST", agent.url + "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}, timeout_s=30)


async def served(agent: LocalAgent, model: str, prompt: str = "w5 w6", max_tokens: int = 3) -> str:
    status, body = await ask(agent, model, prompt, max_tokens)
    assert status == 200 and body["model"] == model, body
    return body["choices"][0]["text"]


def test_a_load_evicts_the_least_recently_used_idle_model_and_never_a_busy_one(tmp_path):
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, names=(TINY, B, C), models_max=2, **RAM) as (leader, (other,)):
            registry = leader.app[ROUTER].registry
            async with sse(other.url, (TINY, B, C)) as events:
                assert [events.states(m) for m in (TINY, B, C)] == [["ready"], ["unloaded"], ["unloaded"]]
                await served(other, B)  # two loaded: models_max is reached
                await served(leader, TINY)  # used last: B is the least recently used
                mark = len(events.items)
                await served(other, C)
                await events.reach(C, "ready", after=mark)
                assert events.states(B, after=mark) == ["unloaded"]  # B went, not TINY
                assert events.changes(B, after=mark)[-1]["detail"] == f"evicted for {C}"
                assert events.states(C, after=mark) == ["measuring", "loading", "ready"]
                assert events.states(TINY, after=mark) in ([], ["ready"])  # never left ready
                assert {n for n, e in registry.entries.items() if e.state == "ready"} == {TINY, C}

                # C busy (and now the least recently used), TINY idle: loading B evicts TINY
                held_c = HeldModel(leader, C)
                busy_c = asyncio.create_task(ask(other, C))
                await eventually(lambda: held_c.started == 1, timeout_s=10, what="a request in flight on C")
                await served(leader, TINY)
                assert registry.entries[C].last_used_s < registry.entries[TINY].last_used_s
                mark = len(events.items)
                await served(other, B)
                await events.reach(B, "ready", after=mark)
                assert events.states(TINY, after=mark) == ["unloaded"]
                assert events.changes(TINY, after=mark)[-1]["detail"] == f"evicted for {B}"
                assert events.states(C, after=mark) in ([], ["ready"]) and not busy_c.done()

                # every loaded model busy: nothing can be evicted, the load is refused at once
                held_b = HeldModel(leader, B)
                busy_b = asyncio.create_task(ask(leader, B))
                await eventually(lambda: held_b.started == 1, timeout_s=10, what="a request in flight on B")
                mark = len(events.items)
                status, body = await ask(other, TINY)
                assert status == 503 and body["error"]["code"] == "model_capacity", body
                assert set(body["error"]) == {"message", "type", "param", "code"}
                assert "models_max=2 is reached by models that cannot be evicted" in body["error"]["message"]
                await eventually(lambda: any(k == "load_refused" and d["model"] == TINY for k, d in events.items[mark:]),
                                 timeout_s=10, what="the load_refused event")
                assert events.states(B, after=mark) in ([], ["ready"]) and events.states(C, after=mark) in ([], ["ready"])

                held_b.release()
                held_c.release()
                for busy in (busy_b, busy_c):
                    status, body = await busy
                    assert status == 200 and body["usage"]["completion_tokens"] == 3, body  # never cut
                assert {n for n, e in registry.entries.items() if e.state == "ready"} == {B, C}

    asyncio.run(scenario())


def test_an_idle_model_put_to_sleep_frees_its_memory_and_the_next_request_wakes_it_on_the_same_plan(tmp_path):
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, **RAM) as (leader, (other,)):
            agents = (leader, other)
            admin = {"Authorization": f"Bearer {leader.app[ADMIN_TOKEN]}"}
            answer = await served(other, TINY, max_tokens=6)
            _, status = await call("GET", leader.url + "/cluster/status")
            route, version = status["route"], status["plan_version"]
            assert all(TINY in agent.app[WORKER].status()["models"] for agent in agents)  # both stages hold it

            # busy: no preemption, a 409 in the OpenAI shape on either agent; the request is not cut
            held = HeldModel(leader, TINY)
            busy = asyncio.create_task(ask(other, TINY))
            await eventually(lambda: held.started == 1, timeout_s=10, what="a request in flight")
            for path in ("/models/sleep", "/models/unload"):
                for agent in agents:
                    code, body = await call("POST", agent.url + path, {"model": TINY}, headers=admin)
                    assert code == 409 and set(body["error"]) == {"message", "type", "param", "code"}, body
                    assert body["error"]["code"] == "model_busy" and body["error"]["param"] == "model"
                    assert "1 request(s) in flight" in body["error"]["message"]
                    assert f"cannot be {'put to sleep' if path.endswith('sleep') else 'unloaded'}" in body["error"]["message"]
                    assert "retry when it is idle" in body["error"]["message"]
            held.release()
            code, body = await busy
            assert code == 200 and body["usage"]["completion_tokens"] == 3, body

            async with sse(other.url, (TINY,)) as events:
                mark = len(events.items)
                code, body = await call("POST", other.url + "/models/sleep", {"model": TINY}, headers=admin)
                assert code == 200 and body["success"] and body["model"]["state"] == "sleeping", body
                assert body["model"]["memory"]["effective_bytes"] == {}
                await events.reach(TINY, "sleeping", after=mark)
                assert events.states(TINY, after=mark) == ["sleeping"]
                assert events.changes(TINY, after=mark)[-1]["detail"] == "put to sleep on request"
                for agent in agents:  # every worker let go of its fragments
                    report = agent.app[WORKER].status()
                    assert TINY not in report["models"] and report["fragments"] == [], report
                code, body = await call("POST", other.url + "/models/sleep", {"model": TINY}, headers=admin)
                assert code == 200 and body["model"]["state"] == "sleeping"  # asleep already: nothing changes

                mark = len(events.items)
                assert await served(other, TINY, max_tokens=6) == answer  # wakes it
                await events.reach(TINY, "ready", after=mark)
                assert events.states(TINY, after=mark) == ["loading", "ready"]  # the kept plan: no measuring
            _, status = await call("GET", other.url + "/cluster/status")
            assert status["route"] == route and status["plan_version"] > version
            assert all(TINY in agent.app[WORKER].status()["models"] for agent in agents)

    asyncio.run(scenario())


def test_a_model_stored_only_on_another_node_loads_within_its_own_context(tmp_path):
    """The orchestrator (node-1) stores nothing; the tiny model (trained for 256 positions) is
    on node-0 alone, and the agents' max_context is the default 2048: the model's context is
    read from its manifest, fetched from node-0, before it is measured."""
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, per_agent=[{}, {"orchestrator": True}]) as (leader, _):
            assert leader.node_id == "node-1"
            assert leader.app[ROUTER].presets[TINY].settings.max_context == 256
            status, answer = await call("POST", leader.url + "/v1/completions",
                                        {"model": TINY, "prompt": "w7 w8", "max_tokens": 3, "temperature": 0})
            assert status == 200 and answer["usage"]["completion_tokens"] == 3, answer

    asyncio.run(scenario())


def test_a_model_loaded_at_start_and_unloaded_before_its_loader_looks_stays_unloaded(tmp_path):
    """The main model loads again at start once its deployment is lost; an unload that comes
    the moment it is ready (before the waiter of that load wakes) is not undone by a second
    load, nor by the next change of members."""

    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 1) as (leader, _):
            router = leader.app[ROUTER]
            await router.unload(TINY)
            unloads: list[asyncio.Task[Any]] = []
            loaded = router.registry.loaded

            def then_unload(name: str, *args: Any, **kwargs: Any) -> None:
                loaded(name, *args, **kwargs)
                if name == TINY and not unloads:  # before the scheduler wakes the waiters of the load
                    unloads.append(asyncio.create_task(router.unload(TINY)))

            router.registry.loaded = then_unload  # type: ignore[method-assign]
            router.on_deployment(TINY, None, "its stage died")  # a model that must run: loaded again at once
            await eventually(lambda: unloads and unloads[0].done(), timeout_s=60, what="the load and the unload")
            await unloads[0]
            router.on_members(frozenset())  # members change: nothing loads it again
            assert router.registry.find(TINY) is None
            assert router.registry.entries[TINY].state == "unloaded"

    asyncio.run(scenario())
