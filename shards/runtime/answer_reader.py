"""An answer read as it streams: its reasoning apart (:mod:`shards.runtime.reasoning`), its
reply, and the tool calls in the reply (:mod:`shards.runtime.tool_calls`), held back from the
moment the text may be a call until the answer ends, where the calls are read out of it.

One reader per request, kept apart from the loop that generates (llama.cpp's server keeps its
task results and its reader apart too): the APIs only shape what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shards.runtime.reasoning import ReasoningSplitter
from shards.runtime.tool_calls import ToolCall, may_hold_call, parse_calls


@dataclass(frozen=True)
class AnswerPiece:
    """What may go out now: reasoning text, reply text and, at the end, the calls."""

    reasoning: str = ""
    content: str = ""
    calls: tuple[ToolCall, ...] = field(default=())

    @staticmethod
    def joined(pieces: list[AnswerPiece]) -> AnswerPiece:
        return AnswerPiece("".join(p.reasoning for p in pieces), "".join(p.content for p in pieces),
                           tuple(call for p in pieces for call in p.calls))


class AnswerReader:
    """``tool_format``: the format of the calls the answer may hold (None: it holds none);
    ``reasoning``: the splitter of its reasoning (None: the model does not reason);
    ``show_reasoning``: False drops the reasoning (thinking was turned off, but the model
    thinks anyway)."""

    def __init__(self, *, tool_format: str | None = None, reasoning: ReasoningSplitter | None = None,
                 show_reasoning: bool = True) -> None:
        self.tool_format = tool_format
        self._splitter = reasoning
        self._show_reasoning = show_reasoning
        self._held = ""

    def push(self, text: str) -> AnswerPiece:
        reasoning, content = self._splitter.push(text) if self._splitter is not None else ("", text)
        return AnswerPiece(reasoning if self._show_reasoning else "", self._hold(content))

    def finish(self) -> AnswerPiece:
        """The rest of the answer, and the calls it held."""
        reasoning, content = self._splitter.finish() if self._splitter is not None else ("", "")
        content = self._hold(content)
        calls: list[ToolCall] = []
        if self._held:
            rest, calls = parse_calls(self.tool_format, self._held)  # type: ignore[arg-type]
            content, self._held = content + rest, ""
        return AnswerPiece(reasoning if self._show_reasoning else "", content, tuple(calls))

    def _hold(self, text: str) -> str:
        if self.tool_format is None or not text:
            return text
        self._held += text
        if may_hold_call(self.tool_format, self._held):
            return ""
        text, self._held = self._held, ""
        return text


__all__ = ["AnswerPiece", "AnswerReader"]
