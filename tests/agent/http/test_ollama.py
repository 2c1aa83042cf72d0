"""Ollama's API, driven by the official `ollama` Python client against a 3-agent loopback
cluster serving the tiny model: list, show, ps, chat and generate with and without
streaming, options, keep_alive, an unknown model and a bad option. The greedy text equals
the OpenAI endpoints' for the same request. Requests go to an agent that is not the
orchestrator too, so the hand-over is on the path."""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import ollama
import pytest

from agent.http.app_keys import ROUTER
from tests.agent.agents import ADMIN
from tests.agent.inprocess import call, eventually
from tests.agent.tiny import TINY, tiny_cluster

MESSAGES = [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": "w7 w8 w9"}]


async def openai_chat(url: str, messages: list[dict[str, str]], max_tokens: int) -> str:
    status, answer = await call("POST", url + "/v1/chat/completions", {
        "model": TINY, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, answer
    return answer["choices"][0]["message"]["content"]


async def openai_completion(url: str, prompt: str, max_tokens: int) -> str:
    status, answer = await call("POST", url + "/v1/completions", {
        "model": TINY, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, answer
    return answer["choices"][0]["text"]


def run_client(url: str, method: str, *args: Any, headers: dict[str, str] | None = None, **kwargs: Any) -> Any:
    """Call the official client (synchronous, httpx) and drain a stream, in a thread."""
    result = getattr(ollama.Client(host=url, timeout=30, headers=headers), method)(*args, **kwargs)
    return list(result) if kwargs.get("stream") else result


def test_the_official_client_against_a_three_agent_cluster(tmp_path):
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 3, layers=4) as (leader, others):
            for agent in (leader, others[0]):  # the orchestrator, and an agent that hands requests over
                url = agent.url

                async def client(method: str, *args: Any, **kwargs: Any) -> Any:
                    return await asyncio.to_thread(run_client, url, method, *args, **kwargs)

                version = await call("GET", url + "/api/version")
                assert version[0] == 200 and version[1]["version"]

                # the names /api/tags lists resolve on the OpenAI side too
                status, model = await call("GET", url + f"/v1/models/{TINY}:latest")
                assert status == 200 and model["id"] == TINY, model
                assert (await call("GET", url + "/v1/models/no-such-model"))[0] == 404
                listed = await client("list")
                assert [m.model for m in listed.models] == [f"{TINY}:latest"]
                assert listed.models[0].details.family == "llama" and listed.models[0].size > 0

                shown = await client("show", TINY)
                assert shown.modelinfo["llama.block_count"] == 4
                assert shown.capabilities == ["completion", "tools"]
                assert shown.modelinfo["ncm.tool_format"] == "generic"  # its template knows no tools

                running = await client("ps")
                assert [m.model for m in running.models] == [f"{TINY}:latest"]

                # chat: greedy, not streamed and streamed, equals the OpenAI endpoint's text
                expected = await openai_chat(url, MESSAGES, 6)
                answer = await client("chat", model=TINY, messages=MESSAGES, options={"temperature": 0, "num_predict": 6})
                assert answer.message.content == expected and answer.done and answer.eval_count == 6
                assert answer.prompt_eval_count > 0 and answer.total_duration > 0
                chunks = await client("chat", model=f"{TINY}:latest", messages=MESSAGES, stream=True,
                                      options={"temperature": 0, "num_predict": 6})
                assert "".join(c.message.content for c in chunks) == expected
                assert chunks[-1].done and chunks[-1].done_reason == "length"
                assert all(not c.done for c in chunks[:-1]) and len(chunks) > 2

                # generate: templated like a one-message chat; raw like /v1/completions
                expected_chat = await openai_chat(url, [{"role": "user", "content": "w10 w11"}], 5)
                generated = await client("generate", model=TINY, prompt="w10 w11",
                                         options={"temperature": 0, "num_predict": 5})
                assert generated.response == expected_chat
                expected_raw = await openai_completion(url, "w12 w13 w14", 5)
                pieces = await client("generate", model=TINY, prompt="w12 w13 w14", raw=True, stream=True,
                                      options={"temperature": 0, "num_predict": 5, "num_thread": 2})
                assert "".join(p.response for p in pieces) == expected_raw

                # a stop string and a seed are honoured like the OpenAI endpoint's
                stopped = await client("chat", model=TINY, messages=MESSAGES,
                                       options={"temperature": 0, "num_predict": 6, "stop": [expected.split()[1]]})
                assert stopped.message.content == expected[:expected.index(expected.split()[1])]
                sampled = [await client("chat", model=TINY, messages=MESSAGES,
                                        options={"temperature": 1, "seed": 7, "num_predict": 6}) for _ in range(2)]
                assert sampled[0].message.content == sampled[1].message.content

                with pytest.raises(ollama.ResponseError) as unknown:
                    await client("chat", model="no-such-model", messages=MESSAGES)
                assert unknown.value.status_code == 404 and "no-such-model" in unknown.value.error
                with pytest.raises(ollama.ResponseError) as bad_option:
                    await client("chat", model=TINY, messages=MESSAGES, options={"mirostat": 2})
                assert bad_option.value.status_code == 400 and "mirostat" in bad_option.value.error
                with pytest.raises(ollama.ResponseError) as bad_value:
                    await client("generate", model=TINY, prompt="w1", options={"temperature": "hot"})
                assert bad_value.value.status_code == 400 and "temperature" in bad_value.value.error
                with pytest.raises(ollama.ResponseError) as too_long:  # num_ctx narrows the context
                    await client("chat", model=TINY, messages=MESSAGES, options={"num_ctx": 4})
                assert too_long.value.status_code == 400 and "context" in too_long.value.error
                with pytest.raises(ollama.ResponseError) as bad_keep_alive:
                    await client("generate", model=TINY, prompt="w1", keep_alive="soon")
                assert bad_keep_alive.value.status_code == 400 and "keep_alive" in bad_keep_alive.value.error

            # From a client without the admin token, keep_alive 0 unloads nothing (one client does
            # not take a model away from the others): its own keep_alive ends, the model's idle
            # rule applies again; an explicit unload (an empty prompt) is refused by name.
            router = leader.app[ROUTER]
            idle_rule_s = router.scheduler.sleeps_after_s(TINY)
            await asyncio.to_thread(run_client, others[1].url, "generate", model=TINY, prompt="w3", keep_alive="7m",
                                    options={"num_predict": 2})
            assert router.scheduler.sleeps_after_s(TINY) == 420
            await asyncio.to_thread(run_client, others[1].url, "generate", model=TINY, prompt="w3", keep_alive=0,
                                    options={"num_predict": 2})
            assert router.registry.entries[TINY].state == "ready"
            assert router.scheduler.sleeps_after_s(TINY) == idle_rule_s
            for url in (leader.url, others[1].url):
                with pytest.raises(ollama.ResponseError) as refused:
                    await asyncio.to_thread(run_client, url, "generate", model=TINY, keep_alive=0)
                assert refused.value.status_code == 401 and "admin token" in refused.value.error
            assert router.registry.entries[TINY].state == "ready"

            # With the admin token, keep_alive 0 unloads the model after the answer; an empty
            # prompt loads it again
            await asyncio.to_thread(run_client, others[1].url, "generate", model=TINY, prompt="w3", keep_alive=0,
                                    options={"num_predict": 2}, headers=ADMIN)
            await eventually(lambda: router.registry.entries[TINY].state == "unloaded", timeout_s=10,
                             what="the model unloaded after keep_alive 0")
            loaded = await asyncio.to_thread(run_client, others[1].url, "generate", model=TINY, keep_alive="10m")
            assert loaded.done_reason == "load" and router.registry.entries[TINY].state == "ready"
            running = await asyncio.to_thread(run_client, others[1].url, "ps")  # sleeps 10 min after its last use
            left_s = (running.models[0].expires_at - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
            assert 540 < left_s <= 600, left_s

    asyncio.run(scenario())


def test_pull_takes_known_models_only_and_needs_the_admin_token(tmp_path):
    """`/api/pull` is `ncm pull`: it changes the store, so it needs the admin token (a 401 in
    Ollama's shape without it); a model it already stores is a success at once (nothing is
    downloaded), a name ncm does not know is a 404 in Ollama's shape."""
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 1, names=(TINY, "smollm2-135m")) as (leader, _):
            for headers in (None, {"Authorization": "Bearer ncm-admin-guess"}):
                with pytest.raises(ollama.ResponseError) as refused:
                    await asyncio.to_thread(run_client, leader.url, "pull", "llama9-900b", headers=headers)
                assert refused.value.status_code == 401 and "admin token" in refused.value.error
            status = await asyncio.to_thread(run_client, leader.url, "pull", "smollm2-135m", headers=ADMIN)
            assert status.status == "success"
            lines = await asyncio.to_thread(run_client, leader.url, "pull", "smollm2-135m", stream=True, headers=ADMIN)
            assert [line.status for line in lines][-1] == "success"
            with pytest.raises(ollama.ResponseError) as unknown:
                await asyncio.to_thread(run_client, leader.url, "pull", "llama9-900b", stream=False, headers=ADMIN)
            assert unknown.value.status_code == 404 and "llama9-900b" in unknown.value.error

    asyncio.run(scenario())


def test_a_request_without_a_length_stops_at_the_default_unless_it_asks_for_the_context(tmp_path):
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 1, default_max_tokens=3) as (leader, _):
            status, answer = await call("POST", leader.url + "/v1/chat/completions", {
                "model": TINY, "messages": MESSAGES, "temperature": 0, "logit_bias": {"2": -100}})  # no end token
            assert status == 200 and answer["usage"]["completion_tokens"] == 3, answer
            assert answer["choices"][0]["finish_reason"] == "length"
            status, answer = await call("POST", leader.url + "/api/chat", {
                "model": TINY, "messages": MESSAGES, "stream": False,
                "options": {"temperature": 0, "num_predict": -1, "num_ctx": 32.0}})
            assert status == 200, answer  # -1: until the end (its own, or the context's), not the default
            assert answer["eval_count"] > 3 or answer["done_reason"] == "stop", answer

    asyncio.run(scenario())
