"""Validation of OpenAI-style requests (`/v1/chat/completions`, `/v1/completions`).

Pure: turns a decoded JSON body into a frozen request or raises InvalidRequestError naming
the parameter, so the API answers 4xx in the OpenAI error shape and never crashes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from agent.core.errors import InvalidRequestError

MAX_MESSAGES = 1024
MAX_CONTENT_CHARS = 1_000_000
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: tuple[tuple[str, str], ...] | None
    prompt: str | None
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


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
        parsed = []
        for index, message in enumerate(raw):
            where = f"messages[{index}]"
            if not isinstance(message, dict):
                raise InvalidRequestError(f"{where} must be an object with 'role' and 'content'", where)
            role = message.get("role")
            if not isinstance(role, str) or role not in ROLES:
                raise InvalidRequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {repr(role)[:40]}",
                                          f"{where}.role")
            parsed.append((ROLES[role], _content(message.get("content"), f"{where}.content")))
        messages = tuple(parsed)
    else:
        raw_prompt = body.get("prompt")
        if isinstance(raw_prompt, list) and len(raw_prompt) == 1 and isinstance(raw_prompt[0], str):
            raw_prompt = raw_prompt[0]
        if not isinstance(raw_prompt, str) or not raw_prompt:
            raise InvalidRequestError("'prompt' must be a non-empty string", "prompt")
        if len(raw_prompt) > MAX_CONTENT_CHARS:
            raise InvalidRequestError(f"'prompt' is longer than {MAX_CONTENT_CHARS} characters", "prompt")
        prompt = raw_prompt

    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise InvalidRequestError(f"'max_tokens' must be a positive integer, got {max_tokens!r}", "max_tokens")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise InvalidRequestError(f"'seed' must be a non-negative integer, got {seed!r}", "seed")
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
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
    )
