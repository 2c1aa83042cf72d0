"""The OpenAPI 3.0 document of the public API, served at `GET /openapi.json`.

It describes what apps may send and what they get back (the OpenAI-compatible endpoints,
model management, cluster views, health); the internal peer endpoints are not part of it.
The fuzzing tests generate requests from it.
"""

from __future__ import annotations

from typing import Any

from agent import __version__
from agent.core.chat_request import MAX_MESSAGES, MAX_STOP_CHARS, MAX_STOP_STRINGS, ROLES

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": "string", "nullable": True}, "code": {"type": "string", "nullable": True}},
    }},
}
_OBJECT = {"type": "object"}
_STOP = {"oneOf": [
    {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
    {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}},
], "nullable": True}
_SAMPLING = {
    "model": {"type": "string", "minLength": 1, "maxLength": 256,
              "description": "a model or alias; default: the agent's main model"},
    "max_tokens": {"type": "integer", "minimum": 1, "nullable": True},
    "max_completion_tokens": {"type": "integer", "minimum": 1, "nullable": True},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
    "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1, "nullable": True},
    "seed": {"type": "integer", "minimum": 0, "nullable": True},
    "n": {"type": "integer", "enum": [1]},
    "stop": _STOP,
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "nullable": True, "properties": {"include_usage": {"type": "boolean"}}},
    "top_k": {"type": "integer", "minimum": 0, "nullable": True},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2, "nullable": True},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2, "nullable": True},
    "repeat_penalty": {"type": "number", "minimum": 0.001, "maximum": 10, "nullable": True},
    "repeat_last_n": {"type": "integer", "minimum": -1, "nullable": True},
    "logit_bias": {"type": "object", "nullable": True, "additionalProperties": {"type": "number", "minimum": -100,
                                                                                 "maximum": 100}},
}
_JSON_SCHEMA = {"type": "object", "description": "a JSON schema"}
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_.:-]{1,128}$"}, "description": {"type": "string"},
        "parameters": _JSON_SCHEMA}}}}
_CONTENT_PART = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
_CHAT_REQUEST = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"type": "string", "enum": sorted(ROLES)},
                           "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _CONTENT_PART}],
                                       "nullable": True},
                           "tool_calls": {"type": "array", "items": _OBJECT}, "tool_call_id": {"type": "string"}},
        }},
        **_SAMPLING,
        "tools": {"type": "array", "items": _TOOL, "maxItems": 256},
        "tool_choice": {"oneOf": [{"type": "string", "enum": ["auto", "none", "required"]}, _OBJECT]},
        "parallel_tool_calls": {"type": "boolean"},
        "response_format": {"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "schema": _JSON_SCHEMA,
                                                             "strict": {"type": "boolean"}}}}},
    },
}
_COMPLETION_REQUEST = {
    "type": "object",
    "required": ["prompt"],
    "properties": {"prompt": {"type": "string", "minLength": 1}, **_SAMPLING},
}
_MODEL_BODY = {"type": "object", "required": ["model"],
               "properties": {"model": {"type": "string", "minLength": 1, "maxLength": 256}}}


_OLLAMA_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
_OLLAMA_OPTIONS = {"type": "object", "description": "sampling and context options: docs/api.md says what ncm does "
                   "with each", "properties": {
    "temperature": {"type": "number", "minimum": 0, "maximum": 2}, "top_p": {"type": "number", "minimum": 0.01, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0}, "seed": {"type": "integer"},
    "num_predict": {"type": "integer", "minimum": 1}, "num_ctx": {"type": "integer", "minimum": 1},
    "stop": {"type": "array", "items": {"type": "string", "minLength": 1}},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1}, "repeat_penalty": {"type": "number", "minimum": 0.001,
                                                                              "maximum": 10},
    "repeat_last_n": {"type": "integer", "minimum": -1}}}
_OLLAMA_COMMON = {"model": {"type": "string", "minLength": 1, "maxLength": 256}, "stream": {"type": "boolean"},
                  "options": _OLLAMA_OPTIONS,
                  "keep_alive": {"type": "string", "pattern": "^[1-9][0-9]?m$",
                                 "description": "a duration (\"5m\", \"1h\", seconds as a number); 0 unloads the model "
                                                "after the answer, a negative one keeps it loaded"},
                  "format": {"oneOf": [{"type": "string", "enum": ["json"]}, _JSON_SCHEMA]}}
_OLLAMA_CHAT = {"type": "object", "required": ["model", "messages"], "properties": {
    "messages": {"type": "array", "maxItems": MAX_MESSAGES, "items": {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"type": "string", "enum": sorted(ROLES)}, "content": {"type": "string"}}}},
    "tools": {"type": "array", "items": _TOOL, "maxItems": 256}, **_OLLAMA_COMMON}}
_OLLAMA_GENERATE = {"type": "object", "required": ["model"], "properties": {
    "prompt": {"type": "string"}, "system": {"type": "string"}, "raw": {"type": "boolean"}, **_OLLAMA_COMMON}}


_TEXTS = {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "maxItems": 2048, "items": {"type": "string"}}]}
_EMBEDDINGS_REQUEST = {"type": "object", "required": ["model", "input"], "properties": {
    "model": {"type": "string", "minLength": 1, "maxLength": 256}, "input": _TEXTS,
    "encoding_format": {"type": "string", "enum": ["float", "base64"]}, "dimensions": {"type": "integer"}}}
_OLLAMA_EMBED = {"type": "object", "required": ["model", "input"], "properties": {
    "model": {"type": "string", "minLength": 1, "maxLength": 256}, "input": _TEXTS, "truncate": {"type": "boolean"}}}
_OLLAMA_EMBEDDINGS = {"type": "object", "required": ["model", "prompt"], "properties": {
    "model": {"type": "string", "minLength": 1, "maxLength": 256}, "prompt": {"type": "string"}}}


def _answers(*statuses: int, stream: bool = False, ollama: bool = False) -> dict[str, Any]:
    responses: dict[str, Any] = {}
    for status in statuses:
        if status < 400:
            content = {"application/json": {"schema": _OBJECT}}
            if stream:
                content["application/x-ndjson" if ollama else "text/event-stream"] = {"schema": {"type": "string"}}
            responses[str(status)] = {"description": "success", "content": content}
        elif ollama:
            responses[str(status)] = {"description": "error (Ollama shape)",
                                      "content": {"application/json": {"schema": _OLLAMA_ERROR}}}
        else:
            responses[str(status)] = {"description": "error (OpenAI shape)",
                                      "content": {"application/json": {"schema": _ERROR}}}
            if status in (429, 503):
                responses[str(status)]["headers"] = {"Retry-After": {
                    "description": "seconds after which a retry may succeed (429: always; 503: when it can)",
                    "schema": {"type": "integer", "minimum": 1}}}
    return responses


def _operation(summary: str, *statuses: int, body: dict[str, Any] | None = None, admin: bool = False,
               stream: bool = False, parameters: list[dict[str, Any]] | None = None,
               ollama: bool = False) -> dict[str, Any]:
    operation: dict[str, Any] = {"summary": summary, "responses": _answers(*statuses, stream=stream, ollama=ollama)}
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if parameters:
        operation["parameters"] = parameters
    operation["security"] = [{"admin": []}] if admin else [{}, {"apiKey": []}]
    return operation


_AUTOLOAD = {"name": "autoload", "in": "query", "required": False, "schema": {"type": "boolean"}}
_COMMON = (400, 401, 404, 503)


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document (pure; the same on every agent of a version)."""
    return {
        "openapi": "3.0.3",
        "info": {"title": "ncm", "version": __version__,
                 "description": "OpenAI-compatible API of an ncm cluster; any agent answers."},
        "components": {"securitySchemes": {
            "apiKey": {"type": "http", "scheme": "bearer", "description": "one of `api_keys`, when configured"},
            "admin": {"type": "http", "scheme": "bearer", "description": "the admin token (`ncm admin-token`)"},
        }},
        "paths": {
            "/health": {"get": _operation("liveness of this agent", 200)},
            "/v1/models": {"get": _operation("the models of the cluster", 200, 401, 503)},
            "/v1/models/{model}": {"get": _operation("one model, by name or alias", 200, 401, 404, 503, parameters=[
                {"name": "model", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1,
                                                                               "maxLength": 256}}])},
            "/v1/chat/completions": {"post": _operation(
                "chat completion", 200, *_COMMON, 409, 429, body=_CHAT_REQUEST, stream=True,
                parameters=[_AUTOLOAD])},
            "/v1/completions": {"post": _operation(
                "text completion", 200, *_COMMON, 409, 429, body=_COMPLETION_REQUEST, stream=True,
                parameters=[_AUTOLOAD])},
            "/models": {"get": _operation("models, states and memory", 200, 400, 401, 503, parameters=[
                {"name": "reload", "in": "query", "required": False, "schema": {"type": "string", "enum": ["1", "true"]},
                 "description": "re-read the model sources (needs the admin token)"}])},
            "/models/load": {"post": _operation("load a model (answers once ready)", 200, *_COMMON, 409,
                                                body=_MODEL_BODY, admin=True)},
            "/models/unload": {"post": _operation("unload an idle model", 200, *_COMMON, 409, body=_MODEL_BODY,
                                                  admin=True)},
            "/models/sleep": {"post": _operation("release an idle model's memory, keeping its plan", 200, *_COMMON, 409,
                                                 body=_MODEL_BODY, admin=True)},
            "/metrics": {"get": {"summary": "this agent's metrics (Prometheus text format)", "security": [{}, {"apiKey": []}],
                                 "responses": {"200": {"description": "metrics",
                                                       "content": {"text/plain": {"schema": {"type": "string"}}}},
                                               "401": _answers(401)["401"]}}},
            "/api/version": {"get": _operation("Ollama API: the version it follows", 200, ollama=True)},
            "/api/tags": {"get": _operation("Ollama API: the models", 200, 401, 503, ollama=True)},
            "/api/ps": {"get": _operation("Ollama API: the loaded models", 200, 401, 503, ollama=True)},
            "/api/show": {"post": _operation("Ollama API: a model's details", 200, 400, 401, 404, 503, ollama=True,
                                             body=_MODEL_BODY)},
            "/api/chat": {"post": _operation("Ollama API: chat (NDJSON stream unless stream is false)", 200,
                                             *_COMMON, 409, 429, body=_OLLAMA_CHAT, stream=True, ollama=True)},
            "/api/generate": {"post": _operation("Ollama API: completion (NDJSON stream unless stream is false)", 200,
                                                 *_COMMON, 409, 429, body=_OLLAMA_GENERATE, stream=True, ollama=True)},
            "/v1/embeddings": {"post": _operation("embeddings of texts (an embedding model)", 200, 400, 401, 404, 503,
                                                  body=_EMBEDDINGS_REQUEST)},
            "/api/embed": {"post": _operation("Ollama API: embeddings of a batch", 200, 400, 401, 404, 503,
                                              ollama=True, body=_OLLAMA_EMBED)},
            "/api/embeddings": {"post": _operation("Ollama API: the embedding of one prompt (older form)", 200, 400,
                                                   401, 404, 503, ollama=True, body=_OLLAMA_EMBEDDINGS)},
            "/cluster/status": {"get": _operation("state of the cluster and its models", 200, 401, 503)},
            "/cluster/plan": {"get": _operation("the plan of the main model", 200, 401, 503)},
            "/cluster/nodes": {"get": _operation("this agent's view of the nodes", 200, 401)},
            "/cluster/join": {"post": _operation(
                "contact another agent by URL (it must prove it holds the cluster key), or join the cluster of "
                "a join string (the agent restarts as its member)", 200, 400, 401, admin=True,
                body={"type": "object", "properties": {
                    "url": {"type": "string", "maxLength": 255, "pattern": "^https?://"},
                    "invite": {"type": "string", "pattern": "^ncm1[.]"}}})},
            "/cluster/invites": {
                "post": _operation("a join string for a new device", 200, 400, 401, admin=True, body={
                    "type": "object", "properties": {"ttl_s": {"type": "number", "exclusiveMinimum": True, "minimum": 0},
                                                     "uses": {"type": "integer", "minimum": 1, "maximum": 100}}}),
                "get": _operation("the open invites (without their secrets)", 200, 401, admin=True)},
            "/cluster/invites/{invite_id}": {"delete": _operation(
                "revoke an invite", 200, 401, 404, admin=True,
                parameters=[{"name": "invite_id", "in": "path", "required": True, "schema": {"type": "string"}}])},
            "/cluster/remove": {"post": _operation(
                "remove a node: a new cluster key for every other member, who restart with it", 200, 400, 401, 503,
                admin=True, body={"type": "object", "required": ["node"], "properties": {"node": {"type": "string"}}})},
            "/cluster/pair": {"post": _operation(
                "a new device redeems an invite: the cluster key, sealed with the invite's secret", 200, 400, 403,
                body={"type": "object", "required": ["invite", "nonce", "proof"], "properties": {
                    "invite": {"type": "string"}, "nonce": {"type": "string"}, "proof": {"type": "string"}}})},
        },
    }
