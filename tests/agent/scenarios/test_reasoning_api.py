"""Reasoning models through both APIs and their official clients, on in-process agents serving
a tiny model with Qwen3's own chat template (its generation prompt opening the think block, as
Qwen3's thinking releases do): the reasoning comes apart (``reasoning_content``, Ollama's
``thinking``), streamed and not; ``think`` / ``reasoning_effort`` / ``chat_template_kwargs``
turn thinking off through the template's own switch; a model that cannot think refuses to;
a forced tool call in Qwen's format and a JSON answer come after the thinking."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import ollama
import openai
import pytest

from agent.cli.chat import stream_chat
from shards.importers.importer import import_model
from shards.store.model_store import ModelStore
from tests.agent.inprocess import call
from tests.agent.tiny import TINY, tiny_cluster
from tests.shards.fragment_helpers import CHATML_TOKENS, write_tiny_checkpoint

QWEN3 = (Path(__file__).parents[2] / "shards" / "templates" / "qwen3.jinja").read_text()
OFF = "    {%- if enable_thinking is defined and enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}"
assert OFF in QWEN3
OPENING = QWEN3.replace(OFF, OFF.replace("{%- endif %}", "{%- else %}\n        {{- '<think>\\n' }}\n    {%- endif %}"))
PLAIN = "plain"  # the word-level tiny model, whose template knows no thinking
TOKEN = {token: 256 + i for i, token in enumerate(CHATML_TOKENS)}
NO_END = {str(TOKEN["<|im_end|>"]): -100, str(TOKEN["<|endoftext|>"]): -100}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                                          "required": ["city"], "additionalProperties": False}}}


def reasoning_of(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def openai_chat(url: str, **kwargs: Any) -> Any:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)
    if not kwargs.pop("stream", False):
        return client.chat.completions.create(model=TINY, temperature=0, **kwargs)
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model=TINY, temperature=0, stream=True, **kwargs):
        for choice in chunk.choices:
            reasoning += reasoning_of(choice.delta) or ""
            content += choice.delta.content or ""
    return reasoning, content


def ollama_call(url: str, method: str, **kwargs: Any) -> Any:
    result = getattr(ollama.Client(host=url, timeout=60), method)(**kwargs)
    return list(result) if kwargs.get("stream") else result


@pytest.fixture()
def plain_stored(tmp_path):
    import_model(write_tiny_checkpoint(tmp_path / "plain-checkpoint"), name=PLAIN, store=ModelStore(tmp_path / "home-0"),
                 progress=False)
    return tmp_path


def test_reasoning_apart_on_both_apis_and_thinking_turned_off(plain_stored):
    async def scenario() -> None:
        async with tiny_cluster(plain_stored, 1, chat_template=OPENING, names=(TINY,)) as (leader, _):
            url = leader.url

            async def sdk(**kwargs: Any) -> Any:
                return await asyncio.to_thread(openai_chat, url, **kwargs)

            async def ollama_client(method: str, **kwargs: Any) -> Any:
                return await asyncio.to_thread(ollama_call, url, method, **kwargs)

            shown = await ollama_client("show", model=TINY)
            assert shown.capabilities == ["completion", "tools", "thinking"]
            assert shown.modelinfo["ncm.tool_format"] == "hermes"

            # The prompt opened the think block: with </think> banned, everything is reasoning.
            banned = {**NO_END, str(TOKEN["</think>"]): -100}
            answer = await sdk(messages=ASK, max_tokens=10, logit_bias=banned)
            message = answer.choices[0].message
            assert reasoning_of(message) and not message.content and answer.choices[0].finish_reason == "length"
            assert await sdk(messages=ASK, max_tokens=10, logit_bias=banned, stream=True) == (reasoning_of(message), "")
            shown: list[str] = []  # what `ncm chat` shows apart from the reply
            replied = await asyncio.to_thread(lambda: list(stream_chat(
                url + "/v1/chat/completions", {"model": TINY, "messages": ASK, "max_tokens": 10, "temperature": 0,
                                               "logit_bias": banned}, on_reasoning=shown.append)))
            assert replied == [] and "".join(shown) == reasoning_of(message)
            # </think> first: no reasoning, and a later </think> is reply text like any other
            closing = await sdk(messages=ASK, max_tokens=4, logit_bias={**NO_END, str(TOKEN["</think>"]): 100})
            assert reasoning_of(closing.choices[0].message) is None
            assert closing.choices[0].message.content == "</think>" * 3

            # Off through the template's switch: an empty think block closes the prompt (4 tokens
            # more: "<think>\n" became "<think>\n\n</think>\n\n"), and the answer is all reply.
            off = await sdk(messages=ASK, max_tokens=6, logit_bias=NO_END, reasoning_effort="none")
            assert off.usage.prompt_tokens == answer.usage.prompt_tokens + 4
            assert off.choices[0].message.content and reasoning_of(off.choices[0].message) is None
            same = await sdk(messages=ASK, max_tokens=6, logit_bias=NO_END,
                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            assert same.choices[0].message.content == off.choices[0].message.content
            status, refused = await call("POST", url + "/v1/chat/completions", {
                "model": TINY, "messages": ASK, "reasoning_effort": "high",
                "chat_template_kwargs": {"enable_thinking": False}})
            assert status == 400 and refused["error"]["param"] == "reasoning_effort", refused

            # Ollama: the same greedy answer, its reasoning in thinking, streamed and not
            expected = await sdk(messages=ASK, max_tokens=8)
            thought = await ollama_client("chat", model=TINY, messages=ASK, think=True,
                                          options={"temperature": 0, "num_predict": 8})
            assert (thought.message.thinking, thought.message.content) == \
                (reasoning_of(expected.choices[0].message), expected.choices[0].message.content or "")
            lines = await ollama_client("chat", model=TINY, messages=ASK, think=True, stream=True,
                                        options={"temperature": 0, "num_predict": 8})
            assert "".join(line.message.thinking or "" for line in lines) == (thought.message.thinking or "")
            assert "".join(line.message.content for line in lines) == thought.message.content
            unthought = await ollama_client("chat", model=TINY, messages=ASK, think=False,
                                            options={"temperature": 0, "num_predict": 6})
            assert unthought.message.thinking is None and unthought.message.content == off.choices[0].message.content
            generated = await ollama_client("generate", model=TINY, prompt=ASK[0]["content"], think=True,
                                            options={"temperature": 0, "num_predict": 8})
            assert generated.thinking == thought.message.thinking and generated.response == thought.message.content

            # An earlier answer's reasoning goes back to the template (Qwen3's drops it before the last question).
            history = [*ASK, {"role": "assistant", "content": "Paris.", "thinking": "It is Paris."},
                       {"role": "user", "content": "And of Spain?"}]
            assert (await ollama_client("chat", model=TINY, messages=history, think=False,
                                        options={"num_predict": 2})).done
            status, refused = await call("POST", url + "/api/chat", {
                "model": TINY, "messages": [{"role": "user", "content": "x", "thinking": "y"}]})
            assert status == 400 and "messages[0].thinking" in refused["error"], refused

            # A forced call in Qwen's own format, after the thinking: the grammar lets the think
            # block the prompt opened run free up to its close, then holds the answer to a call.
            close_first = {str(TOKEN["</think>"]): 100}  # past the close, the grammar forbids it
            forced = await sdk(messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=120,
                               logit_bias=close_first)
            call_made = forced.choices[0].message.tool_calls[0]
            assert forced.choices[0].finish_reason == "tool_calls" and call_made.function.name == "get_weather"
            assert set(json.loads(call_made.function.arguments)) == {"city"}
            # JSON after thinking (Ollama's format with think): the reasoning apart, the reply parses
            thought = await sdk(messages=ASK, response_format={"type": "json_object"}, max_tokens=8, logit_bias=banned)
            assert reasoning_of(thought.choices[0].message) and not thought.choices[0].message.content
            city = {"type": "json_schema", "json_schema": {"name": "city", "schema": WEATHER["function"]["parameters"]}}
            formatted = await sdk(messages=ASK, response_format=city, max_tokens=60, logit_bias=close_first)
            assert set(json.loads(formatted.choices[0].message.content)) == {"city"}, formatted
            status, answered = await call("POST", url + "/api/chat", {
                "model": TINY, "messages": ASK, "think": True, "format": "json", "stream": False,
                "options": {"temperature": 0, "num_predict": 8}})  # sampled, it may close its thinking early
            assert status == 200 and answered["message"]["thinking"] and not answered["message"]["content"], answered

            # A model that cannot think refuses to, by the field's name; off is no change.
            for body, param in (({"think": True}, "think"), ({"reasoning_effort": "low"}, "reasoning_effort")):
                path = "/api/chat" if "think" in body else "/v1/chat/completions"
                status, refused = await call("POST", url + path, {"model": PLAIN, "messages": ASK, "stream": False,
                                                                  **body})
                assert status == 400, refused
                error = refused["error"]
                assert ('"plain" does not support thinking' in error) if path == "/api/chat" \
                    else (error["param"] == param and "does not support thinking" in error["message"]), refused
            for path, body in (("/api/chat", {"think": False}), ("/v1/chat/completions", {"reasoning_effort": "none"})):
                status, answer = await call("POST", url + path, {"model": PLAIN, "messages": ASK, "stream": False,
                                                                 "max_tokens" if path[1] == "v" else "options":
                                                                 2 if path[1] == "v" else {"num_predict": 2}, **body})
                assert status == 200, answer

    asyncio.run(scenario())
