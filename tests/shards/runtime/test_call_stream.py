"""Tool calls read while they are written: however the text arrives, the pieces of each call
join into its name and the JSON text of its arguments, and the generic format's reply streams
as its string is written."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from shards.runtime.answer_reader import AnswerPiece, AnswerReader
from shards.runtime.call_stream import value_end
from shards.runtime.tool_calls import GENERIC, HERMES, LLAMA3, MISTRAL

CALLS = [("HassTurnOn", {"name": "kitchen {light}", "area": "a \"b\" \\ é"}), ("GetLiveContext", {})]


def written(fmt: str, calls: list[tuple[str, dict]]) -> str:
    """Calls as a grammar makes a model write them (compact JSON, name first)."""
    key = "parameters" if fmt == LLAMA3 else "arguments"
    bodies = [json.dumps({"name": name, key: arguments}, ensure_ascii=False) for name, arguments in calls]
    if fmt == HERMES:
        return "\n".join(f"<tool_call>\n{body}\n</tool_call>" for body in bodies)
    if fmt == MISTRAL:
        return "[TOOL_CALLS][" + ", ".join(bodies) + "]"
    if fmt == GENERIC:
        return '{"tool_calls": [' + ", ".join(bodies) + "]}"
    return bodies[0]


def read(reader: AnswerReader, text: str, cuts: list[int]) -> tuple[list[AnswerPiece], AnswerPiece]:
    bounds = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    pieces = [reader.push(text[a:b]) for a, b in zip(bounds, bounds[1:])]
    return pieces, AnswerPiece.joined([*pieces, reader.finish()])


def joined_calls(answer: AnswerPiece) -> list[tuple[str, dict]]:
    names: dict[int, str] = {}
    texts: dict[int, str] = {}
    for delta in answer.deltas:
        if delta.name is not None:
            assert delta.index not in names and delta.index == len(names)  # a name once, in order
            names[delta.index] = delta.name
        texts[delta.index] = texts.get(delta.index, "") + delta.arguments
    return [(names[i], json.loads(texts[i])) for i in sorted(names)]


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from([HERMES, MISTRAL, GENERIC, LLAMA3]), cuts=st.lists(st.integers(0, 400), max_size=30))
def test_the_pieces_of_streamed_calls_join_into_the_calls(fmt, cuts):
    calls = CALLS[:1] if fmt == LLAMA3 else CALLS
    pieces, answer = read(AnswerReader(tool_format=fmt, stream_calls=True), written(fmt, calls), cuts)
    assert [(c.name, c.arguments) for c in answer.calls] == calls and answer.content == ""
    assert joined_calls(answer) == calls
    if len(pieces) > 4:  # the name went out before the text ended
        assert any(piece.deltas for piece in pieces)


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 100), max_size=20))
def test_the_generic_reply_streams_as_its_string_is_written(cuts):
    reply = 'Done: the "kitchen" light is on \\ é 🙂\nbye'
    text = json.dumps({"response": reply}, ensure_ascii=True)  # escapes cut anywhere
    pieces, answer = read(AnswerReader(tool_format=GENERIC, stream_calls=True), text, cuts)
    assert answer.content == reply and not answer.calls and not answer.deltas
    assert "".join(piece.content for piece in pieces) == reply[:len("".join(piece.content for piece in pieces))]


def test_free_calls_come_whole_at_the_end():
    text = "Sure.\n" + written(HERMES, CALLS)
    pieces, answer = read(AnswerReader(tool_format=HERMES), text, list(range(len(text))))
    assert not any(piece.deltas for piece in pieces[:-1]) and joined_calls(answer) == CALLS
    assert answer.content.strip() == "Sure."


def test_a_call_cut_short_keeps_what_streamed():
    text = written(HERMES, CALLS[:1])[:60]  # inside its arguments
    _, answer = read(AnswerReader(tool_format=HERMES, stream_calls=True), text, list(range(len(text))))
    assert not answer.calls and answer.content == ""
    assert [d.name for d in answer.deltas if d.name] == ["HassTurnOn"]


def test_a_call_cut_short_whose_pieces_are_not_sent_comes_back_as_its_text():
    """Ollama's answers, and OpenAI's unstreamed ones, send no pieces: a call cut short (the
    answer ran out of tokens in its arguments) comes back as the text the model wrote."""
    text = '{"tool_calls": [' + json.dumps({"name": "HassTurnOn", "arguments": {"domain": ["light"] * 30}})[:90]
    _, answer = read(AnswerReader(tool_format=GENERIC, stream_calls=True, call_pieces=False), text,
                     list(range(0, len(text), 7)))
    assert not answer.calls and answer.content == text


def test_value_end():
    assert value_end('{"a": "}", "b": [1, {"c": "\\""}]} tail', 0) == 33
    assert value_end('{"a": [1, 2', 0) is None
