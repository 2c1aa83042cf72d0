"""Reasoning models: whether a chat template thinks, how a request turns thinking on or off,
and the answer's reasoning read apart from its reply.

Models of the Qwen3 / SmolLM3 / DeepSeek-R1 kind write their reasoning between ``<think>`` and
``</think>`` before the reply. As llama.cpp's server does (``reasoning_format`` "deepseek"),
ncm returns that text apart: ``reasoning_content`` on the OpenAI API, ``message.thinking`` /
``thinking`` on Ollama's, streamed too, and the reply without it.

What a template says about thinking:

- it reads ``enable_thinking`` (Qwen3, SmolLM3): a request can turn thinking on or off, and
  the template writes what that takes (an empty think block, a ``/no_think`` flag);
- it reads ``reasoning_effort``: the request's effort level is passed on to it;
- it only knows ``</think>`` (DeepSeek-R1 distills, QwQ): the model always thinks.

When a template's generation prompt opens the think block itself (``...assistant\\n<think>\\n``),
the answer starts inside it: :func:`prompt_opens_thinking` says so from the prompt's text.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's reasoning_effort values


@dataclass(frozen=True)
class ReasoningSupport:
    """How a chat template thinks: ``switch``: it reads ``enable_thinking`` (thinking can be
    turned off); ``effort``: it reads ``reasoning_effort``."""

    switch: bool
    effort: bool


def reasoning_support(chat_template: str | None) -> ReasoningSupport | None:
    """How the model behind ``chat_template`` reasons; None when it does not."""
    template = chat_template or ""
    switch, effort = "enable_thinking" in template, "reasoning_effort" in template
    if not (switch or effort or THINK_CLOSE in template):
        return None
    return ReasoningSupport(switch, effort)


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt ending in ``prompt_tail`` leaves the answer inside a think block."""
    return prompt_tail.rstrip().endswith(THINK_OPEN)


def _held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may begin ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningSplitter:
    """Text of an answer, pushed as it streams, split into its reasoning and its reply.

    The reasoning is the think block that opens the answer (or that the prompt opened:
    ``inside``); everything after its ``</think>`` is the reply, also a ``<think>`` written
    later. Whitespace around the block is dropped, as llama.cpp's reader drops it. Whatever
    the pieces, the joined output is the same as for the whole text at once.
    """

    _START, _THINKING, _AFTER, _REPLY = range(4)

    def __init__(self, *, inside: bool = False) -> None:
        self._state = self._THINKING if inside else self._START
        self._held = ""  # text that may still be a marker, or whitespace whose side is unknown
        self._reasoned = False  # some reasoning went out (leading whitespace is dropped before)

    def push(self, text: str) -> tuple[str, str]:
        """The reasoning and the reply that may go out now."""
        self._held += text
        reasoning, reply = "", ""
        while True:
            if self._state == self._START:
                head = self._held.lstrip()
                if head.startswith(THINK_OPEN):
                    self._state, self._held = self._THINKING, head[len(THINK_OPEN):]
                    continue
                if not head or THINK_OPEN.startswith(head):
                    break
                self._state = self._REPLY
            elif self._state == self._THINKING:
                end = self._held.find(THINK_CLOSE)
                if end >= 0:
                    reasoning += self._reasoning(self._held[:end].rstrip())
                    self._state, self._held = self._AFTER, self._held[end + len(THINK_CLOSE):]
                    continue
                ready = self._held[:len(self._held) - _held_prefix(self._held, THINK_CLOSE)].rstrip()
                reasoning += self._reasoning(ready)
                self._held = self._held[len(ready):]  # what may be (whitespace before) the close
                break
            elif self._state == self._AFTER:
                self._held = self._held.lstrip()
                if not self._held:
                    break
                self._state = self._REPLY
            else:
                reply, self._held = self._held, ""
                break
        return reasoning, reply

    def _reasoning(self, text: str) -> str:
        if not self._reasoned:
            text = text.lstrip()
            self._reasoned = bool(text)
        return text

    def finish(self) -> tuple[str, str]:
        """The rest: an unclosed think block is all reasoning; a lone start of one, reply."""
        held, self._held = self._held, ""
        if self._state == self._START:
            return "", held.strip() and held
        if self._state == self._THINKING:
            return self._reasoning(held.rstrip()), ""
        if self._state == self._AFTER:
            return "", held.lstrip()
        return "", held


__all__ = ["EFFORTS", "THINK_CLOSE", "THINK_OPEN", "ReasoningSplitter", "ReasoningSupport", "prompt_opens_thinking",
           "reasoning_support"]
