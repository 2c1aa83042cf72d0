"""Embeddings on both APIs: OpenAI's `/v1/embeddings`, Ollama's `/api/embed` (a batch) and
its older `/api/embeddings` (one text). They run on the orchestrator, with the embedding
models of its store (:class:`~agent.models.embeddings.EmbeddingModels`), open as long as
Ollama's `keep_alive` or the idle rule says; a chat model makes no embeddings here (the answer
says which models do).
"""

from __future__ import annotations

import base64
from typing import Any

from aiohttp import web

from agent.core.errors import InvalidRequestError
from agent.core.request_fields import OLLAMA_EMBED, OLLAMA_EMBEDDINGS, OPENAI_EMBEDDINGS, check_fields
from agent.http.api import holds_admin_token, on_orchestrator, read_json
from agent.http.app_keys import EMBEDDINGS, ROUTER
from agent.http.metrics_endpoint import REQUEST_MODEL
from agent.http.ollama import parse_duration_s
from agent.models.embeddings import Embeddings

MAX_INPUTS = 2048  # texts per request, as OpenAI bounds them
MAX_INPUT_CHARS = 1_000_000

routes = web.RouteTableDef()


def _model(request: web.Request, body: dict[str, Any]) -> str:
    """The stored embedding model ``body`` names (404 naming the known ones, 400 for a chat model)."""
    name = body.get("model")
    if not isinstance(name, str) or not name or len(name) > 256:
        raise InvalidRequestError("'model' must name an embedding model", "model")
    models = request.app[EMBEDDINGS]
    found = models.resolve(name)
    if found is not None:
        request[REQUEST_MODEL] = found
        return found
    known = ", ".join(models.names()) or "none (ncm pull all-minilm-l6-v2 stores one)"
    router = request.app[ROUTER]
    if router.catalog.resolve(name.removesuffix(":latest")) is not None:
        raise InvalidRequestError(f"{name!r} is a chat model: ncm makes embeddings with embedding models "
                                  f"(stored: {known})", "model", "model_not_embedding")
    raise InvalidRequestError(f"embedding model {name!r} does not exist; stored: {known}", "model",
                              "model_not_found", status=404)


def _texts(value: Any, field: str) -> list[str]:
    """A string or a list of strings (token arrays are refused: ncm tokenizes itself)."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or len(texts) > MAX_INPUTS:
        raise InvalidRequestError(f"'{field}' must be a string or a list of 1 to {MAX_INPUTS} strings", field)
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidRequestError(f"'{field}[{index}]' must be a string (token ids are not taken)", field)
        if len(text) > MAX_INPUT_CHARS:
            raise InvalidRequestError(f"'{field}[{index}]' is longer than {MAX_INPUT_CHARS} characters", field)
    return texts


def _dimensions(body: dict[str, Any], dimensions: int) -> None:
    wanted = body.get("dimensions")
    if wanted is not None and (isinstance(wanted, bool) or wanted != dimensions):
        raise InvalidRequestError(f"'dimensions' must be {dimensions}, the size of this model's embeddings: its "
                                  "vectors cannot be shortened", "dimensions")


def _no_options(body: dict[str, Any]) -> None:
    if body.get("options"):
        raise InvalidRequestError("'options' have no effect on an embedding model: send none", "options")


async def _embed(request: web.Request, body: Any, table: Any, field: str, *, truncate: bool = True
                 ) -> tuple[str, Embeddings]:
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    check_fields(body, table)
    name = _model(request, body)
    texts = _texts(body.get(field), field)
    keep_alive_s = parse_duration_s(body["keep_alive"]) if body.get("keep_alive") is not None else None
    models = request.app[EMBEDDINGS]
    result = await models.embed(name, texts, truncate=truncate)
    if keep_alive_s is not None:  # Ollama's: how long the model stays open after this request
        models.keep_alive(name, keep_alive_s, close=holds_admin_token(request))
    _dimensions(body, result.vectors.shape[1])
    return name, result


@routes.post("/v1/embeddings")
@on_orchestrator
async def openai_embeddings(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    encoding = body.get("encoding_format", "float") if isinstance(body, dict) else "float"
    if encoding not in ("float", "base64"):
        raise InvalidRequestError("'encoding_format' must be float or base64", "encoding_format")
    name, result = await _embed(request, body, OPENAI_EMBEDDINGS, "input")
    data = [{"object": "embedding", "index": index,
             "embedding": base64.b64encode(vector.astype("<f4").tobytes()).decode() if encoding == "base64"
             else vector.tolist()} for index, vector in enumerate(result.vectors)]
    return web.json_response({"object": "list", "data": data, "model": name,
                              "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}})


@routes.post("/api/embed")
@on_orchestrator
async def ollama_embed(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    truncate = body.get("truncate", True) if isinstance(body, dict) else True
    if not isinstance(truncate, bool):
        raise InvalidRequestError("'truncate' must be true or false", "truncate")
    if isinstance(body, dict):
        _no_options(body)
    name, result = await _embed(request, body, OLLAMA_EMBED, "input", truncate=truncate)
    return web.json_response({"model": name, "embeddings": result.vectors.tolist(),
                              "total_duration": int((result.load_s + result.embed_s) * 1e9),
                              "load_duration": int(result.load_s * 1e9), "prompt_eval_count": result.prompt_tokens})


@routes.post("/api/embeddings")
@on_orchestrator
async def ollama_embeddings(request: web.Request) -> web.StreamResponse:
    """Ollama's older endpoint: one ``prompt``, one ``embedding``."""
    body = await read_json(request)
    if isinstance(body, dict):
        _no_options(body)
        if not isinstance(body.get("prompt"), str):
            raise InvalidRequestError("'prompt' must be a string", "prompt")
    _, result = await _embed(request, body, OLLAMA_EMBEDDINGS, "prompt")
    return web.json_response({"embedding": result.vectors[0].tolist()})


__all__ = ["routes"]
