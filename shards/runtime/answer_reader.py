"""An answer read as it streams: its reasoning apart (:mod:`shards.runtime.reasoning`), its
reply, and the tool calls in the reply (:mod:`shards.runtime.tool_calls`), held back from the
moment the text may be a call until the answer ends, where the calls are read out of it. The
calls also come in pieces as they are written (:mod:`shards.runtime.call_stream`), for
OpenAI's streamed answers.

One reader per request, kept apart from the loop that generates (llama.cpp's server keeps its
task results and its reader apart too): the APIs only shape what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shards.runtime.call_stream import CallDelta, CallStream
from shards.runtime.reasoning import ReasoningSplitter
from shards.runtime.tool_calls import ToolCall, may_hold_call, parse_calls


@dataclass(frozen=True)
class AnswerPiece:
    """What may go out now: reasoning text, reply text, the calls' pieces and, at the end, the
    calls whole."""

    reasoning: str = ""
    content: str = ""
    calls: tuple[ToolCall, ...] = field(default=())
    deltas: tuple[CallDelta, ...] = field(default=())

    @staticmethod
    def joined(pieces: list[AnswerPiece]) -> AnswerPiece:
        return AnswerPiece("".join(p.reasoning for p in pieces), "".join(p.content for p in pieces),
                           tuple(call for p in pieces for call in p.calls),
                           tuple(delta for p in pieces for delta in p.deltas))


class AnswerReader:
    """``tool_format``: the format of the calls the answer may hold (None: it holds none);
    ``reasoning``: the splitter of its reasoning (None: the model does not reason);
    ``show_reasoning``: False drops the reasoning (thinking was turned off, but the model
    thinks anyway); ``stream_calls``: a grammar holds the calls to their form, so they come in
    pieces as they are written (else whole, at the end); ``call_pieces``: the caller sends
    those pieces on (OpenAI's streamed answers; else a call cut short comes back as text)."""

    def __init__(self, *, tool_format: str | None = None, reasoning: ReasoningSplitter | None = None,
                 show_reasoning: bool = True, stream_calls: bool = False, call_pieces: bool = True) -> None:
        self.tool_format = tool_format
        self._splitter = reasoning
        self._show_reasoning = show_reasoning
        self._calls = CallStream(tool_format, streaming=stream_calls,
                                 pieces_sent=call_pieces) if tool_format is not None else None
        self._held = ""

    def push(self, text: str) -> AnswerPiece:
        reasoning, content = self._splitter.push(text) if self._splitter is not None else ("", text)
        content, deltas = self._hold(content)
        return AnswerPiece(reasoning if self._show_reasoning else "", content, (), tuple(deltas))

    def finish(self) -> AnswerPiece:
        """The rest of the answer, and the calls it held."""
        reasoning, content = self._splitter.finish() if self._splitter is not None else ("", "")
        content, deltas = self._hold(content)
        calls: list[ToolCall] = []
        if self._held:
            assert self._calls is not None and self.tool_format is not None
            reply, calls = parse_calls(self.tool_format, self._held)
            rest, last = self._calls.finish(self._held, reply, calls)
            content, deltas, self._held = content + rest, deltas + last, ""
        return AnswerPiece(reasoning if self._show_reasoning else "", content, tuple(calls), tuple(deltas))

    def _hold(self, text: str) -> tuple[str, list[CallDelta]]:
        if self._calls is None or not text:
            return text, []
        self._held += text
        if may_hold_call(self.tool_format, self._held):  # type: ignore[arg-type]
            return self._calls.read(self._held)
        text, self._held = self._held, ""
        return text, []


__all__ = ["AnswerPiece", "AnswerReader"]
