"""What the OpenAI and Ollama endpoints share to generate (agent/http/generation.py).

- `sampling_params`: the request's fields, at most max_tokens (else the agent's default, else
  the context's room) and never past the context; a prompt that fills it is a 400;
- `tool_call_entries`, `call_delta_entries`: calls in OpenAI's and Ollama's shapes;
- `chat_logprobs`, `completion_logprobs` on a real byte-level tokenizer: each token's bytes;
- `chain_events`: the first event, and the rest only if it did not end the generation;
- the prompt, grammar and reader a request makes (`_prompt`) on the real deployments of an
  in-process agent serving three tiny models: a word-level one whose template knows neither
  tools nor thinking, one with Qwen3's template (tools, a thinking switch) and one whose
  template reads reasoning_effort and opens the think block itself; the grammars are run by
  llguidance on the model's own tokenizer;
- `start_generation` on the completion endpoint: the agent's default_max_tokens and the
  context's room bound what is generated.

The same through both APIs and their clients is `tests/agent/scenarios/test_reasoning_api.py`'s."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core.chat_request import TOOL_NAME, ChatRequest, parse_request
from agent.core.errors import InvalidRequestError
from agent.http.app_keys import ORCHESTRATOR, ROUTER
from agent.http.generation import (
    _prompt,
    call_delta_entries,
    chain_events,
    chat_logprobs,
    completion_logprobs,
    sampling_params,
    tool_call_entries,
)
from agent.orchestration.orchestrator import Completion, Deployment
from shards.errors import GrammarError
from shards.importers.importer import import_model
from shards.runtime.answer_reader import AnswerPiece, AnswerReader
from shards.runtime.call_stream import CallDelta
from shards.runtime.grammar import ThinkFirst, TokenMask, grammar_tokenizer, json_schema_grammar
from shards.runtime.sampling import MAX_TOKENS_LIMIT, TokenLogprobs
from shards.runtime.tool_calls import ToolCall
from shards.store.model_store import ModelStore
from shards.text.tokenizer import Tokenizer
from shards.text.tokenizer_hf import tokenizer_spec_from_hf
from tests.agent.inprocess import LocalAgent, Loop, call, share_calibration
from tests.agent.tiny import TINY, tiny_cluster
from tests.shards.fragment_helpers import write_chatml_tokenizer, write_tiny_checkpoint

QWEN3 = (Path(__file__).parents[2] / "shards" / "templates" / "qwen3.jinja").read_text(encoding="utf-8")
EFFORT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% if reasoning_effort is defined %}"
                   "effort: {{ reasoning_effort }}\n{% endif %}<think>\n{% endif %}")
QWEN, PLAIN, EFFORT = TINY, "plain", "effort"
CONTEXT = 64
DEFAULT_MAX_TOKENS = 4
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
                   "additionalProperties": False}}}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}
CITY_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}


def chat(**fields: Any) -> ChatRequest:
    return parse_request({"messages": ASK, **fields}, chat=True)


def completion(**fields: Any) -> ChatRequest:
    return parse_request({"prompt": "w7 w8", **fields}, chat=False)


def refusal(run: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        run()
    return caught.value


# --- sampling_params ------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(max_context=st.integers(16, 1 << 16), used=st.floats(0, 1, exclude_max=True),
       max_tokens=st.none() | st.integers(1, 1 << 17), default=st.integers(0, 1 << 12), is_chat=st.booleans(),
       temperature=st.floats(0, 2), seed=st.none() | st.integers(0, 2**32), top_k=st.integers(0, 100))
def test_sampling_takes_the_requests_fields_and_never_runs_past_the_context(max_context, used, max_tokens, default,
                                                                            is_chat, temperature, seed, top_k):
    prompt_tokens = int(used * max_context)
    room = max_context - prompt_tokens
    fields = {"temperature": temperature, "seed": seed, "top_k": top_k, "stop": ["END", "STOP"],
              "max_tokens": max_tokens}
    request = chat(**fields) if is_chat else completion(**fields)
    params = sampling_params(request, prompt_tokens, max_context, "start: /x/", default_max_tokens=default)
    assert 1 <= params.max_tokens <= room
    assert params.max_tokens == min(max_tokens or default or room, room)
    assert (params.temperature, params.seed, params.top_k, params.stop) == (temperature, seed, top_k, ("END", "STOP"))
    assert params.grammar == "start: /x/" and params.logprobs is None


@settings(max_examples=60, deadline=None)
@given(max_context=st.integers(16, 1 << 16), over=st.integers(0, 5000), is_chat=st.booleans(),
       max_tokens=st.none() | st.integers(1, 100))
def test_a_prompt_that_fills_the_context_is_refused_naming_the_prompts_field(max_context, over, is_chat, max_tokens):
    request = chat(max_tokens=max_tokens) if is_chat else completion(max_tokens=max_tokens)
    error = refusal(lambda: sampling_params(request, max_context + over, max_context, default_max_tokens=8))
    answer = error.answer()
    assert (answer.status, answer.code, answer.param) == (400, "context_length_exceeded",
                                                          "messages" if is_chat else "prompt")
    assert answer.message == (f"the prompt has {max_context + over} tokens but the context holds {max_context}; "
                              "shorten it")


def test_a_field_the_sampler_refuses_is_a_400_with_its_reason():
    request = dataclasses.replace(chat(), top_p=0.0)  # past what parse_request lets through
    error = refusal(lambda: sampling_params(request, 3, 64))
    assert error.answer().status == 400 and "top_p must be in (0, 1]" in str(error)


def test_logprobs_asked_for_are_sampled():
    assert sampling_params(chat(logprobs=True, top_logprobs=3), 3, 64).logprobs == 3
    assert sampling_params(completion(logprobs=2), 3, 64).logprobs == 2


def test_a_request_without_max_tokens_on_a_huge_context_is_served():
    params = sampling_params(chat(), 100, 2 * MAX_TOKENS_LIMIT, default_max_tokens=0)
    assert 1 <= params.max_tokens <= MAX_TOKENS_LIMIT


# --- tool calls -----------------------------------------------------------------------------------
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                    max_leaves=8)
CALLS = st.lists(st.builds(ToolCall, st.from_regex(r"call_[0-9]", fullmatch=True),
                           st.from_regex(TOOL_NAME, fullmatch=True), st.dictionaries(st.text(), JSON, max_size=4)),
                 max_size=4)
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


@settings(max_examples=100, deadline=None)
@given(calls=CALLS)
def test_calls_in_openais_shape_have_fresh_ids_and_their_arguments_as_json_text(calls):
    entries = tool_call_entries(calls, arguments_as_text=True)
    assert len(entries) == len(calls)
    for entry, call_ in zip(entries, calls):
        assert set(entry) == {"id", "type", "function"} and entry["type"] == "function"
        assert CALL_ID.match(entry["id"]) and entry["id"] != call_.id
        assert entry["function"]["name"] == call_.name
        assert isinstance(entry["function"]["arguments"], str)
        assert json.loads(entry["function"]["arguments"]) == call_.arguments
    assert len({entry["id"] for entry in entries}) == len(entries)


@settings(max_examples=100, deadline=None)
@given(calls=CALLS)
def test_calls_in_ollamas_shape_are_the_function_and_its_arguments_as_an_object(calls):
    entries = tool_call_entries(calls, arguments_as_text=False)
    assert entries == [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def test_openais_arguments_keep_text_that_is_not_ascii_as_it_is():
    calls = [ToolCall("call_0", "weather", {"city": "東京", "note": "ø"})]
    (entry,) = tool_call_entries(calls, arguments_as_text=True)
    assert entry["function"]["arguments"] == '{"city": "東京", "note": "ø"}'


@settings(max_examples=100, deadline=None)
@given(calls=st.lists(st.tuples(st.from_regex(TOOL_NAME, fullmatch=True), st.lists(st.text(max_size=6), max_size=4)),
                      min_size=1, max_size=3))
def test_streamed_call_pieces_name_each_call_once_then_send_more_of_its_arguments(calls):
    deltas = []
    for index, (name, pieces) in enumerate(calls):
        deltas.append(CallDelta(index, name, ""))
        deltas += [CallDelta(index, None, piece) for piece in pieces]
    entries = call_delta_entries(tuple(deltas))
    assert [e["index"] for e in entries] == [d.index for d in deltas]
    firsts = [e for e in entries if "id" in e]
    assert [e["function"]["name"] for e in firsts] == [name for name, _ in calls]
    assert all(set(e) == {"index", "id", "type", "function"} and e["type"] == "function" and CALL_ID.match(e["id"])
               for e in firsts)
    assert len({e["id"] for e in firsts}) == len(calls)
    rest = [e for e in entries if "id" not in e]
    assert all(set(e) == {"index", "function"} and set(e["function"]) == {"arguments"} for e in rest)
    for index, (_, pieces) in enumerate(calls):
        assert "".join(e["function"]["arguments"] for e in entries if e["index"] == index) == "".join(pieces)


# --- log-probabilities ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A byte-level tokenizer (a token per byte) with ChatML's special tokens."""
    folder = tmp_path_factory.mktemp("chatml")
    write_chatml_tokenizer(folder, QWEN3)
    return Tokenizer(tokenizer_spec_from_hf(folder))


def logprobs_of(tokenizer: Tokenizer, ids: list[int], top: int) -> tuple[TokenLogprobs, ...]:
    """Each token at -0.25 * its place, its alternatives the next ids, each less likely by 1."""
    return tuple(TokenLogprobs(token, -0.25 * i, tuple((alternative(tokenizer, token, k), -0.25 * i - k)
                                                       for k in range(top)))
                 for i, token in enumerate(ids))


def alternative(tokenizer: Tokenizer, token: int, k: int) -> int:
    return (token + k) % tokenizer.vocab_size


@settings(max_examples=100, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30), top=st.integers(0, 3))
def test_chat_logprobs_give_each_tokens_bytes_which_spell_the_text(chatml, text, top):
    ids = chatml.encode(text, add_special_tokens=False)
    answer = chat_logprobs(chatml, logprobs_of(chatml, ids, top))
    assert set(answer) == {"content", "refusal"} and answer["refusal"] is None
    content = answer["content"]
    assert b"".join(bytes(entry["bytes"]) for entry in content) == text.encode("utf-8")
    for i, (entry, token) in enumerate(zip(content, ids, strict=True)):
        assert entry["token"] == bytes(entry["bytes"]).decode("utf-8", errors="replace")
        assert entry["logprob"] == -0.25 * i
        assert [(t["logprob"], bytes(t["bytes"])) for t in entry["top_logprobs"]] == [
            (-0.25 * i - k, chatml.token_bytes(alternative(chatml, token, k))) for k in range(top)]


def test_chat_logprobs_of_a_special_token_are_its_text(chatml):
    think = chatml.token_to_id("<think>")
    (entry,) = chat_logprobs(chatml, (TokenLogprobs(think, -0.5, ((think, -0.5),)),))["content"]
    assert entry == {"token": "<think>", "logprob": -0.5, "bytes": list(b"<think>"),
                     "top_logprobs": [{"token": "<think>", "logprob": -0.5, "bytes": list(b"<think>")}]}


ASCII = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=8)
ASCII_WITH_MARKS = st.lists(ASCII | st.sampled_from(["<think>", "</think>", "<tool_call>"]), min_size=1,
                            max_size=6).map("".join)


@settings(max_examples=100, deadline=None)
@given(text=ASCII_WITH_MARKS, offset=st.integers(0, 1000), top=st.integers(0, 3))
def test_completion_logprobs_give_tokens_and_their_offsets_in_the_text(chatml, text, offset, top):
    """A byte is a token, and so is each mark (a token of several characters)."""
    ids = chatml.encode(text, add_special_tokens=False)
    answer = completion_logprobs(chatml, logprobs_of(chatml, ids, top), offset)
    assert set(answer) == {"tokens", "token_logprobs", "text_offset", "top_logprobs"}
    assert "".join(answer["tokens"]) == text
    assert answer["token_logprobs"] == [-0.25 * i for i in range(len(ids))]
    for token, at in zip(answer["tokens"], answer["text_offset"], strict=True):
        assert text[at - offset:at - offset + len(token)] == token
    assert answer["top_logprobs"][0] == {
        chatml.token_bytes(alternative(chatml, ids[0], k)).decode("utf-8", errors="replace"): -float(k)
        for k in range(top)}


@pytest.mark.xfail(strict=True, reason="oddity: generation.py:195-199 counts a token cut inside a UTF-8 character as "
                                       "one U+FFFD, so past such a character text_offset no longer points into the "
                                       "text (and the tokens do not spell it)")
def test_completion_text_offsets_point_into_text_that_is_not_ascii(chatml):
    text = "é!"  # two tokens of one byte each, then "!"
    answer = completion_logprobs(chatml, logprobs_of(chatml, chatml.encode(text, add_special_tokens=False), 0), 0)
    assert text[answer["text_offset"][-1]] == "!"


# --- chain_events ---------------------------------------------------------------------------------
def test_the_rest_of_a_generation_is_read_only_when_its_first_event_did_not_end_it():
    async def scenario() -> None:
        started = []

        async def rest() -> AsyncIterator[Completion]:
            started.append(True)
            yield Completion(" more", "m")
            yield Completion("", "m", finish_reason="length", completion_tokens=2)

        ended = Completion("all", "m", finish_reason="stop", completion_tokens=1)
        assert [e async for e in chain_events(ended, rest())] == [ended]
        assert started == []
        first = Completion("first", "m")
        events = [e async for e in chain_events(first, rest())]
        assert [e.text for e in events] == ["first", " more", ""] and events[-1].finish_reason == "length"
        assert started == [True]

    asyncio.run(scenario())


# --- the prompt, grammar and reader of a request, on real deployments -----------------------------
@dataclasses.dataclass
class Served:
    loop: Loop
    agent: LocalAgent
    deployments: dict[str, Deployment]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("generation")
    store = ModelStore(home / "home-0")
    import_model(write_tiny_checkpoint(home / "plain"), name=PLAIN, store=store, progress=False)
    import_model(write_tiny_checkpoint(home / "effort", chat_template=EFFORT_TEMPLATE), name=EFFORT, store=store,
                 progress=False)
    loop = Loop()

    async def load_all(agent: LocalAgent) -> dict[str, Deployment]:
        for name in (PLAIN, EFFORT):
            await agent.app[ROUTER].load(name)
        return dict(agent.app[ORCHESTRATOR].deployments)

    try:
        with pytest.MonkeyPatch.context() as patch:
            share_calibration(patch)
            leader, _ = loop.enter(tiny_cluster(home, 1, chat_template=QWEN3, max_context=CONTEXT,
                                                prefill_chunk=CONTEXT, default_max_tokens=DEFAULT_MAX_TOKENS))
            deployments = loop.run(load_all(leader))
            assert set(deployments) == {QWEN, PLAIN, EFFORT}
            yield Served(loop, leader, deployments)
    finally:
        loop.close()


def prompt_of(served: Served, model: str, request: ChatRequest) -> tuple[list[int], str | None, AnswerReader]:
    return _prompt(request, served.deployments[model], call_pieces=False)


def text_of(served: Served, model: str, ids: list[int]) -> str:
    return served.deployments[model].tokenizer.decode(ids)


def read(reader: AnswerReader, *pieces: str) -> AnswerPiece:
    return AnswerPiece.joined([*(reader.push(piece) for piece in pieces), reader.finish()])


_engines: dict[str, Any] = {}


def accepts(served: Served, model: str, grammar: str, text: str) -> bool:
    """Whether ``text`` is a whole answer ``grammar`` lets through, on the model's own tokenizer."""
    tokenizer = served.deployments[model].tokenizer
    if model not in _engines:
        _engines[model] = grammar_tokenizer(tokenizer)
    mask = TokenMask(_engines[model], grammar)
    try:
        mask.accept_all(tokenizer.encode(text, add_special_tokens=False))
    except GrammarError:
        return False
    row = mask.mask(np.zeros(tokenizer.vocab_size, np.float32))
    return bool(np.isfinite(row[tokenizer.eos_token_ids[0]]))


@pytest.mark.parametrize("model", [PLAIN, QWEN, EFFORT])
def test_a_raw_prompt_is_encoded_as_it_is_and_read_back_as_it_comes(served, model):
    ids, grammar, reader = prompt_of(served, model, completion(prompt="w7 w8 w9"))
    assert ids == served.deployments[model].tokenizer.encode("w7 w8 w9")
    assert grammar is None and reader.tool_format is None
    answer = read(reader, "<think>no", "t split</think> w5")  # no template: nothing is reasoning
    assert (answer.reasoning, answer.content, answer.calls) == ("", "<think>not split</think> w5", ())


def test_a_raw_prompt_with_a_response_format_gets_the_grammar_of_its_schema(served):
    ids, grammar, _ = prompt_of(served, QWEN, completion(prompt="Oslo?", response_format=CITY_FORMAT))
    assert grammar == json_schema_grammar(CITY)
    assert accepts(served, QWEN, grammar, '{"city": "Oslo"}') and not accepts(served, QWEN, grammar, "Oslo")
    assert not accepts(served, QWEN, grammar, '{"city": "Trondheim"}')  # over its maxLength


@pytest.mark.parametrize("fields, param", [
    ({"think": True}, "think"), ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"style": "short"}}, "chat_template_kwargs")])
def test_a_raw_prompt_cannot_ask_for_what_needs_the_chat_template(served, fields, param):
    error = refusal(lambda: prompt_of(served, QWEN, completion(**fields)))
    assert error.param == param and error.answer().status == 400
    assert str(error) == f"'{param}' needs the chat template: send messages, without raw"


def test_a_raw_prompt_may_say_not_to_think(served):
    ids = prompt_of(served, QWEN, completion())[0]
    for fields in ({"think": False}, {"reasoning_effort": "none"}):
        assert prompt_of(served, QWEN, completion(**fields))[0] == ids


def test_messages_go_through_the_models_own_chat_template(served):
    messages = [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": "w7 w8"}]
    ids, grammar, reader = prompt_of(served, PLAIN, parse_request({"messages": messages}, chat=True))
    assert ids == served.deployments[PLAIN].tokenizer.encode_chat(messages)
    assert text_of(served, PLAIN, ids).endswith(" w3 w5 w6 w4 w7 w8 w5")  # its turns as words
    assert grammar is None and reader.tool_format is None
    ids, grammar, _ = prompt_of(served, QWEN, parse_request({"messages": messages}, chat=True))
    assert text_of(served, QWEN, ids) == ("<|im_start|>system\nw5 w6<|im_end|>\n<|im_start|>user\nw7 w8<|im_end|>\n"
                                          "<|im_start|>assistant\n")
    assert grammar is None


def test_text_in_a_message_that_spells_a_control_token_stays_text(served):
    ids, _, _ = prompt_of(served, QWEN, chat(messages=[{"role": "user", "content": "<|im_start|>system"}]))
    tokenizer = served.deployments[QWEN].tokenizer
    assert ids.count(tokenizer.token_to_id("<|im_start|>")) == 2  # the user's turn and the answer's, not the text's


def test_a_conversation_the_template_cannot_take_is_a_400_naming_the_messages(served):
    messages = [{"role": "user", "content": "<|im_end|>\ue000"}]  # a control token's text and a reserved mark
    error = refusal(lambda: prompt_of(served, QWEN, chat(messages=messages)))
    assert error.param == "messages" and str(error).startswith("cannot apply the chat template: ")


@pytest.mark.parametrize("fields, param", [
    ({"think": True}, "think"), ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs")])
def test_a_model_that_cannot_think_refuses_to(served, fields, param):
    error = refusal(lambda: prompt_of(served, PLAIN, chat(**fields)))
    assert error.param == param and str(error) == f"\"{PLAIN}\" does not support thinking ('{param}' asks for it)"


def test_not_thinking_is_no_request_for_a_model_that_cannot_think(served):
    assert prompt_of(served, PLAIN, chat(think=False))[0] == prompt_of(served, PLAIN, chat())[0]
    assert prompt_of(served, PLAIN, chat(reasoning_effort="none"))[0] == prompt_of(served, PLAIN, chat())[0]


def test_thinking_turned_off_goes_through_the_templates_switch(served):
    default, _, reader = prompt_of(served, QWEN, chat())
    assert not text_of(served, QWEN, default).endswith("</think>\n\n")
    answer = read(reader, "<think>\nit rains", " often</think>\n\nRain.")
    assert (answer.reasoning, answer.content) == ("it rains often", "Rain.")
    offs = ({"think": False}, {"reasoning_effort": "none"}, {"chat_template_kwargs": {"enable_thinking": False}})
    for fields in offs:
        ids, grammar, reader = prompt_of(served, QWEN, chat(**fields))
        assert text_of(served, QWEN, ids) == text_of(served, QWEN, default) + "<think>\n\n</think>\n\n", fields
        assert grammar is None
        answer = read(reader, "<think>still</think>Rain.")  # a model that thinks anyway: its reasoning is dropped
        assert (answer.reasoning, answer.content) == ("", "Rain."), fields


def test_an_effort_reaches_a_template_that_reads_it_and_a_prompt_that_opens_the_think_block_is_read_inside_it(served):
    plain, _, reader = prompt_of(served, EFFORT, chat())
    assert text_of(served, EFFORT, plain).endswith("<|im_start|>assistant\n<think>\n")
    answer = read(reader, "weighing it", "</think>Rain.")  # the answer starts inside the block
    assert (answer.reasoning, answer.content) == ("weighing it", "Rain.")
    ids, _, _ = prompt_of(served, EFFORT, chat(reasoning_effort="high"))
    assert text_of(served, EFFORT, ids).endswith("<|im_start|>assistant\neffort: high\n<think>\n")
    ids, _, reader = prompt_of(served, EFFORT, chat(think=False))  # no switch: only its reasoning is dropped
    assert ids == plain
    answer = read(reader, "weighing it</think>Rain.")
    assert (answer.reasoning, answer.content) == ("", "Rain.")


def test_a_response_format_on_a_model_that_thinks_lets_the_thinking_come_first(served):
    _, grammar, _ = prompt_of(served, QWEN, chat(response_format=CITY_FORMAT))
    tokens = served.deployments[QWEN].tokenizer.added_token_texts
    assert grammar == json_schema_grammar(CITY, ThinkFirst(opened=False, tokens=tokens))
    for text in ('{"city": "Oslo"}', '<think>\nwet\n</think>\n\n{"city": "Oslo"}'):
        assert accepts(served, QWEN, grammar, text), text
    assert not accepts(served, QWEN, grammar, "Oslo") and not accepts(served, QWEN, grammar, "<think>wet</think>Oslo")
    _, off, _ = prompt_of(served, QWEN, chat(response_format=CITY_FORMAT, think=False))
    assert off == json_schema_grammar(CITY)  # thinking off: the answer is the JSON at once
    assert not accepts(served, QWEN, off, '<think>\nwet\n</think>\n\n{"city": "Oslo"}')
    _, opened, _ = prompt_of(served, EFFORT, chat(response_format=CITY_FORMAT))
    assert accepts(served, EFFORT, opened, 'wet</think>\n{"city": "Oslo"}')
    assert not accepts(served, EFFORT, opened, '{"city": "Oslo"}')  # inside the block the prompt opened: close it first


def test_tools_reach_the_template_and_the_grammar_holds_a_required_answer_to_a_call(served):
    ids, grammar, reader = prompt_of(served, QWEN, chat(tools=[WEATHER], tool_choice="required"))
    prompt = text_of(served, QWEN, ids)
    assert prompt.startswith("<|im_start|>system\n# Tools\n") and '"name": "get_weather"' in prompt
    call_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert accepts(served, QWEN, grammar, call_text)
    assert accepts(served, QWEN, grammar, "<think>\nrain?\n</think>\n\n" + call_text)
    assert not accepts(served, QWEN, grammar, "It rains.")  # required: a call, nothing else
    assert not accepts(served, QWEN, grammar, call_text.replace("get_weather", "get_wether"))
    answer = read(reader, call_text[:20], call_text[20:])
    assert answer.content == "" and [(c.name, c.arguments) for c in answer.calls] == [("get_weather", {"city": "Oslo"})]
    assert reader.tool_format == "hermes"


def test_tools_with_choice_auto_leave_the_answer_free_and_with_none_leave_no_trace(served):
    ids, grammar, reader = prompt_of(served, QWEN, chat(tools=[WEATHER]))
    assert grammar is None and '"name": "get_weather"' in text_of(served, QWEN, ids)
    answer = read(reader, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                          '</tool_call>')  # a call written freely is read all the same
    assert answer.content == "Let me look." and [c.name for c in answer.calls] == ["get_weather"]
    assert read(prompt_of(served, QWEN, chat(tools=[WEATHER]))[2], "It rains.").content == "It rains."
    ids, grammar, reader = prompt_of(served, QWEN, chat(tools=[WEATHER], tool_choice="none"))
    assert ids == prompt_of(served, QWEN, chat())[0] and grammar is None and reader.tool_format is None


def test_tools_and_a_response_format_give_a_call_or_json_of_the_schema(served):
    _, grammar, _ = prompt_of(served, QWEN, chat(tools=[WEATHER], response_format=CITY_FORMAT))
    assert accepts(served, QWEN, grammar, '{"city": "Oslo"}')
    assert accepts(served, QWEN, grammar, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                          '</tool_call>')
    assert not accepts(served, QWEN, grammar, "It rains.")


def test_a_template_without_tools_gets_them_written_into_its_turns(served):
    ids, grammar, reader = prompt_of(served, PLAIN, chat(tools=[WEATHER], tool_choice="required"))
    assert reader.tool_format == "generic" and grammar is not None
    assert len(ids) > len(prompt_of(served, PLAIN, chat())[0])  # a system turn that lists the tools


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}, "tools": [WEATHER]}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "("}}}}}], "tool_choice": "required"}, "tools"),
])
def test_a_schema_that_cannot_be_a_grammar_is_refused_by_its_field(served, fields, param):
    error = refusal(lambda: prompt_of(served, QWEN, chat(**fields)))
    assert error.param == param and error.answer().status == 400 and "cannot" in str(error)


# --- start_generation on the completion endpoint --------------------------------------------------
def test_the_agents_default_and_the_contexts_room_bound_what_a_completion_generates(served):
    no_end = {"2": -100}  # the word-level model's </s>: every answer runs to its bound

    async def complete(**fields: Any) -> dict[str, Any]:
        status, answer = await call("POST", served.agent.url + "/v1/completions", {
            "model": PLAIN, "temperature": 0, "logit_bias": no_end, **fields}, timeout_s=30)
        assert status == 200, answer
        return answer

    async def scenario() -> None:
        answer = await complete(prompt="w7 w8 w9")
        assert answer["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS
        assert answer["choices"][0]["finish_reason"] == "length"
        answer = await complete(prompt="w7 w8 w9", max_tokens=DEFAULT_MAX_TOKENS + 3)
        assert answer["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS + 3  # the request's own, over the default
        prompt = " ".join(f"w{10 + i}" for i in range(CONTEXT - 6))
        answer = await complete(prompt=prompt, max_tokens=1000)
        used = answer["usage"]["prompt_tokens"]
        assert used == CONTEXT - 5 and answer["usage"]["completion_tokens"] == CONTEXT - used
        assert answer["choices"][0]["finish_reason"] == "length"
        answer = await complete(prompt=prompt + " w5 w6 w7 w8")  # one token of room left, under the default
        assert answer["usage"]["prompt_tokens"] == CONTEXT - 1 and answer["usage"]["completion_tokens"] == 1

    served.loop.run(scenario())
