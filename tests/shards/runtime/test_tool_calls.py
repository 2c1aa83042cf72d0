"""Tool calls in a model's own syntax (shards.runtime.tool_calls): which format a chat template
uses, how tools and earlier calls reach the prompt (rendered by a real template, Qwen3's, or
written into the turns of a template without tools), how the model's text is read back into
calls in each format (hermes, mistral, llama3, generic; what does not parse stays text), when
streamed text may be the start of a call, and what PARALLEL_BY_DEFAULT lets the grammar of
each format through (checked with llguidance on a small byte-level tokenizer).

Streaming calls is tested in test_call_stream.py; grammars sampled on the real model's
tokenizer in test_grammar.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shards.errors import GrammarError
from shards.runtime.grammar import TokenMask, grammar_tokenizer
from shards.runtime.tool_calls import (
    FORMATS,
    GENERIC,
    HERMES,
    LLAMA3,
    MISTRAL,
    PARALLEL_BY_DEFAULT,
    ToolCall,
    call_grammar,
    generic_system_text,
    may_hold_call,
    parse_calls,
    prompt_messages,
    tool_format,
)
from shards.text.tokenizer import Tokenizer
from shards.text.tokenizer_gguf import GEMMA_TURNS
from shards.text.tokenizer_hf import tokenizer_spec_from_hf
from tests.examples import examples
from tests.shards.fragment_helpers import CHAT_TEMPLATE, write_chatml_tokenizer
from tests.shards.runtime.test_call_stream import written

QWEN3_TEMPLATE = (Path(__file__).parents[1] / "templates" / "qwen3.jinja").read_text(encoding="utf-8")
TOOLS = [{"name": "HassTurnOn", "description": "turns a device on",
          "parameters": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
                         "required": ["name"], "additionalProperties": False}},
         {"name": "GetLiveContext",
          "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}]
TURN_ON = ("HassTurnOn", {"name": "lamp"})
CONTEXT = ("GetLiveContext", {})


def read(fmt: str, text: str) -> tuple[str, list[tuple[str, str, dict]]]:
    content, calls = parse_calls(fmt, text)
    return content, [(call.id, call.name, call.arguments) for call in calls]


# --- formats ---------------------------------------------------------------------------------

def test_the_formats_and_which_of_them_call_several_tools_by_default() -> None:
    assert FORMATS == (HERMES, LLAMA3, MISTRAL, GENERIC) == ("hermes", "llama3", "mistral", "generic")
    assert PARALLEL_BY_DEFAULT == {HERMES: True, MISTRAL: True, LLAMA3: False, GENERIC: False}


LLAMA3_TEMPLATE = ("{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}"
                   "{%- for m in messages %}{%- if m.tool_calls %}{{- '<|python_tag|>' + m.tool_calls | tojson }}"
                   "{%- else %}{{- m.content }}{%- endif %}{%- endfor %}")
MISTRAL_TEMPLATE = ("{%- for m in messages %}{%- if m.tool_calls %}{{- '[TOOL_CALLS]' + m.tool_calls | tojson }}"
                    "{%- elif tools %}{{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
                    "{%- endfor %}")


@pytest.mark.parametrize(("template", "fmt"), [
    (QWEN3_TEMPLATE, HERMES),  # Qwen3's own template
    (GEMMA_TURNS, GENERIC),  # llama.cpp's turns for a base Gemma file: no tools
    (CHAT_TEMPLATE, GENERIC),
    (LLAMA3_TEMPLATE, LLAMA3),
    (LLAMA3_TEMPLATE.replace("'<|python_tag|>' + ", ""), LLAMA3),  # the ipython role alone
    (MISTRAL_TEMPLATE, MISTRAL),
    ("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages[-1].content }}", GENERIC),  # tools, no call syntax
    ("{{ '<tool_call>' }}{{ messages[-1].content }}", GENERIC),  # call syntax, but it is never given tools
    (None, GENERIC),
    ("", GENERIC),
])
def test_the_format_is_read_from_the_chat_template(template: str | None, fmt: str) -> None:
    assert tool_format(template) == fmt


_MARKERS = st.sampled_from(["<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "ipython", "{{ x }}", "messages",
                            "tool", "call"])


@settings(max_examples=examples(100), deadline=None)
@given(parts=st.lists(_MARKERS, max_size=6))
def test_of_several_call_syntaxes_in_a_template_hermes_comes_first_then_mistral_then_llama3(parts: list[str]) -> None:
    template = "".join(parts)
    expected = GENERIC
    if "tools" in template:
        for marker, fmt in (("<tool_call>", HERMES), ("[TOOL_CALLS]", MISTRAL), ("<|python_tag|>", LLAMA3),
                            ("ipython", LLAMA3)):
            if marker in template:
                expected = fmt
                break
    assert tool_format(template) == expected


# --- reading calls back ----------------------------------------------------------------------

def test_hermes_calls_are_read_with_the_text_before_them() -> None:
    text = "Let me turn it on.\n" + written(HERMES, [TURN_ON, CONTEXT])
    assert read(HERMES, text) == ("Let me turn it on.", [("call_0", *TURN_ON), ("call_1", *CONTEXT)])
    spaced = '<tool_call>  \n\n {"name": "HassTurnOn", "arguments": "{\\"name\\": \\"lamp\\"}"}\n  </tool_call>\n'
    assert read(HERMES, spaced) == ("", [("call_0", *TURN_ON)])  # arguments given as JSON text


def test_mistral_calls_are_read_with_or_without_their_marker() -> None:
    assert read(MISTRAL, written(MISTRAL, [TURN_ON, CONTEXT])) == ("", [("call_0", *TURN_ON), ("call_1", *CONTEXT)])
    # the marker is a special token that decoding may have left out
    assert read(MISTRAL, '[{"name": "GetLiveContext", "arguments": {}}]') == ("", [("call_0", *CONTEXT)])
    assert read(MISTRAL, "On it. " + written(MISTRAL, [CONTEXT])) == ("On it.", [("call_0", *CONTEXT)])


def test_a_llama3_call_is_read_after_its_tag_or_alone_by_its_parameters() -> None:
    body = '{"name": "HassTurnOn", "parameters": {"name": "lamp"}}'
    assert read(LLAMA3, body) == read(LLAMA3, "<|python_tag|>" + body) == ("", [("call_0", *TURN_ON)])
    assert read(LLAMA3, ' \n{"name": "HassTurnOn", "arguments": {"name": "lamp"}}\n') == ("", [("call_0", *TURN_ON)])
    assert read(LLAMA3, '{"name": "GetLiveContext"}') == ("", [("call_0", *CONTEXT)])  # no arguments: none


def test_a_generic_answer_is_calls_or_a_reply() -> None:
    assert read(GENERIC, written(GENERIC, [TURN_ON, CONTEXT])) == ("", [("call_0", *TURN_ON), ("call_1", *CONTEXT)])
    assert read(GENERIC, '{"response": "It is on."}') == ("It is on.", [])
    # a reply in a response_format's schema comes back as its JSON
    assert read(GENERIC, '{"response": {"city": "Oslo", "celsius": -3}}') == ('{"city": "Oslo", "celsius": -3}', [])
    both = '{"response": "x", "tool_calls": [{"name": "GetLiveContext", "arguments": {}}]}'
    assert read(GENERIC, both) == ("", [("call_0", *CONTEXT)])


@pytest.mark.parametrize(("fmt", "text"), [
    (HERMES, "<tool_call>\n{not json}\n</tool_call>"),
    (HERMES, '<tool_call>\n{"name": "HassTurnOn", "arguments": {}}\n</tool_call><tool_call>\n{"arguments": {}}\n'
             '</tool_call>'),  # one good call and one without a name: none is taken
    (HERMES, '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>'),
    (HERMES, '<tool_call>\n{"name": "HassTurnOn", "arguments": [1]}\n</tool_call>'),
    (HERMES, '<tool_call>\n{"name": "HassTurnOn", "arguments": "{not json"}\n</tool_call>'),
    (HERMES, '<tool_call>\n{"name": "HassTurnOn", "arguments": {}}'),  # never closed
    (HERMES, "The lamp is on."),
    (MISTRAL, '[TOOL_CALLS]{"name": "HassTurnOn", "arguments": {}}'),  # an object, not a list
    (MISTRAL, "[TOOL_CALLS][]"),
    (MISTRAL, '[TOOL_CALLS][{"name": "HassTurnOn", "arguments": {}}, "text"]'),
    (LLAMA3, "<|python_tag|>print('hi')"),
    (LLAMA3, '[{"name": "HassTurnOn", "parameters": {}}]'),
    (LLAMA3, "Sure, the lamp is on."),
    (GENERIC, '{"tool_calls": []}'),
    (GENERIC, '{"tool_calls": {"name": "HassTurnOn"}}'),
    (GENERIC, '{"tool_calls": [{"name": "HassTurnOn", "arguments": {}}, {"arguments": {}}]}'),
    (GENERIC, "The lamp is on."),
    (GENERIC, '["response"]'),
])
def test_what_does_not_parse_stays_text(fmt: str, text: str) -> None:
    assert parse_calls(fmt, text) == (text, [])


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)
_CALLS = st.lists(st.tuples(st.text(min_size=1, max_size=12), st.dictionaries(st.text(max_size=8), _JSON, max_size=4)),
                  min_size=1, max_size=4)


@settings(max_examples=examples(100), deadline=None)
@given(fmt=st.sampled_from(FORMATS), calls=_CALLS, before=st.sampled_from(["", "On it.", "Let me look:\n"]))
def test_calls_written_in_a_format_read_back_in_order(fmt: str, calls: list, before: str) -> None:
    if fmt == LLAMA3:
        calls, before = calls[:1], ""
    if fmt == GENERIC:
        before = ""  # the whole answer is JSON
    text = (before + "\n" if before else "") + written(fmt, calls)
    content, read_back = parse_calls(fmt, text)
    assert read_back == [ToolCall(f"call_{i}", name, arguments) for i, (name, arguments) in enumerate(calls)]
    assert content == before.strip()


@settings(max_examples=examples(100), deadline=None)
@given(fmt=st.sampled_from(FORMATS), text=st.text(max_size=60) | st.lists(st.sampled_from(
    ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "{", "}", "[", "]", '"name"', ": ", '"x"',
     ", ", '"arguments"', '"tool_calls"', '"response"', "\n", "text"]), max_size=14).map("".join))
def test_reading_never_fails_and_text_without_calls_comes_back_whole(fmt: str, text: str) -> None:
    content, calls = parse_calls(fmt, text)
    assert all(isinstance(call, ToolCall) and isinstance(call.arguments, dict) for call in calls)
    if not calls and not (fmt == GENERIC and text.strip().startswith("{")):
        assert content == text


def test_a_tool_call_is_a_frozen_value() -> None:
    call = ToolCall("call_0", *TURN_ON)
    assert call == ToolCall("call_0", "HassTurnOn", {"name": "lamp"}) != ToolCall("call_1", *TURN_ON)
    with pytest.raises(AttributeError):
        call.name = "other"  # type: ignore[misc]


# --- what may be a call, while it streams ----------------------------------------------------

@pytest.mark.parametrize("fmt", [HERMES, MISTRAL, LLAMA3])
def test_every_prefix_of_a_call_that_opens_the_answer_is_held_back(fmt: str) -> None:
    text = written(fmt, [TURN_ON])
    for end in range(1, len(text) + 1):
        assert may_hold_call(fmt, text[:end]), text[:end]
    assert may_hold_call(fmt, "  \n" + text[:3])  # after blank lines too


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL])
def test_a_call_after_some_text_is_held_back_from_its_first_marker_character(fmt: str) -> None:
    reply = "Sure, turning it on. "
    text = reply + written(fmt, [TURN_ON])
    assert not may_hold_call(fmt, reply)
    for end in range(len(reply) + 1, len(text) + 1):
        assert may_hold_call(fmt, text[:end]), text[:end]


@pytest.mark.parametrize(("fmt", "text"), [
    (HERMES, "The lamp is on."), (HERMES, "a <b>bold</b> word"), (HERMES, "<tool_x"), (HERMES, "x <"),
    (MISTRAL, "[1, 2]"), (MISTRAL, "The lamp is on."), (MISTRAL, "a [x]"),
    (LLAMA3, "The lamp is on."), (LLAMA3, "[{"), (LLAMA3, "x {"),
])
def test_text_that_cannot_start_a_call_streams_on(fmt: str, text: str) -> None:
    expected = fmt == HERMES and text.endswith("<")  # "<" may open "<tool_call>"
    assert may_hold_call(fmt, text) is expected


def test_a_generic_answer_is_always_held_back() -> None:
    assert all(may_hold_call(GENERIC, text) for text in ("", "Hello", '{"response": "x"}'))


# --- the prompt --------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Lamp on"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "HassTurnOn", "arguments": {"name": "lamp"}}}]},
    {"role": "tool", "tool_call_id": "call_0", "name": "HassTurnOn", "content": "done"},
]


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A byte-level ChatML tokenizer (its <tool_call> marks special tokens) with Qwen3's template."""
    folder = tmp_path_factory.mktemp("qwen3")
    write_chatml_tokenizer(folder, QWEN3_TEMPLATE)
    return Tokenizer(tokenizer_spec_from_hf(folder))


def test_a_template_format_gets_the_tools_as_functions_and_the_messages_as_they_are() -> None:
    messages, extra = prompt_messages(HERMES, CONVERSATION, TOOLS, parallel=True)
    assert messages == CONVERSATION and all(a is not b for a, b in zip(messages, CONVERSATION))
    assert extra == {"tools": [
        {"type": "function", "function": {"name": "HassTurnOn", "description": "turns a device on",
                                          "parameters": TOOLS[0]["parameters"]}},
        {"type": "function", "function": {"name": "GetLiveContext", "description": "",  # none given
                                          "parameters": TOOLS[1]["parameters"]}}]}


def test_qwen3s_template_renders_the_tools_the_earlier_call_and_its_result(qwen_like: Tokenizer) -> None:
    assert tool_format(qwen_like.spec.chat_template) == HERMES
    messages, extra = prompt_messages(HERMES, CONVERSATION, TOOLS, parallel=True)
    prompt = qwen_like.apply_chat_template(messages, **extra)
    system = prompt[:prompt.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    listed = system[system.index("<tools>\n") + 8:system.index("\n</tools>")].split("\n")
    assert [json.loads(line) for line in listed] == extra["tools"]
    earlier = written(HERMES, [TURN_ON])
    assert f"<|im_start|>assistant\n{earlier}<|im_end|>" in prompt
    assert "<tool_response>\ndone\n</tool_response>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    content, calls = parse_calls(HERMES, earlier)  # what the model is shown reads as the call it was
    assert content == "" and [(c.name, c.arguments) for c in calls] == [TURN_ON]


def test_the_generic_format_writes_tools_calls_and_results_into_the_turns() -> None:
    messages, extra = prompt_messages(GENERIC, CONVERSATION, TOOLS, parallel=False)
    assert extra == {}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"] == "Be brief.\n\n" + generic_system_text(TOOLS, parallel=False)
    assert messages[1] == CONVERSATION[1]
    # the earlier answer, written the way the model is asked to answer: it reads back as its calls
    assert "tool_calls" not in messages[2]
    assert read(GENERIC, messages[2]["content"]) == ("", [("call_0", *TURN_ON)])
    assert json.loads(messages[3]["content"]) == {"tool_response": {"name": "HassTurnOn", "id": "call_0",
                                                                    "content": "done"}}
    assert CONVERSATION[2]["tool_calls"] and CONVERSATION[3]["role"] == "tool"  # the caller's are unchanged


def test_the_generic_format_opens_with_a_system_turn_of_its_own_when_there_is_none() -> None:
    messages, _ = prompt_messages(GENERIC, CONVERSATION[1:2], TOOLS, parallel=True)
    assert messages == [{"role": "system", "content": generic_system_text(TOOLS, parallel=True)}, CONVERSATION[1]]
    without_tools, extra = prompt_messages(GENERIC, CONVERSATION[:2], [], parallel=True)
    assert without_tools == CONVERSATION[:2] and extra == {}


def test_the_generic_system_text_lists_every_tool_and_says_one_call_at_a_time_unless_parallel() -> None:
    single, several = generic_system_text(TOOLS, parallel=False), generic_system_text(TOOLS, parallel=True)
    listed = json.loads(single[len("You can call these tools: "):single.index("\n")])
    assert listed == [{"name": "HassTurnOn", "description": "turns a device on", "parameters": TOOLS[0]["parameters"]},
                      {"name": "GetLiveContext", "description": "", "parameters": TOOLS[1]["parameters"]}]
    assert "(one call at a time)" in single and "(one call at a time)" not in several
    assert '{"tool_calls": [{"name": <tool name>, "arguments": {...}}]}' in several and '{"response": ' in several
    assert "東京" in generic_system_text([{"name": "Weather", "description": "東京", "parameters": {}}], parallel=True)


# --- the grammar: parallel calls, forced choices ---------------------------------------------

@pytest.fixture(scope="module")
def engine(qwen_like: Tokenizer):
    return grammar_tokenizer(qwen_like)


def accepts(engine, tokenizer: Tokenizer, grammar: str, text: str) -> bool:
    """Whether ``text`` is a whole answer the grammar lets through (an end may follow it)."""
    mask = TokenMask(engine, grammar)
    try:
        mask.accept_all(tokenizer.encode(text, add_special_tokens=False))
    except GrammarError:
        return False
    row = mask.mask(np.zeros(tokenizer.vocab_size, np.float32))
    return bool(np.isfinite(row[tokenizer.eos_token_ids[0]]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_by_default_the_grammar_lets_several_calls_through_where_the_format_calls_several(
        engine, qwen_like: Tokenizer, fmt: str) -> None:
    parallel = PARALLEL_BY_DEFAULT[fmt]
    grammar = call_grammar(fmt, TOOLS, "required", parallel=parallel, tokens=qwen_like.added_token_texts)
    one = written(fmt, [TURN_ON])
    assert accepts(engine, qwen_like, grammar, one)
    if fmt == LLAMA3:  # one call is all the format can write
        assert not accepts(engine, qwen_like, grammar, one + "\n" + one)
        return
    two = written(fmt, [TURN_ON, CONTEXT])
    assert accepts(engine, qwen_like, grammar, two) is parallel
    other = call_grammar(fmt, TOOLS, "required", parallel=not parallel, tokens=qwen_like.added_token_texts)
    assert accepts(engine, qwen_like, other, two) is not parallel
    assert [c.name for c in parse_calls(fmt, two)[1]] == ["HassTurnOn", "GetLiveContext"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_forced_tool_lets_only_its_own_calls_through_with_arguments_of_its_schema(
        engine, qwen_like: Tokenizer, fmt: str) -> None:
    grammar = call_grammar(fmt, TOOLS, "HassTurnOn", parallel=False, tokens=qwen_like.added_token_texts)
    assert accepts(engine, qwen_like, grammar, written(fmt, [TURN_ON]))
    assert not accepts(engine, qwen_like, grammar, written(fmt, [CONTEXT]))
    assert not accepts(engine, qwen_like, grammar, written(fmt, [("HassTurnOn", {"name": "a much too long name"})]))
    assert not accepts(engine, qwen_like, grammar, written(fmt, [("HassTurnOn", {})]))  # name is required
    assert not accepts(engine, qwen_like, grammar, "The lamp is on.")


def test_a_free_choice_needs_no_grammar_in_a_template_format_but_the_generic_answer_is_always_json(
        engine, qwen_like: Tokenizer) -> None:
    for fmt in (HERMES, LLAMA3, MISTRAL):
        assert call_grammar(fmt, TOOLS, "auto", parallel=True) is None
    grammar = call_grammar(GENERIC, TOOLS, "auto", parallel=False)
    assert accepts(engine, qwen_like, grammar, '{"response": "It is on."}')
    assert accepts(engine, qwen_like, grammar, written(GENERIC, [TURN_ON]))
    assert not accepts(engine, qwen_like, grammar, "It is on.")


def test_with_a_reply_schema_a_free_choice_is_a_call_or_json_of_that_schema(engine, qwen_like: Tokenizer) -> None:
    schema = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
              "additionalProperties": False}
    grammar = call_grammar(HERMES, TOOLS, "auto", parallel=True, tokens=qwen_like.added_token_texts,
                           answer_schema=schema)
    assert accepts(engine, qwen_like, grammar, written(HERMES, [TURN_ON]))
    assert accepts(engine, qwen_like, grammar, '{"on": true}')
    assert not accepts(engine, qwen_like, grammar, '{"on": "yes"}')
    generic = call_grammar(GENERIC, TOOLS, "auto", parallel=True, answer_schema=schema)
    assert accepts(engine, qwen_like, generic, '{"response": {"on": false}}')
    assert not accepts(engine, qwen_like, generic, '{"response": "It is on."}')
