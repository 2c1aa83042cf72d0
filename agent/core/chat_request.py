"""Validation of OpenAI-style requests (`/v1/chat/completions`, `/v1/completions`; the
Ollama endpoints translate theirs into this form).

Pure: turns a decoded JSON body into a frozen request or raises InvalidRequestError naming
the parameter, so the API answers 4xx in the OpenAI error shape and never crashes. Which
fields a body may hold at all is :mod:`agent.core.request_fields`' concern.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from agent.core.errors import InvalidRequestError
from agent.core.request_fields import integer
from agent.core.wire import MAX_DRAFT_TOKENS

MAX_MESSAGES = 1024
MAX_CONTENT_CHARS = 1_000_000
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_TOOLS = 256
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
TOOL_CHOICES = ("auto", "none", "required")
# Keys a message may hold: what ncm renders, and those that must stay empty (text models).
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "tool_name", "thinking", "reasoning_content"}
_EMPTY_MESSAGE_KEYS = {"images", "refusal", "audio"}
# OpenAI's reasoning_effort values; Ollama's think takes the last three too
EFFORTS = ("none", "minimal", "low", "medium", "high")
MAX_TEMPLATE_VARIABLES = 16
_TEMPLATE_VARIABLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
# what ncm itself gives the chat template: a request cannot set it
_RESERVED_TEMPLATE_VARIABLES = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "pad_token",
                                "unk_token"}


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its JSON schema of arguments in ``parameters``."""

    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    # each {"role", "content"} and, rendered by the chat template, "tool_calls" (assistant:
    # [{"id", "type": "function", "function": {"name", "arguments": {...}}}]), "tool_call_id"
    # and "name" (tool results)
    messages: tuple[dict[str, Any], ...] | None
    prompt: str | None
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64
    logit_bias: tuple[tuple[int, float], ...] = ()
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "auto"  # auto, none, required, or the name of the one tool to call
    parallel_tool_calls: bool | None = None  # None: as the tool format supports (one call, or several)
    json_schema: dict[str, Any] | None = None  # the answer is JSON valid under it
    logprobs: int | None = None  # report each token's log-probability and this many alternatives
    think: bool | None = None  # thinking on or off (None: as the model's template decides)
    reasoning_effort: str | None = None  # low, medium, high...: passed to a template that reads it
    template_variables: tuple[tuple[str, Any], ...] = ()  # more variables of the chat template
    think_field: str = "think"  # the field that said whether to think, for errors to name
    cache_prompt: bool = True  # start from a kept KV cache of a request that began the same way
    draft_tokens: int | None = None  # most tokens a speculative step drafts (None: the agent's setting)
    draft_p_min: float | None = None  # a draft model's token less likely than this ends its draft (None: 0.2)

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def sampling_fields(self) -> dict[str, Any]:
        """The fields :class:`~shards.runtime.sampling.SamplingParams` takes as they are."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "seed": self.seed, "stop": self.stop, "repeat_penalty": self.repeat_penalty,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "repeat_last_n": self.repeat_last_n, "logit_bias": self.logit_bias, "logprobs": self.logprobs}


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not low <= value <= high:
        raise InvalidRequestError(f"'{name}' must be a number between {low:g} and {high:g}, got {value!r}", name)
    return float(value)


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{where}: only text content parts are supported", where)
            parts.append(part["text"])
        text = "".join(parts)
    elif value is None:
        text = ""
    else:
        raise InvalidRequestError(f"{where} must be a string or a list of text parts", where)
    if len(text) > MAX_CONTENT_CHARS:
        raise InvalidRequestError(f"{where} is longer than {MAX_CONTENT_CHARS} characters", where)
    return text


MAX_MODEL_NAME_CHARS = 256


def check_model_name(model: Any) -> str:
    """``model`` if it can be a model name or alias, else InvalidRequestError saying why."""
    if not isinstance(model, str) or not model:
        raise InvalidRequestError("'model' must be a non-empty string", "model")
    if len(model) > MAX_MODEL_NAME_CHARS:
        raise InvalidRequestError(f"'model' is {len(model)} characters long; a model name or alias has at most "
                                  f"{MAX_MODEL_NAME_CHARS} (GET /v1/models lists them)", "model")
    return model


def parse_request(body: Any, *, chat: bool) -> ChatRequest:
    """Validate a chat (``chat=True``) or plain completion body."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None:
        check_model_name(model)
    messages: tuple[tuple[str, str], ...] | None = None
    prompt: str | None = None
    if chat:
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise InvalidRequestError("'messages' must be a non-empty list of {role, content} objects", "messages")
        if len(raw) > MAX_MESSAGES:
            raise InvalidRequestError(f"at most {MAX_MESSAGES} messages are accepted", "messages")
        messages = tuple(_message(message, f"messages[{index}]") for index, message in enumerate(raw))
    else:
        raw_prompt = body.get("prompt")
        if isinstance(raw_prompt, list) and len(raw_prompt) == 1 and isinstance(raw_prompt[0], str):
            raw_prompt = raw_prompt[0]
        if not isinstance(raw_prompt, str) or not raw_prompt:
            raise InvalidRequestError("'prompt' must be a non-empty string", "prompt")
        if len(raw_prompt) > MAX_CONTENT_CHARS:
            raise InvalidRequestError(f"'prompt' is longer than {MAX_CONTENT_CHARS} characters", "prompt")
        prompt = raw_prompt

    max_tokens = _integer(body, "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens", 1)
    seed = _integer(body, "seed", 0, 2**63 - 1)
    if integer(body.get("n", 1)) != 1:
        raise InvalidRequestError("only n=1 is supported", "n")
    stop_value = body.get("stop")
    if stop_value is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_value, str):
        stop = (stop_value,)
    elif isinstance(stop_value, list) and all(isinstance(s, str) for s in stop_value):
        stop = tuple(stop_value)
    else:
        raise InvalidRequestError("'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise InvalidRequestError(f"'stop' takes up to {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequestError("'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise InvalidRequestError("'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    repeat_last_n = _integer(body, "repeat_last_n", -1)
    return ChatRequest(
        model=model,
        messages=messages,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        seed=seed,
        stop=stop,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        top_k=_integer(body, "top_k", 0) or 0,
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        repeat_penalty=_number(body, "repeat_penalty", 1.0, 1e-3, 10.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repeat_last_n=64 if repeat_last_n is None else repeat_last_n,
        logit_bias=_logit_bias(body.get("logit_bias")),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        json_schema=response_schema(body.get("response_format")),
        logprobs=_logprobs(body, chat=chat),
        cache_prompt=_flag(body, "cache_prompt", True),
        draft_tokens=_integer(body, "speculative.n_max", 0, MAX_DRAFT_TOKENS),
        draft_p_min=None if body.get("speculative.p_min") is None else _number(body, "speculative.p_min", 0, 0, 1),
        **_reasoning(body),
    )


def _reasoning(body: dict[str, Any]) -> dict[str, Any]:
    """``think`` (Ollama: true, false or an effort), ``reasoning_effort`` (OpenAI) and llama.cpp's
    ``chat_template_kwargs`` (whose ``enable_thinking`` is one more way to say ``think``), made
    one: a request whose fields disagree is refused."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or len(kwargs) > MAX_TEMPLATE_VARIABLES:
        raise InvalidRequestError(f"'chat_template_kwargs' must be an object of at most {MAX_TEMPLATE_VARIABLES} "
                                  "template variables", "chat_template_kwargs")
    for key in kwargs:
        if not _TEMPLATE_VARIABLE.match(key) or key in _RESERVED_TEMPLATE_VARIABLES:
            raise InvalidRequestError(f"'chat_template_kwargs' cannot set {key[:64]!r}: ncm gives the template "
                                      "its messages, tools and special tokens itself", "chat_template_kwargs")
    variables = dict(kwargs)
    wishes: list[tuple[str, bool, str | None]] = []  # (field, think, effort)
    if "enable_thinking" in variables:
        enabled = variables.pop("enable_thinking")
        if not isinstance(enabled, bool):
            raise InvalidRequestError("'chat_template_kwargs.enable_thinking' must be true or false",
                                      "chat_template_kwargs")
        wishes.append(("chat_template_kwargs", enabled, None))
    for field, value in (("chat_template_kwargs", variables.pop("reasoning_effort", None)),
                         ("reasoning_effort", body.get("reasoning_effort"))):
        if value is not None:
            level = _effort(value, field)
            wishes.append((field, level != "none", None if level == "none" else level))
    think = body.get("think")
    if think is not None:
        if isinstance(think, bool):
            wishes.append(("think", think, None))
        elif isinstance(think, str) and think in EFFORTS[2:]:
            wishes.append(("think", True, think))
        else:
            raise InvalidRequestError("'think' must be true, false, \"low\", \"medium\" or \"high\"", "think")
    if not wishes:
        return {"template_variables": tuple(sorted(variables.items()))}
    field, wanted, level = wishes[-1]
    for other, other_think, _ in wishes[:-1]:
        if other_think != wanted:
            raise InvalidRequestError(f"'{field}' and '{other}' disagree on thinking: send one of them", field)
    level = level or next((effort for _, _, effort in wishes if effort), None)
    return {"think": wanted, "reasoning_effort": level, "template_variables": tuple(sorted(variables.items())),
            "think_field": field}


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise InvalidRequestError(f"'{name}' must be true or false", name)
    return value


def _effort(value: Any, field: str) -> str:
    if not isinstance(value, str) or value not in EFFORTS:
        raise InvalidRequestError(f"'{field}' must be one of {', '.join(EFFORTS)}, got {str(value)[:40]!r}", field)
    return value


def _logprobs(body: dict[str, Any], *, chat: bool) -> int | None:
    """How many alternatives to report with each token's log-probability (None: no log-probabilities):
    chat's ``logprobs: true`` with ``top_logprobs`` (0-20), the legacy completions' ``logprobs`` (0-5)."""
    wanted = body.get("logprobs")
    if not chat:
        return None if wanted is None or wanted is False else _integer(body, "logprobs", 0, 5)
    if wanted is not None and not isinstance(wanted, bool):
        raise InvalidRequestError("'logprobs' must be true or false", "logprobs")
    top = _integer(body, "top_logprobs", 0, 20)
    if not wanted:
        if top:
            raise InvalidRequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return top or 0


def _integer(body: dict[str, Any], name: str, low: int, high: int = 2**63 - 1) -> int | None:
    """An integer field (``8192.0`` counts as one), None when absent."""
    value = body.get(name)
    if value is None:
        return None
    number = integer(value)
    if number is None or not low <= number <= high:
        bound = f"between {low} and {high}" if high < 2**63 - 1 else f"of at least {low}"
        raise InvalidRequestError(f"'{name}' must be an integer {bound}, got {str(value)[:40]}", name)
    return number


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > 1024:
        raise InvalidRequestError("'logit_bias' must map token ids to numbers (at most 1024)", "logit_bias")
    pairs = []
    for key, bias in value.items():
        if not isinstance(key, str) or not key.isdigit() or len(key) > 12:
            raise InvalidRequestError(f"'logit_bias' keys must be token ids, got {key[:20]!r}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise InvalidRequestError(f"'logit_bias' values must be numbers between -100 and 100, got {bias!r}",
                                      "logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def _message(message: Any, where: str) -> dict[str, Any]:
    """A message as the chat template takes it."""
    if not isinstance(message, dict):
        raise InvalidRequestError(f"{where} must be an object with 'role' and 'content'", where)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidRequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {repr(role)[:40]}",
                                  f"{where}.role")
    for key, value in message.items():
        if key in _EMPTY_MESSAGE_KEYS and value:
            what = "images" if key == "images" else f"'{key}'"
            raise InvalidRequestError(f"{where}: {what} are not supported by ncm (text models only)" if key == "images"
                                      else f"{where}: {what} is not supported by ncm", f"{where}.{key}")
        if key not in _MESSAGE_KEYS and key not in _EMPTY_MESSAGE_KEYS:
            raise InvalidRequestError(f"unknown field '{where}.{key}'", f"{where}.{key}", "unsupported_field")
    parsed: dict[str, Any] = {"role": ROLES[role], "content": _content(message.get("content"), f"{where}.content")}
    name = message.get("name", message.get("tool_name"))
    if name is not None:
        if not isinstance(name, str) or len(name) > 256:
            raise InvalidRequestError(f"{where}.name must be a string", f"{where}.name")
        parsed["name"] = name
    reasoning = message.get("reasoning_content", message.get("thinking"))
    if reasoning:  # an earlier answer's reasoning: the template decides whether it shows
        key = "reasoning_content" if "reasoning_content" in message else "thinking"
        if role != "assistant" or not isinstance(reasoning, str) or len(reasoning) > MAX_CONTENT_CHARS:
            raise InvalidRequestError(f"{where}.{key} must be the text of an assistant message's reasoning",
                                      f"{where}.{key}")
        parsed["reasoning_content"] = reasoning
    if message.get("tool_calls"):
        if role != "assistant":
            raise InvalidRequestError(f"{where}: only assistant messages carry tool_calls", f"{where}.tool_calls")
        parsed["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidRequestError(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
        if call_id is not None:
            parsed["tool_call_id"] = call_id
    return parsed


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """Tool calls of an earlier answer (OpenAI's arguments as JSON text, Ollama's as an object)."""
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise InvalidRequestError(f"{where} must be a list of tool calls", where)
    calls = []
    for index, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"{where}[{index}] must be {{\"function\": {{\"name\", \"arguments\"}}}}",
                                      f"{where}[{index}]")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise InvalidRequestError(f"{where}[{index}].function.arguments is not JSON text",
                                          f"{where}[{index}].function.arguments") from None
        if not isinstance(arguments, dict):
            raise InvalidRequestError(f"{where}[{index}].function.arguments must be a JSON object",
                                      f"{where}[{index}].function.arguments")
        call_id = call.get("id") or f"call_{index}"
        if not isinstance(call_id, str):
            raise InvalidRequestError(f"{where}[{index}].id must be a string", f"{where}[{index}].id")
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return calls


def _tools(value: Any) -> tuple[Tool, ...]:
    """``tools`` in OpenAI's form ({"type": "function", "function": {...}}), which Ollama's is too."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise InvalidRequestError(f"'tools' must be a list of at most {MAX_TOOLS} functions", "tools")
    tools: dict[str, Tool] = {}
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(tool.get("function"), dict):
            raise InvalidRequestError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
        function = tool["function"]
        name, description = function.get("name"), function.get("description") or ""
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise InvalidRequestError(f"{where}.function.name must be 1-128 letters, digits, '_', '.', ':' or '-'",
                                      f"{where}.function.name")
        if name in tools:
            raise InvalidRequestError(f"{where}: a second tool named {name!r}", f"{where}.function.name")
        if not isinstance(description, str):
            raise InvalidRequestError(f"{where}.function.description must be a string", f"{where}.function.description")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema object",
                                      f"{where}.function.parameters")
        if function.get("strict") not in (None, False, True):
            raise InvalidRequestError(f"{where}.function.strict must be true or false", f"{where}.function.strict")
        tools[name] = Tool(name, description, parameters)
    return tuple(tools.values())


def _tool_choice(value: Any, tools: tuple[Tool, ...]) -> str:
    if value is None:
        return "auto"
    if isinstance(value, str) and value in TOOL_CHOICES:
        choice = value
    elif isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        choice = value["function"].get("name")
        if not any(tool.name == choice for tool in tools):
            raise InvalidRequestError(f"'tool_choice' names {str(choice)[:60]!r}, which is not in 'tools'",
                                      "tool_choice")
    else:
        raise InvalidRequestError("'tool_choice' must be auto, none, required or "
                                  "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if choice != "none" and choice != "auto" and not tools:
        raise InvalidRequestError(f"'tool_choice' is {choice!r} but no 'tools' are given", "tool_choice")
    return choice


def response_schema(value: Any) -> dict[str, Any] | None:
    """The JSON schema the answer must follow, from OpenAI's ``response_format`` (None: text)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequestError("'response_format.json_schema.schema' must be a JSON schema object",
                                      "response_format")
        return schema
    raise InvalidRequestError("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                              "{\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\"}}", "response_format")
