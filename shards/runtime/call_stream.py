"""Tool calls read while the model writes them, for OpenAI's streamed answers.

OpenAI streams a call in pieces: its index, id and name first, then its arguments' JSON text
as it is written (``delta.tool_calls[].function.arguments``), as llama.cpp's server does. The
pieces here are the model's own text: a call's arguments stream as the model writes them, and
their pieces join into the JSON text of the finished call's arguments.

Only an answer a grammar holds to its form streams its calls this way (a forced call, the
generic format, tools with a ``response_format``): there, a call's name and arguments are
written in that order, in compact JSON (:data:`shards.runtime.grammar.JSON_OPTIONS`). A free
answer's calls are held until it ends, since a call that does not parse goes back as text.
The generic format's reply, ``{"response": "..."}``, streams as its string is written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import jiter

from shards.runtime.tool_calls import GENERIC, ToolCall

# A call as a grammar writes it: its name, then its arguments (Llama 3's "parameters").
_CALL_START = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "(?:arguments|parameters)": ')
_REPLY_START = '{"response": "'


@dataclass(frozen=True)
class CallDelta:
    """One piece of a call: ``name`` on its first piece (None after), then its arguments' text."""

    index: int
    name: str | None
    arguments: str


def value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array opening at ``text[start]`` ends (past its close); None
    while it is still open."""
    depth, in_string, escaped = 0, False, False
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
    return None


class CallStream:
    """The calls of one answer, read from its text so far each time more is written.

    ``streaming``: the answer's grammar guarantees its calls' form, so they stream as written;
    else :meth:`finish` gives each call whole. ``pieces_sent``: the caller sends the calls'
    pieces as they come (OpenAI's streamed answers); else a call cut short, of which nothing
    went out, goes back as text."""

    def __init__(self, fmt: str, *, streaming: bool, pieces_sent: bool = True) -> None:
        self._fmt = fmt
        self._streaming = streaming
        self._pieces_sent = pieces_sent
        self._search_from = 0  # where the next call may start
        self._open: int | None = None  # where the arguments of the call being written start
        self._sent = 0  # of those arguments' characters
        self._calls = 0  # calls whose name went out
        self._reply = ""  # of the generic format's reply, what went out

    def read(self, text: str) -> tuple[str, list[CallDelta]]:
        """The reply text and the call pieces that may go out now; ``text`` is the answer's
        held text so far (it only grows)."""
        if not self._streaming:
            return "", []
        if self._fmt == GENERIC and text.startswith(_REPLY_START):
            return self._reply_piece(text), []
        deltas: list[CallDelta] = []
        while True:
            if self._open is None:
                found = _CALL_START.search(text, self._search_from)
                if found is None:
                    return "", deltas
                self._open, self._sent = found.end(), 0
                deltas.append(CallDelta(self._calls, json.loads(found.group(1)), ""))
                self._calls += 1
            end = value_end(text, self._open)
            stop = len(text) if end is None else end
            if stop > self._open + self._sent:
                piece = text[self._open + self._sent:stop]
                if deltas and deltas[-1].index == self._calls - 1:
                    last = deltas.pop()
                    piece = last.arguments + piece
                    deltas.append(CallDelta(last.index, last.name, piece))
                else:
                    deltas.append(CallDelta(self._calls - 1, None, piece))
                self._sent = stop - self._open
            if end is None:
                return "", deltas
            self._open, self._search_from = None, end

    def _reply_piece(self, text: str) -> str:
        try:
            reply = jiter.from_json(text.encode(), partial_mode="trailing-strings").get("response")
        except ValueError:  # not yet readable
            return ""
        if not isinstance(reply, str) or not reply.startswith(self._reply) or len(reply) == len(self._reply):
            return ""
        piece, self._reply = reply[len(self._reply):], reply
        return piece

    def finish(self, text: str, reply: str, calls: Sequence[ToolCall]) -> tuple[str, list[CallDelta]]:
        """What is left to go out once the answer ended: of ``reply`` (the answer's text without
        its calls) what did not stream, and the pieces that complete ``calls`` (whole, those that
        did not stream). An answer cut short keeps what streamed: a reply's start, a call's (a
        call whose pieces did not go out goes back as its text, as llama.cpp's server returns a
        call it cannot read)."""
        sent = self._reply
        _, deltas = self.read(text)
        if sent:
            rest = reply[len(sent):] if reply.startswith(sent) else ""
        else:
            rest = "" if self._calls and not calls and self._pieces_sent else reply
        deltas += [CallDelta(index, call.name, json.dumps(call.arguments, ensure_ascii=False))
                   for index, call in enumerate(calls) if index >= self._calls]
        return rest, deltas


__all__ = ["CallDelta", "CallStream", "value_end"]
