"""Embeddings on both APIs: OpenAI's `/v1/embeddings`, Ollama's `/api/embed` (a batch) and
its older `/api/embeddings` (one text). The orchestrator answers them: with an embedding
model, whole, on the node the router places it on (itself when it has room, else the node
with the most; :mod:`agent.core.embedding_placement`), open there as long as Ollama's
`keep_alive` or the idle rule says (:class:`~agent.models.embeddings.EmbeddingModels`); or
with a chat model through its pipeline, pooled as llama.cpp's server pools a decoder with
`--pooling last`: the final norm's hidden state of the text's last token, L2-normalised
(:meth:`~agent.orchestration.token_loop.TokenLoop.embed`).
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import numpy as np
from aiohttp import web

from agent.cluster.peer_client import PeerError
from agent.core.errors import (
    ClusterError,
    InvalidRequestError,
    PublicAnswer,
    RelayedError,
    UnknownModelError,
    WireError,
    without_addresses,
)
from agent.core.protocol import EMBED_PATH, Embeddings, EmbedOrder
from agent.core.request_fields import OLLAMA_EMBED, OLLAMA_EMBEDDINGS, OPENAI_EMBEDDINGS, check_fields
from agent.http.admin import holds_admin_token
from agent.http.app_keys import CLIENT, EMBEDDINGS, MEMBERSHIP, NODE_ID, ORCHESTRATOR, ROUTER
from agent.http.bodies import read_json
from agent.http.clients import client_of
from agent.http.metrics_endpoint import REQUEST_MODEL
from agent.http.ollama import parse_duration_s
from agent.http.proxy import on_orchestrator
from agent.models.embeddings import open_everywhere

MAX_INPUTS = 2048  # texts per request, as OpenAI bounds them
MAX_INPUT_CHARS = 1_000_000
REMOTE_EMBED_TIMEOUT_S = 600.0  # another node's answer to a batch, the model fetched there first

routes = web.RouteTableDef()


def _model(request: web.Request, body: dict[str, Any]) -> tuple[str, bool]:
    """The model ``body`` names and whether it is a stored embedding model (else a chat model
    of the router's; 404 naming the known ones)."""
    name = body.get("model")
    if not isinstance(name, str) or not name or len(name) > 256:
        raise InvalidRequestError("'model' must name an embedding or chat model", "model")
    models = request.app[EMBEDDINGS]
    found = models.resolve(name)
    encoder = found is not None
    if found is None:
        try:
            found = request.app[ROUTER].resolve(name)
        except UnknownModelError:
            known = ", ".join(models.names()) or "none (ncm pull all-minilm-l6-v2 stores one)"
            raise InvalidRequestError(f"model {name!r} does not exist; embedding models stored: {known}; "
                                      "chat models: see /v1/models", "model", "model_not_found", status=404) from None
    request[REQUEST_MODEL] = found
    return found, encoder


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
    name, encoder = _model(request, body)
    texts = _texts(body.get(field), field)
    keep_alive_s = parse_duration_s(body["keep_alive"]) if body.get("keep_alive") is not None else None
    if encoder:
        result = await _embed_with_embedding_model(request, name, texts, truncate=truncate, keep_alive_s=keep_alive_s)
    else:
        router = request.app[ROUTER]
        try:
            result = await _embed_with_chat_model(request, name, texts, field, truncate=truncate)
        finally:
            if keep_alive_s is not None:
                router.keep_alive(name, keep_alive_s, unload=holds_admin_token(request))
    _dimensions(body, result.vectors.shape[1])
    return name, result


async def _embed_with_embedding_model(request: web.Request, name: str, texts: list[str], *, truncate: bool,
                                      keep_alive_s: float | None) -> Embeddings:
    """``texts`` embedded on the node the router places ``name`` on: this one, or another,
    which fetches the model from this one first when it does not store it. ``keep_alive_s``
    (Ollama's): how long the model stays open after this request."""
    app = request.app
    models, node_id, membership = app[EMBEDDINGS], app[NODE_ID], app[MEMBERSHIP]
    close = holds_admin_token(request)
    opened = open_everywhere(models, node_id, membership.peer_reports(), time.monotonic())
    node = app[ROUTER].place_embedding_model(name, models.store.encoder_manifest(name).weight_bytes,
                                             [opened[name]["node"]] if name in opened else [])
    if node == node_id:
        result = await models.embed(name, texts, truncate=truncate)
        if keep_alive_s is not None:
            models.keep_alive(name, keep_alive_s, close=close)
        return result
    order = EmbedOrder(name, tuple(texts), truncate, ((node_id, membership.peer_address_of(node_id)),),
                       keep_alive_s, close)
    try:
        return Embeddings.from_json(await app[CLIENT].request_json(
            "POST", membership.peer_address_of(node), EMBED_PATH, order.to_json(), target=node,
            timeout_s=REMOTE_EMBED_TIMEOUT_S))
    except PeerError as error:
        answer = PublicAnswer.from_json(error.status, error.peer_answer) if error.status is not None else None
        if answer is not None and (400 <= answer.status < 500 or answer.status == 503):
            raise RelayedError(answer) from None
        raise ClusterError(f"node {node}, where embedding model {name} runs, could not embed: "
                           f"{without_addresses(str(error))}") from None
    except WireError as error:
        raise ClusterError(f"node {node} answered an embedding request with {error}") from None


async def _embed_with_chat_model(request: web.Request, name: str, texts: list[str], field: str, *,
                                 truncate: bool) -> Embeddings:
    """Each text read through ``name``'s pipeline, one after another: the last token's final
    hidden state, L2-normalised. A text longer than the context is cut to its first tokens
    (``truncate`` false refuses it, naming ``field``)."""
    started = time.perf_counter()
    async with request.app[ROUTER].use(name, client=client_of(request)) as deployment:
        opened = time.perf_counter()
        max_context = deployment.settings.max_context
        prompts = await asyncio.to_thread(lambda: [deployment.tokenizer.encode(text) for text in texts])
        for index, ids in enumerate(prompts):
            if not ids:
                raise InvalidRequestError(f"{field}[{index}] has no tokens to embed", field)
            if len(ids) > max_context and not truncate:
                raise InvalidRequestError(f"{field}[{index}] has {len(ids)} tokens, more than the {max_context} "
                                          f"{name} reads (truncate: true cuts it)", field)
        orchestrator = request.app[ORCHESTRATOR]
        vectors = np.stack([await orchestrator.embed(deployment, ids[:max_context]) for ids in prompts])
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return Embeddings(vectors / np.maximum(norms, 1e-12), sum(min(len(ids), max_context) for ids in prompts),
                      opened - started, time.perf_counter() - opened)


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
