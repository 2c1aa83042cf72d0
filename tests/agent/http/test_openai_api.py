"""The public API's errors on a live model, in the OpenAI shape ({"error": {"message", "type",
"param", "code"}}), on two in-process agents serving the tiny model: on the orchestrator and
through the agent that passes requests on to it. What `test_bodies.py` (unreadable bodies),
`test_app_keys.py` (401), `models/test_admission_gate.py` (429), the router tests (503 model_capacity, 409
model_busy) and the orchestrator tests (an error inside a stream) leave out: unknown models,
requests a loaded model cannot take, the model management endpoints' refusals; and the agents
serve on afterwards."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from agent.http.app_keys import ADMIN_TOKEN, ORCHESTRATOR, ROUTER
from tests.agent.inprocess import call
from tests.agent.tiny import TINY, tiny_cluster

B = "tiny-b"
CONTEXT = 32
CHAT = [{"role": "user", "content": "w7 w8"}]
LONG_PROMPT = " ".join(f"w{10 + i}" for i in range(CONTEXT + 4))  # one word, one token: beyond the context
# (path, body, status, code, param, a part of the message)
CASES = [
    ("/v1/chat/completions", {"model": "gpt-9", "messages": CHAT}, 404, "model_not_found", "model",
     "model 'gpt-9' does not exist; known models: tiny, tiny-b"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "w7"}, 404, "model_not_found", "model", "known models: tiny, tiny-b"),
    ("/v1/completions?autoload=false", {"model": B, "prompt": "w7"}, 400, "model_not_loaded", "model",
     "is not loaded (unloaded) and autoload is off"),
    ("/v1/completions?autoload=perhaps", {"model": TINY, "prompt": "w7"}, 400, None, "autoload", "true or false"),
    ("/v1/completions", {"model": TINY, "prompt": LONG_PROMPT}, 400, "context_length_exceeded", "prompt",
     f"the context holds {CONTEXT}; shorten it"),
    ("/v1/chat/completions", {"model": TINY, "messages": [{"role": "user", "content": LONG_PROMPT}]}, 400,
     "context_length_exceeded", "messages", f"the context holds {CONTEXT}"),
    ("/v1/chat/completions", {"model": TINY, "messages": CHAT, "temperature": 7}, 400, None, "temperature", ""),
    ("/v1/chat/completions", {"model": TINY, "messages": CHAT, "n": 3}, 400, None, "n", ""),
    ("/v1/chat/completions", {"model": TINY, "messages": CHAT, "max_tokens": -1}, 400, None, "max_tokens", ""),
    ("/v1/chat/completions", {"model": TINY, "messages": [{"role": "wizard", "content": "w7"}]}, 400, None,
     "messages[0].role", ""),
    ("/v1/chat/completions", {"model": TINY, "messages": []}, 400, None, "messages", ""),
    ("/models/load", {"model": "gpt-9"}, 404, "model_not_found", "model", "known models: tiny, tiny-b"),
    ("/models/load", {"modle": TINY}, 400, None, "model", '{"model": "<name or alias>"}'),
    ("/models/sleep", {"model": B}, 400, "model_not_loaded", "model", "only a ready model can sleep"),
]


def openai_error(answer: dict, status: int, code: str | None, param: str | None, message: str) -> None:
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}, answer
    error = answer["error"]
    assert error["type"] == {400: "invalid_request_error", 404: "invalid_request_error", 409: "invalid_request_error",
                             503: "service_unavailable"}[status], error
    assert error["param"] == param and message in error["message"], error
    if code is not None:
        assert error["code"] == code, error


def test_requests_a_live_model_cannot_take_get_4xx_in_the_openai_shape_on_every_agent(tmp_path):
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, names=(TINY, B), max_context=CONTEXT, prefill_chunk=CONTEXT) \
                as (leader, others):
            admin = {"Authorization": f"Bearer {leader.app[ADMIN_TOKEN]}"}
            for agent in (leader, *others):
                for path, body, status, code, param, message in CASES:
                    got, answer = await call("POST", agent.url + path, body, headers=admin)
                    assert got == status, (agent.node_id, path, body, answer)
                    openai_error(answer, status, code, param, message)
            # nothing was loaded or changed by them, and the agents serve on
            assert leader.app[ROUTER].registry.entries[B].state == "unloaded"
            for agent in (leader, *others):
                status, body = await call("POST", agent.url + "/v1/chat/completions", {
                    "model": TINY, "messages": CHAT, "max_tokens": 3, "temperature": 0})
                assert status == 200 and body["usage"]["completion_tokens"] == 3, body

    asyncio.run(scenario())


def test_a_failure_of_the_orchestrator_itself_mid_stream_ends_the_stream_with_an_error_event(tmp_path):
    """A bug in the orchestrator after the headers went out (here: its generation raises after
    the first piece) ends the stream with one error event in the OpenAI shape, at once, also
    through the agent that passed the request on (which does not wait for another orchestrator)."""
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2) as (leader, others):
            orchestrator = leader.app[ORCHESTRATOR]
            complete = orchestrator.complete

            async def broken(*args, **kwargs):
                async for event in complete(*args, **kwargs):
                    yield event
                    raise RuntimeError("a bug")

            orchestrator.complete = broken  # fault injection: the API's handling is what is tested
            for agent in (leader, others[0]):
                started = time.monotonic()
                events = []
                async with aiohttp.ClientSession() as session, session.post(agent.url + "/v1/completions", json={
                        "model": TINY, "prompt": "w7 w8", "max_tokens": 8, "stream": True,
                        "temperature": 0}) as response:
                    assert response.status == 200
                    async for raw in response.content:
                        if raw.startswith(b"data: "):
                            events.append(raw[6:].strip())
                assert time.monotonic() - started < 10
                assert events[-1] != b"[DONE]", events
                error = json.loads(events[-1])["error"]
                assert error == {"message": "internal error (RuntimeError; the orchestrator's log has the details)",
                                 "type": "server_error", "param": None, "code": "internal_error"}, error

    asyncio.run(scenario())
