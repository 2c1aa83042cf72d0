"""An answer read as it streams: reasoning apart, the reply, the calls held back and read at the end."""

from __future__ import annotations

from shards.runtime.answer_reader import AnswerPiece, AnswerReader
from shards.runtime.reasoning import ReasoningSplitter

ANSWER = '<think>\nThe user wants the weather.\n</think>\n\nLet me look.\n<tool_call>\n{"name": "get_weather", ' \
         '"arguments": {"city": "Paris"}}\n</tool_call>'


def read(reader: AnswerReader, text: str) -> tuple[list[AnswerPiece], AnswerPiece]:
    pieces = [reader.push(char) for char in text]
    return pieces, AnswerPiece.joined([*pieces, reader.finish()])


def test_reasoning_reply_and_a_call_come_apart():
    pieces, answer = read(AnswerReader(tool_format="hermes", reasoning=ReasoningSplitter()), ANSWER)
    assert answer.reasoning == "The user wants the weather." and answer.content.rstrip() == "Let me look."
    assert [(c.name, c.arguments) for c in answer.calls] == [("get_weather", {"city": "Paris"})]
    assert not any("<tool_call>" in p.content for p in pieces)  # held back until the end


def test_reasoning_left_out_and_no_tools():
    _, answer = read(AnswerReader(reasoning=ReasoningSplitter(), show_reasoning=False), ANSWER)
    assert answer.reasoning == "" and answer.content.startswith("Let me look.\n<tool_call>") and not answer.calls


def test_a_model_that_does_not_reason_reads_as_it_is():
    _, answer = read(AnswerReader(), ANSWER)
    assert answer == AnswerPiece("", ANSWER, ())
