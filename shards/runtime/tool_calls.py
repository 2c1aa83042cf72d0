"""Tool calls in a model's own syntax: which one a chat template uses, how tools reach the
prompt, the grammar that forces a well-formed call, and reading calls back out of the text.

The formats follow llama.cpp's ``common/chat.cpp``, chosen from the chat template:

- ``hermes`` (Qwen 2.5/3, Hermes, SmolLM3...): ``<tool_call>{"name", "arguments"}</tool_call>``.
- ``llama3`` (Llama 3.1+): a JSON object ``{"name", "parameters"}``, after ``<|python_tag|>`` or alone.
- ``mistral`` (Mistral, Ministral): ``[TOOL_CALLS][{"name", "arguments"}, ...]``.

A marker the tokenizer holds as an added token is one token in the grammar, and stays in the
decoded text (:data:`shards.text.tokenizer.KEPT_MARKERS`); calls are read without it too.
- ``generic`` (a template that knows no tools, such as SmolLM2's): the tools are described in
  the system turn and the whole answer is JSON, ``{"tool_calls": [...]}`` or
  ``{"response": "..."}``, always constrained by a grammar (a small model cannot be trusted
  with free-form JSON).

Template formats render the tools with the template itself (transformers' ``tools``
variable). A call that does not parse stays text, as llama.cpp's server leaves it: never an
error. Tools are plain dicts here, ``{"name", "description", "parameters"}``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shards.runtime.grammar import ThinkFirst, answer_grammar, json_schema_grammar, lark_json, marker

HERMES, LLAMA3, MISTRAL, GENERIC = "hermes", "llama3", "mistral", "generic"
FORMATS = (HERMES, LLAMA3, MISTRAL, GENERIC)
# Several calls in one answer unless a request says otherwise: where the format's templates
# write several, as llama.cpp's server defaults parallel_tool_calls to the template's support
# (one at a time in the generic format, whose small models otherwise repeat a call to the end).
PARALLEL_BY_DEFAULT = {HERMES: True, MISTRAL: True, LLAMA3: False, GENERIC: False}
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name and its arguments (a JSON object)."""

    id: str
    name: str
    arguments: dict[str, Any]


def tool_format(chat_template: str | None) -> str:
    """The tool-call format a chat template uses."""
    template = chat_template or ""
    if "tools" not in template:
        return GENERIC
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3
    return GENERIC


def _function(tool: Mapping[str, Any]) -> dict[str, Any]:
    return {"name": tool["name"], "description": tool.get("description", ""), "parameters": tool["parameters"]}


def _call_schema(tool: Mapping[str, Any], arguments_key: str = "arguments") -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool["name"]}, arguments_key: tool["parameters"]},
            "required": ["name", arguments_key], "additionalProperties": False}


def _one_of(tools: Sequence[Mapping[str, Any]], arguments_key: str = "arguments") -> dict[str, Any]:
    schemas = [_call_schema(tool, arguments_key) for tool in tools]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def generic_system_text(tools: Sequence[Mapping[str, Any]], *, parallel: bool) -> str:
    """What a model without a tool template is told (llama.cpp's generic format, in words)."""
    listed = json.dumps([_function(tool) for tool in tools], ensure_ascii=False)
    one = "" if parallel else " (one call at a time)"
    return (f"You can call these tools: {listed}\n"
            'Answer in JSON: either {"tool_calls": [{"name": <tool name>, "arguments": {...}}]} to call tools'
            f'{one}, or {{"response": <your reply to the user>}}.')


def prompt_messages(fmt: str, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]], *,
                    parallel: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages to render and the extra template variables, for ``tools`` in ``fmt``."""
    if fmt != GENERIC:
        return [dict(m) for m in messages], {"tools": [{"type": "function", "function": _function(t)} for t in tools]}
    rendered: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):  # an earlier answer, written the way it is asked to answer
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in message.pop("tool_calls")]
            message["content"] = json.dumps({"tool_calls": calls}, ensure_ascii=False)
        elif message["role"] == "tool":  # a template without tools knows no tool role
            result = {"tool_response": {"name": message.get("name", ""), "id": message.get("tool_call_id", ""),
                                        "content": message["content"]}}
            message = {"role": "user", "content": json.dumps(result, ensure_ascii=False)}
        rendered.append(message)
    if tools:
        system = generic_system_text(tools, parallel=parallel)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{system}"}
        else:
            rendered.insert(0, {"role": "system", "content": system})
    return rendered, {}


def call_grammar(fmt: str, tools: Sequence[Mapping[str, Any]], choice: str, *, parallel: bool,
                 tokens: frozenset[str] = frozenset(), answer_schema: dict[str, Any] | None = None,
                 think: ThinkFirst | None = None) -> str | None:
    """The grammar the answer follows: None when it is free (``auto`` in a template format,
    without ``answer_schema``); ``choice`` is auto, required or the name of the one tool to
    call; ``tokens``: the texts of the tokenizer's added tokens; ``answer_schema``: the JSON
    schema of an answer that calls no tool (``response_format`` with tools, ``auto``);
    ``think``: the think block a reasoning model writes first."""
    if choice not in ("auto", "required"):
        tools = [tool for tool in tools if tool["name"] == choice]
    free = choice == "auto"
    if fmt == GENERIC:
        calls = {"type": "array", "items": _one_of(tools), "minItems": 1}
        if not parallel:
            calls["maxItems"] = 1
        answer = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                  "additionalProperties": False}
        if free:
            reply = {"type": "object", "properties": {"response": answer_schema or {"type": "string"}},
                     "required": ["response"], "additionalProperties": False}
            answer = {"anyOf": [answer, reply]}
        return json_schema_grammar(answer, think)
    if free and answer_schema is None:
        return None
    if fmt == HERMES:
        opening, closing = marker("<tool_call>", tokens), marker("</tool_call>", tokens)
        call = f'{opening} "\\n" {lark_json(_one_of(tools))} "\\n" {closing}'
        calls = f"{call} (\"\\n\" {call})*" if parallel else call
    elif fmt == LLAMA3:
        calls = lark_json(_one_of(tools, "parameters"))
    else:
        listed = {"type": "array", "items": _one_of(tools), "minItems": 1}
        if not parallel:
            listed["maxItems"] = 1
        calls = f'{marker("[TOOL_CALLS]", tokens)} {lark_json(listed)}'
    if free:  # a call, or the answer in its schema
        return answer_grammar(f"answer: calls | reply\ncalls: {calls}\nreply: {lark_json(answer_schema)}\n", think)
    return answer_grammar(f"answer: {calls}\n", think)


def _as_call(value: Any, index: int, arguments_key: str = "arguments") -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(f"call_{index}", value["name"], arguments)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_calls(fmt: str, text: str) -> tuple[str, list[ToolCall]]:
    """The answer's text without its calls, and the calls (none when they do not parse)."""
    if fmt == GENERIC:
        answer = _json(text)
        if isinstance(answer, dict) and "response" in answer and "tool_calls" not in answer:
            reply = answer["response"]  # a string, or the JSON of a response_format
            return (reply if isinstance(reply, str) else json.dumps(reply, ensure_ascii=False)), []
        raw = answer.get("tool_calls") if isinstance(answer, dict) else None
        calls = [_as_call(call, i) for i, call in enumerate(raw)] if isinstance(raw, list) else []
        return (("", calls) if calls and all(calls) else (text, []))  # type: ignore[return-value]
    if fmt == HERMES:
        found = [_as_call(_json(body), i) for i, body in enumerate(_HERMES_CALL.findall(text))]
        if not found or not all(found):
            return text, []
        return _HERMES_CALL.sub("", text).strip(), found  # type: ignore[return-value]
    if fmt == LLAMA3:
        body = text.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in text else text
        call = _as_call(_json(body.strip()), 0, "parameters")
        return ("", [call]) if call is not None else (text, [])
    # the marker is a special token, which the text may have left out
    before, body = text.split("[TOOL_CALLS]", 1) if "[TOOL_CALLS]" in text else ("", text)
    raw = _json(body.strip())
    calls = [_as_call(call, i) for i, call in enumerate(raw)] if isinstance(raw, list) else []
    return (before.strip(), calls) if calls and all(calls) else (text, [])  # type: ignore[return-value]


def may_hold_call(fmt: str, text: str) -> bool:
    """Whether the text streamed so far may be (the start of) a call, so that it is held back
    until the answer ends: a template format's call opens the answer or follows its text."""
    if fmt == GENERIC:
        return True
    marker = {HERMES: "<tool_call>", MISTRAL: "[TOOL_CALLS]", LLAMA3: "<|python_tag|>"}[fmt]
    stripped = text.lstrip()
    if marker in text or stripped.startswith({LLAMA3: "{", MISTRAL: "[{"}.get(fmt, marker)):
        return True
    if stripped and marker.startswith(stripped):
        return True
    return any(text.endswith(marker[:n]) for n in range(1, len(marker)))


__all__ = ["FORMATS", "GENERIC", "HERMES", "LLAMA3", "MISTRAL", "ToolCall", "call_grammar", "may_hold_call",
           "parse_calls", "prompt_messages", "tool_format"]
