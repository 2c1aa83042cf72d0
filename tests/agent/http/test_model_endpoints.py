"""The model endpoints (agent/http/model_endpoints.py) on two in-process agents serving copies of
the tiny model, one with an alias from a presets file: OpenAI's `/v1/models` and
`/v1/models/{model}` (names, aliases, Ollama's `:latest`), `/models` with each model's state,
`/models/load`, `/models/sleep` and `/models/unload` through the agent that passes them on
(answers, states, the `/models/sse` events they make, the bodies they refuse), `?reload=1`
finding models and aliases added since, and `?autoload=` (`autoload_of`) on a completion and,
for any value, on a small application. What `test_openai_api.py` (unknown models, sleeping an
unloaded one) and `models/test_router_inprocess.py` (eviction, sleep and wake, busy models)
cover is left out."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.http.app_keys import ROUTER, STORE
from agent.http.errors_shape import openai_errors
from agent.http.model_endpoints import autoload_of
from shards.importers.importer import import_model
from tests.agent.agents import ADMIN
from tests.agent.inprocess import LocalAgent, Loop, SseEvents, call, eventually, share_calibration
from tests.agent.tiny import TINY, tiny_cluster
from tests.shards.fragment_helpers import write_tiny_checkpoint

B = "tiny-b"
PRESETS = "[tiny]\naliases = small\n[tiny-b]\naliases = bee\n"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class Cluster:
    def __init__(self, loop: Loop, leader: LocalAgent, worker: LocalAgent, home: Path) -> None:
        self.loop, self.leader, self.worker, self.home = loop, leader, worker, home

    @property
    def agents(self) -> tuple[LocalAgent, LocalAgent]:
        return self.leader, self.worker

    def state(self, name: str) -> str:
        return self.leader.app[ROUTER].registry.entries[name].state


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    home = tmp_path_factory.mktemp("models")
    (home / "models.ini").write_text(PRESETS)
    loop = Loop()
    try:
        with pytest.MonkeyPatch.context() as patch:
            share_calibration(patch)
            leader, (worker,) = loop.enter(tiny_cluster(home, 2, names=(TINY, B), models_preset=home / "models.ini"))
            yield Cluster(loop, leader, worker, home)
    finally:
        loop.close()


async def unloaded(cluster: Cluster, name: str) -> None:
    status, answer = await call("POST", cluster.leader.url + "/models/unload", {"model": name}, headers=ADMIN)
    assert status == 200 and answer["model"]["state"] == "unloaded", answer


def openai_error(answer: Any, param: str | None, code: str | None = None) -> str:
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}, answer
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error", answer
    if code is not None:
        assert answer["error"]["code"] == code, answer
    return answer["error"]["message"]


# --- OpenAI's model list ---------------------------------------------------------------------------
def test_v1_models_lists_every_model_loaded_or_not_in_openais_shape_on_every_agent(cluster):
    async def scenario() -> None:
        await unloaded(cluster, B)
        for agent in cluster.agents:
            status, body = await call("GET", agent.url + "/v1/models")
            assert status == 200 and body == {"object": "list", "data": [
                {"id": TINY, "object": "model", "created": 0, "owned_by": "ncm"},
                {"id": B, "object": "model", "created": 0, "owned_by": "ncm"}]}, body

    cluster.loop.run(scenario())


@pytest.mark.parametrize("name, canonical", [(TINY, TINY), ("small", TINY), (f"{TINY}:latest", TINY),
                                             ("small:latest", TINY), (B, B), ("bee", B), ("bee:latest", B)])
def test_a_model_is_shown_under_its_canonical_name_whatever_it_was_asked_by(cluster, name, canonical):
    async def scenario() -> None:
        for agent in cluster.agents:
            status, body = await call("GET", agent.url + f"/v1/models/{name}")
            assert status == 200 and body == {"id": canonical, "object": "model", "created": 0, "owned_by": "ncm"}

    cluster.loop.run(scenario())


def test_an_unknown_or_overlong_model_name_is_refused_in_the_openai_shape(cluster):
    async def scenario() -> None:
        for agent in cluster.agents:
            status, answer = await call("GET", agent.url + "/v1/models/gpt-9")
            assert status == 404
            message = openai_error(answer, "model", "model_not_found")
            assert message == f"model 'gpt-9' does not exist; known models: {TINY}, {B}"
            status, answer = await call("GET", agent.url + "/v1/models/" + "m" * 257)
            assert status == 400 and "257 characters long" in openai_error(answer, "model")

    cluster.loop.run(scenario())


# --- /models and the management endpoints -----------------------------------------------------------
def test_models_shows_each_models_state_aliases_and_settings_on_every_agent(cluster):
    async def scenario() -> None:
        await unloaded(cluster, B)
        for agent in cluster.agents:
            status, body = await call("GET", agent.url + "/models")
            assert status == 200 and body["object"] == "list", body
            models = {m["id"]: m for m in body["data"]}
            assert list(models) == [TINY, B]
            tiny, b = models[TINY], models[B]
            assert (tiny["state"], tiny["serving"], tiny["degraded"], tiny["progress"]) == ("ready", TINY, False, 1.0)
            assert tiny["aliases"] == ["small"] and tiny["source"] == "preset" and tiny["store_model"] == TINY
            assert tiny["settings"]["load_on_startup"] is True and sum(tiny["memory"]["effective_bytes"].values()) > 0
            assert (b["state"], b["aliases"], b["progress"], b["active_requests"]) == ("unloaded", ["bee"], None, 0)
            assert "serving" not in b and b["settings"]["load_on_startup"] is False

    cluster.loop.run(scenario())


def test_load_sleep_and_unload_through_the_worker_answer_the_new_state_and_stream_it(cluster):
    async def scenario() -> None:
        await unloaded(cluster, B)
        events = SseEvents(cluster.worker.url)  # the orchestrator's feed, passed on by the worker
        try:
            await eventually(lambda: events.states(B) == ["unloaded"], timeout_s=10, what="the first states")
            url = cluster.worker.url + "/models/"
            for action, name, state in (("load", "bee", "ready"), ("load", B, "ready"), ("sleep", "bee", "sleeping"),
                                        ("sleep", B, "sleeping"), ("unload", f"{B}:latest", "unloaded"),
                                        ("unload", B, "unloaded")):
                status, answer = await call("POST", url + action, {"model": name}, headers=ADMIN, timeout_s=30)
                assert status == 200 and answer["success"] is True, (action, answer)
                assert answer["model"]["id"] == B and answer["model"]["state"] == state, (action, answer)
                assert cluster.state(B) == state
            status, answer = await call("POST", url + "sleep", {"model": "bee"}, headers=ADMIN)
            assert status == 400 and "only a ready model can sleep" in openai_error(answer, "model", "model_not_loaded")
            await eventually(lambda: events.states(B)[-1:] == ["unloaded"] and "sleeping" in events.states(B),
                             timeout_s=10, what="the model's events")
            states = events.states(B)
            assert states[0] == "unloaded" and states[-3:] == ["ready", "sleeping", "unloaded"], states
            assert all(data["id"] == B for data in events.changes(B))
        finally:
            await events.close()
        assert cluster.state(TINY) == "ready"  # the other model was left alone

    cluster.loop.run(scenario())


@pytest.mark.parametrize("body", [{"model": 5}, {"model": ""}, {"model": None}, {"name": TINY}, [TINY], "tiny",
                                  {"model": "m" * 257}, {"model": ["tiny"]}])
def test_management_bodies_without_a_model_name_are_refused_by_name(cluster, body):
    async def scenario() -> None:
        for agent in cluster.agents:
            for action in ("load", "unload", "sleep"):
                status, answer = await call("POST", agent.url + f"/models/{action}", body, headers=ADMIN)
                assert status == 400, (action, body, answer)
                openai_error(answer, "model")
        assert cluster.state(TINY) == "ready"

    cluster.loop.run(scenario())


def test_a_management_body_that_is_no_json_is_refused(cluster):
    async def scenario() -> None:
        async with aiohttp.ClientSession() as session, session.post(
                cluster.worker.url + "/models/load", data=b"{model: tiny}", headers=ADMIN,
                timeout=aiohttp.ClientTimeout(total=10)) as response:
            assert response.status == 400
            assert "not valid JSON" in openai_error(await response.json(), None)

    cluster.loop.run(scenario())


def test_two_model_event_streams_both_see_every_change(cluster):
    async def scenario() -> None:
        await unloaded(cluster, B)
        first, second = SseEvents(cluster.leader.url), SseEvents(cluster.leader.url)
        try:
            await eventually(lambda: first.states(B) and second.states(B), timeout_s=10, what="the first states")
            status, _ = await call("POST", cluster.leader.url + "/models/load", {"model": B}, headers=ADMIN,
                                   timeout_s=30)
            assert status == 200
            await unloaded(cluster, B)
            streams = (first, second)
            await eventually(lambda: any(s.task.done() for s in streams) or all(
                s.states(B)[-1:] == ["unloaded"] and "ready" in s.states(B) for s in streams), timeout_s=10,
                what="both streams' events, or the end of one")
            assert not any(s.task.done() for s in streams), "a stream ended"
            assert first.states(B) == second.states(B)
        finally:
            for stream in (first, second):
                with contextlib.suppress(Exception):
                    await stream.close()

    cluster.loop.run(scenario())


# --- autoload ---------------------------------------------------------------------------------------
def test_autoload_in_the_query_says_whether_a_completion_may_load_its_model(cluster):
    async def complete(query: str) -> tuple[int, Any]:
        return await call("POST", cluster.worker.url + f"/v1/completions{query}", {
            "model": "bee", "prompt": "w7", "max_tokens": 1}, timeout_s=30)

    async def scenario() -> None:
        await unloaded(cluster, B)
        for value in ("false", "OFF", "0", "No"):
            status, answer = await complete(f"?autoload={value}")
            assert status == 400, answer
            assert "autoload is off" in openai_error(answer, "model", "model_not_loaded")
        for query in ("?autoload=perhaps", "?autoload=", "?autoload", "?autoload=ja"):
            status, answer = await complete(query)
            assert status == 400 and openai_error(answer, "autoload") == "autoload must be true or false", answer
        assert cluster.state(B) == "unloaded"
        status, answer = await complete("?autoload=Yes")
        assert status == 200 and answer["model"] == B and answer["usage"]["completion_tokens"] == 1, answer
        assert cluster.state(B) == "ready"
        await unloaded(cluster, B)
        status, answer = await complete("")  # absent: the agent's models_autoload (on)
        assert status == 200 and cluster.state(B) == "ready", answer
        await unloaded(cluster, B)

    cluster.loop.run(scenario())


@contextlib.asynccontextmanager
async def autoload_app() -> AsyncIterator[str]:
    """A small application answering what `autoload_of` reads of its query."""
    async def read(request: web.Request) -> web.Response:
        return web.json_response({"autoload": autoload_of(request)})

    app = web.Application(middlewares=[openai_errors])
    app.router.add_get("/", read)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield "http://127.0.0.1:%d/" % runner.addresses[0][1]
    finally:
        await runner.cleanup()


@pytest.fixture(scope="module")
def autoload_url() -> Iterator[tuple[Loop, str]]:
    loop = Loop()
    try:
        yield loop, loop.enter(autoload_app())
    finally:
        loop.close()


def any_case(words: tuple[str, ...]) -> st.SearchStrategy[str]:
    return st.tuples(st.sampled_from(words), st.lists(st.booleans(), min_size=5, max_size=5)).map(
        lambda pair: "".join(c.upper() if up else c for c, up in zip(pair[0], pair[1])))


@settings(max_examples=80, deadline=None)
@given(value=any_case(TRUE) | any_case(FALSE) | st.text(st.characters(blacklist_categories=("Cs",)), max_size=8))
def test_autoload_is_true_or_false_in_any_case_and_anything_else_is_refused(autoload_url, value):
    loop, url = autoload_url

    async def ask() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as session, session.get(
                url, params={"autoload": value}, timeout=aiohttp.ClientTimeout(total=10)) as response:
            return response.status, await response.json()

    status, answer = loop.run(ask())
    if value.lower() in TRUE + FALSE:
        assert status == 200 and answer == {"autoload": value.lower() in TRUE}
    else:
        assert status == 400 and openai_error(answer, "autoload") == "autoload must be true or false"


def test_without_autoload_in_the_query_the_agent_decides(autoload_url):
    loop, url = autoload_url
    assert loop.run(call("GET", url)) == (200, {"autoload": None})
    assert loop.run(call("GET", url + "?autoload=off&autoload=on")) == (200, {"autoload": False})  # the first counts
    assert loop.run(call("GET", url + "?other=1")) == (200, {"autoload": None})


# --- reload (last: it adds models) ------------------------------------------------------------------
def test_a_reload_lists_models_imported_and_aliases_added_since(cluster, tmp_path):
    source = write_tiny_checkpoint(tmp_path / "checkpoint", seed=3)

    async def listed(agent: LocalAgent, query: str = "", headers: dict[str, str] | None = None) -> list[str]:
        status, body = await call("GET", agent.url + "/models" + query, headers=headers)
        assert status == 200, body
        return [m["id"] for m in body["data"]]

    async def scenario() -> None:
        store = cluster.leader.app[STORE]
        await asyncio.to_thread(import_model, source, name="tiny-c", store=store, progress=False)
        assert await listed(cluster.worker) == [TINY, B]  # nothing re-read the stores yet
        status, answer = await call("GET", cluster.worker.url + "/models?reload=1")
        assert status == 401, answer
        assert await listed(cluster.worker, "?reload=1", ADMIN) == [TINY, B, "tiny-c"]
        status, body = await call("GET", cluster.leader.url + "/v1/models/tiny-c")
        assert status == 200 and body["id"] == "tiny-c"
        assert cluster.state("tiny-c") == "unloaded"

        (cluster.home / "models.ini").write_text(PRESETS + "[tiny-c]\naliases = cee\n")
        assert (await call("GET", cluster.worker.url + "/v1/models/cee"))[0] == 404  # the file is read on reload
        assert await listed(cluster.leader, "?reload=true", ADMIN) == [TINY, B, "tiny-c"]
        status, body = await call("GET", cluster.worker.url + "/v1/models/cee")
        assert status == 200 and body["id"] == "tiny-c", body

        await asyncio.to_thread(import_model, source, name="tiny-d", store=store, progress=False)
        status, body = await call("GET", cluster.worker.url + "/v1/models/tiny-d")  # one more look at the stores
        assert status == 200 and body["id"] == "tiny-d", body

    cluster.loop.run(scenario())
