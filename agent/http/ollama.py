"""Ollama's API on the agent's port, next to OpenAI's: what Home Assistant's Ollama
integration, Open WebUI and scripts written for Ollama call.

`/api/version`, `/api/tags`, `/api/show`, `/api/ps`, `/api/chat`, `/api/generate` (NDJSON
streaming by default, as Ollama does) and `/api/pull` (known models only). Requests run on
the same path as the OpenAI endpoints: the router admits them, the orchestrator generates.
Every field and option is honoured or refused with a 400 naming it
(:mod:`agent.core.request_fields`); `tools` and `format` work as on the OpenAI endpoints
(answers carry ``message.tool_calls``); `keep_alive` is mapped onto the router's sleep and
unload. Errors use Ollama's shape, ``{"error": "message"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import hashlib
import json
import math
import re
import time
from typing import Any

from aiohttp import web

from agent.core.chat_request import ChatRequest, check_model_name, parse_request
from agent.core.errors import ClusterError, InvalidRequestError, without_addresses
from agent.core.request_fields import OLLAMA_CHAT, OLLAMA_GENERATE, OLLAMA_OPTIONS, check_fields, integer
from agent.dataplane.links import StageError
from agent.http.admin import admin_token_required, holds_admin_token
from agent.http.app_keys import EMBEDDINGS, MEMBERSHIP, NODE_ID, ORCHESTRATOR, ROUTER, STORE
from agent.http.bodies import read_json
from agent.http.clients import client_of
from agent.http.generation import chain_events, start_generation, tool_call_entries
from agent.http.metrics_endpoint import REQUEST_MODEL
from agent.http.proxy import on_orchestrator, pass_to_orchestrator
from agent.models.embeddings import open_everywhere
from agent.orchestration.orchestrator import Completion, Deployment
from shards.errors import ShardsError
from shards.importers.pull import PULLABLE_ENCODERS, pull_encoder, pull_model, resolve_pull_name
from shards.runtime.answer_reader import AnswerPiece
from shards.runtime.reasoning import reasoning_support
from shards.runtime.sampling import MAX_TOKENS_LIMIT
from shards.runtime.tool_calls import tool_format
from shards.store.encoder_manifest import EncoderManifest
from shards.store.manifest import Manifest

API_VERSION = "0.6.0"  # the version of Ollama's API these endpoints follow
DEFAULT_TAG = "latest"
NEVER_EXPIRES = "2318-01-01T00:00:00Z"  # /api/ps of a model kept loaded: far ahead, as Ollama reports it
_DURATION = re.compile(r"^(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)?$")
_UNITS_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}

routes = web.RouteTableDef()


# --- errors ---------------------------------------------------------------------------------------
@web.middleware
async def error_shape(request: web.Request, handler: Any) -> web.StreamResponse:
    """Errors of `/api/*` in Ollama's shape, ``{"error": "message"}`` (the other middlewares
    write OpenAI's); the status and headers stay as they are."""
    response = await handler(request)
    if not request.path.startswith("/api/") or response.status < 400 or not isinstance(response, web.Response):
        return response
    try:
        error = json.loads(response.body)["error"]  # type: ignore[arg-type]
    except (TypeError, ValueError, KeyError):
        return response
    if isinstance(error, dict):
        response.body = json.dumps({"error": str(error.get("message", ""))}).encode()
    return response


# --- names and details ---------------------------------------------------------------------------
def _name(body: Any, field: str = "model") -> str:
    """The model a request names (Ollama's older clients say "name"), without ":latest"."""
    value = body.get(field, body.get("name")) if isinstance(body, dict) else None
    if value is None:
        raise InvalidRequestError(f"'{field}' is required", field)
    name = check_model_name(value)
    return name[:-len(DEFAULT_TAG) - 1] if name.endswith(":" + DEFAULT_TAG) else name


def _resolve(request: web.Request, name: str) -> str:
    canonical = request.app[ROUTER].resolve(name)
    request[REQUEST_MODEL] = canonical
    return canonical


def _manifest(request: web.Request, name: str) -> Manifest | None:
    """The stored manifest behind router model ``name`` on this node, when it has one."""
    preset = request.app[ROUTER].presets.get(name)
    store = request.app[STORE]
    try:
        return store.manifest(preset.store_model) if preset is not None and store.has(preset.store_model) else None
    except (ShardsError, OSError):
        return None


def _parameter_count(manifest: Manifest) -> int:
    hidden, inter, vocab = manifest.hidden_size, manifest.intermediate_size, manifest.vocab_size
    kv = manifest.n_kv_heads * manifest.head_dim
    if manifest.n_experts:  # every expert and the router (the active ones are experts_per_token of them)
        mlp = manifest.n_experts * (3 * hidden * manifest.expert_intermediate_size + hidden)
    else:
        mlp = 3 * hidden * inter
    per_layer = hidden * manifest.n_heads * manifest.head_dim * 2 + hidden * kv * 2 + mlp
    return manifest.n_layers * per_layer + vocab * hidden * (1 if manifest.tied_embeddings else 2)


def _human_count(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}".replace(".0", "")
    return str(count)


def _details(manifest: Manifest | None) -> dict[str, Any]:
    if manifest is None:
        return {"parent_model": "", "format": "onnx", "family": "", "families": None, "parameter_size": "",
                "quantization_level": ""}
    return {"parent_model": "", "format": "onnx", "family": manifest.architecture,
            "families": [manifest.architecture], "parameter_size": _human_count(_parameter_count(manifest)),
            "quantization_level": manifest.weight_format.upper()}


def _size_bytes(request: web.Request, name: str, manifest: Manifest | None) -> int:
    if manifest is not None:
        return sum(f.bytes for f in manifest.files.values())
    preset = request.app[ROUTER].presets.get(name)
    held = [models.get(preset.store_model, 0) for models in request.app[ORCHESTRATOR].holdings().values()] if preset else []
    return max(held, default=0)


def _digest(name: str, manifest: Manifest | None) -> str:
    source = manifest.source_digest if manifest is not None else name
    return hashlib.sha256(source.encode()).hexdigest()


def _iso(unix_s: float) -> str:
    return datetime.datetime.fromtimestamp(unix_s, datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _entry(request: web.Request, info: dict[str, Any]) -> dict[str, Any]:
    name = info["id"]
    manifest = _manifest(request, name)
    return {"name": f"{name}:{DEFAULT_TAG}", "model": f"{name}:{DEFAULT_TAG}", "modified_at": _iso(0),
            "size": _size_bytes(request, name, manifest), "digest": _digest(name, manifest),
            "details": _details(manifest)}


# --- options ---------------------------------------------------------------------------------------
def parse_duration_s(value: Any, field: str = "keep_alive") -> float:
    """Ollama's durations: a number of seconds, or Go's "5m", "1h", "300ms"; negative = forever."""
    if isinstance(value, bool) or value is None:
        raise InvalidRequestError(f"'{field}' must be a duration such as \"5m\" or a number of seconds", field)
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value).strip())
        if match is None:
            raise InvalidRequestError(f"'{field}' must be a duration such as \"5m\", \"1h\" or \"0\", got {str(value)[:40]!r}",
                                      field)
        seconds = float(match.group(1)) * _UNITS_S[match.group(2)]
    if not math.isfinite(seconds):
        raise InvalidRequestError(f"'{field}' must be finite", field)
    return seconds


def _option_number(options: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = options.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not low <= value <= high:
        raise InvalidRequestError(f"option '{name}' must be a number between {low:g} and {high:g}, got {value!r}",
                                  f"options.{name}")
    return float(value)


def _option_int(options: dict[str, Any], name: str, low: int) -> int | None:
    """An integer option (``8192.0`` is one: Home Assistant sends its options as floats)."""
    value = options.get(name)
    if value is None:
        return None
    number = integer(value)
    if number is None or number < low:
        raise InvalidRequestError(f"option '{name}' must be an integer of at least {low}, got {value!r}",
                                  f"options.{name}")
    return number


def parse_options(body: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """Ollama's ``options`` as the fields of an OpenAI-style request, and the context the
    request asks for (``num_ctx``); options ncm cannot honour are refused, naming them."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise InvalidRequestError("'options' must be an object", "options")
    check_fields(options, OLLAMA_OPTIONS, where="options.")
    fields: dict[str, Any] = {}
    for name, low, high in (("temperature", 0.0, 2.0), ("top_p", 1e-9, 1.0), ("min_p", 0.0, 1.0),
                            ("repeat_penalty", 1e-3, 10.0), ("presence_penalty", -2.0, 2.0),
                            ("frequency_penalty", -2.0, 2.0)):
        value = _option_number(options, name, low, high)
        if value is not None:
            fields[name] = value
    for name in ("top_k", "repeat_last_n"):
        value = _option_int(options, name, 0 if name == "top_k" else -1)
        if value is not None:
            fields[name] = value
    seed = _option_int(options, "seed", -(2**63))
    if seed is not None:
        fields["seed"] = seed % 2**63 if seed >= 0 else None  # Ollama's -1: a random seed
    num_predict = _option_int(options, "num_predict", -2)
    if num_predict is not None:
        if num_predict == 0:
            raise InvalidRequestError("option 'num_predict' must be a positive integer, or -1 (until the end) or -2 "
                                      "(fill the context)", "options.num_predict")
        fields["max_tokens"] = num_predict if num_predict > 0 else MAX_TOKENS_LIMIT  # -1, -2: the context decides
    stop = options.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidRequestError("option 'stop' must be a list of non-empty strings", "options.stop")
        fields["stop"] = stop
    return fields, _option_int(options, "num_ctx", 1)


def _response_format(value: Any) -> dict[str, Any] | None:
    """Ollama's ``format`` ("json" or a JSON schema) as OpenAI's ``response_format``."""
    if value in (None, ""):
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    raise InvalidRequestError("'format' must be \"json\" or a JSON schema object", "format")


def _openai_body(body: dict[str, Any], *, chat: bool) -> dict[str, Any] | None:
    """The request as the OpenAI endpoints take it (validated by the same parser), without
    its options; None for Ollama's load or unload request (no messages, no prompt)."""
    check_fields(body, OLLAMA_CHAT if chat else OLLAMA_GENERATE)
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise InvalidRequestError("'stream' must be true or false", "stream")
    shared = {"stream": stream, "response_format": _response_format(body.get("format")), "think": body.get("think")}
    if chat:
        messages = body.get("messages") or []
        if not isinstance(messages, list):
            raise InvalidRequestError("'messages' must be a list of {role, content} objects", "messages")
        return {"messages": messages, "tools": body.get("tools") or None, **shared} if messages else None
    prompt, system = body.get("prompt", ""), body.get("system")
    if not isinstance(prompt, str) or (system is not None and not isinstance(system, str)):
        raise InvalidRequestError("'prompt' and 'system' must be strings", "prompt")
    if not prompt:
        return None
    if body.get("raw", False) is True:
        return {"prompt": prompt, **shared}
    turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return {"messages": turns, **shared}


# --- endpoints ---------------------------------------------------------------------------------------
@routes.get("/api/version")
async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": API_VERSION})


@routes.get("/api/tags")
@on_orchestrator
async def tags(request: web.Request) -> web.StreamResponse:
    """Every model the router knows (stored or in the presets), as Ollama lists its local models."""
    models = [_entry(request, info) for info in request.app[ROUTER].models()]
    models += [_encoder_entry(request.app[STORE].encoder_manifest(name)) for name in request.app[EMBEDDINGS].names()]
    return web.json_response({"models": models})


def _encoder_family(manifest: EncoderManifest) -> str:
    """The encoder's architecture as Ollama names it (llama.cpp's: ``nomic-bert``)."""
    return manifest.architecture.replace("_", "-")


def _encoder_details(manifest: EncoderManifest) -> dict[str, Any]:
    parameters = manifest.weight_bytes // 4  # stored as float32
    return {"parent_model": "", "format": "onnx", "family": _encoder_family(manifest),
            "families": [_encoder_family(manifest)], "parameter_size": _human_count(parameters),
            "quantization_level": "F32"}


def _encoder_entry(manifest: EncoderManifest) -> dict[str, Any]:
    """An embedding model as /api/tags lists it."""
    return {"name": f"{manifest.name}:{DEFAULT_TAG}", "model": f"{manifest.name}:{DEFAULT_TAG}",
            "modified_at": _iso(0), "size": manifest.weight_bytes,
            "digest": hashlib.sha256(manifest.source_digest.encode()).hexdigest(),
            "details": _encoder_details(manifest)}


@routes.get("/api/ps")
@on_orchestrator
async def running(request: web.Request) -> web.StreamResponse:
    """The models loaded now, with the memory they hold on the devices."""
    router, models = request.app[ROUTER], []
    for info in router.models():
        if info["state"] != "ready":
            continue
        held = sum(((info.get("memory") or {}).get("effective_bytes") or {}).values())
        idle_s = router.sleeps_after_s(info["id"])  # from its last use (0: it stays until asked)
        last_used = time.time() - (time.monotonic() - info["last_used_s"])
        expires = _iso(last_used + idle_s) if idle_s > 0 else NEVER_EXPIRES
        models.append({**_entry(request, info), "size": held, "size_vram": 0, "expires_at": expires})
    store = request.app[STORE]
    opened = open_everywhere(request.app[EMBEDDINGS], request.app[NODE_ID], request.app[MEMBERSHIP].peer_reports(),
                             time.monotonic())
    for name, open_model in sorted(opened.items()):  # each whole, on one node
        expires_in_s = open_model.get("expires_in_s")
        expires = NEVER_EXPIRES if expires_in_s is None else _iso(time.time() + expires_in_s)
        with contextlib.suppress(ShardsError):  # one the orchestrator does not store (removed meanwhile)
            models.append({**_encoder_entry(store.encoder_manifest(name)), "size": open_model["bytes"],
                           "size_vram": 0, "expires_at": expires})
    return web.json_response({"models": models})


@routes.post("/api/show")
@on_orchestrator
async def show(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    embedding = request.app[EMBEDDINGS].resolve(_name(body))
    if embedding is not None:
        return _show_encoder(request.app[STORE].encoder_manifest(embedding))
    name = _resolve(request, _name(body))
    router = request.app[ROUTER]
    info = router.model_info(name)
    manifest = _manifest(request, name)
    settings = info.get("settings") or {}
    model_info: dict[str, Any] = {}
    template = ""
    if manifest is not None:
        arch = manifest.architecture
        model_info = {"general.architecture": arch, "general.parameter_count": _parameter_count(manifest),
                      f"{arch}.block_count": manifest.n_layers, f"{arch}.embedding_length": manifest.hidden_size,
                      f"{arch}.context_length": settings.get("max_context", manifest.context_length),
                      f"{arch}.attention.head_count": manifest.n_heads,
                      f"{arch}.attention.head_count_kv": manifest.n_kv_heads,
                      f"{arch}.feed_forward_length": manifest.intermediate_size,
                      f"{arch}.vocab_size": manifest.vocab_size}
        deployment = request.app[ORCHESTRATOR].deployments.get(name)
        if deployment is not None:
            template = deployment.tokenizer.spec.chat_template or ""
    parameters = f"num_ctx {settings['max_context']}" if "max_context" in settings else ""
    # Every chat model takes tools: in its template's own format, else in the generic one.
    capabilities = ["completion", "tools"] if template else ["completion"]
    if reasoning_support(template) is not None:
        capabilities.append("thinking")
    if template:
        model_info["ncm.tool_format"] = tool_format(template)
    return web.json_response({
        "modelfile": f"# served by ncm\nFROM {name}\n", "parameters": parameters, "template": template,
        "details": _details(manifest), "model_info": model_info, "capabilities": capabilities,
        "modified_at": _iso(0),
    })


def _show_encoder(manifest: EncoderManifest) -> web.Response:
    arch = _encoder_family(manifest)
    info = {"general.architecture": arch, "general.parameter_count": manifest.weight_bytes // 4,
            f"{arch}.block_count": manifest.n_layers, f"{arch}.embedding_length": manifest.hidden_size,
            f"{arch}.context_length": manifest.max_tokens, f"{arch}.attention.head_count": manifest.n_heads,
            f"{arch}.feed_forward_length": manifest.intermediate_size,
            f"{arch}.pooling_type": manifest.pooling, f"{arch}.normalize": manifest.normalize}
    if manifest.rope_theta is not None:
        info[f"{arch}.rope.freq_base"] = manifest.rope_theta
    return web.json_response({"modelfile": f"# served by ncm\nFROM {manifest.name}\n", "parameters": "",
                              "template": "", "details": _encoder_details(manifest), "model_info": info,
                              "capabilities": ["embedding"], "modified_at": _iso(0)})


@routes.post("/api/pull")
@on_orchestrator
async def pull(request: web.Request) -> web.StreamResponse:
    """Download a model ncm knows by name (`ncm pull`) into this node's store; the router
    lists it from then on. Streams Ollama's status lines unless ``stream`` is false."""
    body = await read_json(request)
    name = _name(body)
    if name in PULLABLE_ENCODERS:
        pull, request[REQUEST_MODEL] = functools.partial(pull_encoder, name, request.app[STORE]), name
    else:
        try:
            source, weights = resolve_pull_name(name)
        except ShardsError as error:
            raise InvalidRequestError(f"{error}", "model", "model_not_found", status=404) from None
        pull = functools.partial(pull_model, name, request.app[STORE], weights=weights)
        request[REQUEST_MODEL] = source.name
    stream = body.get("stream", True) is not False
    response: web.StreamResponse | None = None
    if stream:
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        await response.write(_line({"status": f"pulling {name}"}))
    try:
        await asyncio.to_thread(pull, progress=False)
    except ShardsError as error:
        if response is None:
            raise InvalidRequestError(f"pulling {name} failed: {error}", "model", status=502) from None
        await response.write(_line({"error": f"pulling {name} failed: {error}"}))
        await response.write_eof()
        return response
    request.app[ROUTER].reload()
    if response is None:
        return web.json_response({"status": "success"})
    await response.write(_line({"status": "success"}))
    await response.write_eof()
    return response


@routes.post("/api/chat")
async def chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


@routes.post("/api/generate")
async def generate(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def _generate(request: web.Request, *, chat: bool) -> web.StreamResponse:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    name = _name(body)
    keep_alive_s = parse_duration_s(body["keep_alive"]) if body.get("keep_alive") is not None else None
    openai = _openai_body(body, chat=chat)
    fields, num_ctx = parse_options(body)
    parsed = parse_request({"model": name, **openai, **fields}, chat="messages" in openai) if openai else None
    proxied = await pass_to_orchestrator(request)
    if proxied is not None:
        if proxied.status < 400:  # a name the orchestrator accepted: a bounded set, fit for a label
            request[REQUEST_MODEL] = name
        return proxied
    router = request.app[ROUTER]
    name = _resolve(request, name)
    started = time.perf_counter()
    if parsed is None:  # Ollama's way to load (or, with keep_alive 0, unload) a model
        return await _load_or_unload(request, name, keep_alive_s, chat=chat)
    try:
        async with router.use(name, client=client_of(request)) as deployment:
            loaded = time.perf_counter()
            return await _answer(request, parsed, deployment, chat=chat, num_ctx=num_ctx,
                                 load_s=loaded - started, started=started)
    finally:
        if keep_alive_s is not None:
            router.keep_alive(name, keep_alive_s, unload=holds_admin_token(request))


async def _load_or_unload(request: web.Request, name: str, keep_alive_s: float | None, *, chat: bool) -> web.Response:
    router = request.app[ROUTER]
    if keep_alive_s == 0:
        if not holds_admin_token(request):  # as /models/unload: one client does not take a model from everyone
            return admin_token_required("keep_alive")
        await router.unload(name)
        reason = "unload"
    else:
        await router.load(name)
        if keep_alive_s is not None:
            router.keep_alive(name, keep_alive_s, unload=holds_admin_token(request))
        reason = "load"
    answer: dict[str, Any] = {"model": name, "created_at": _iso(time.time()), "done": True, "done_reason": reason}
    answer.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    return web.json_response(answer)


async def _answer(request: web.Request, parsed: ChatRequest, deployment: Deployment, *, chat: bool,
                  num_ctx: int | None, load_s: float, started: float) -> web.StreamResponse:
    # num_ctx narrows the model's context; a larger one is capped at what the model was planned for.
    context = min(num_ctx, deployment.settings.max_context) if num_ctx else None
    generation = start_generation(request, parsed, deployment, max_context=context)
    events, reader = generation.events, generation.reader
    # The first token is computed before anything goes out: early failures are still 4xx/5xx.
    generating = time.perf_counter()
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise
    prompt_s = time.perf_counter() - generating  # the prefill, and the first token's sampling
    if not parsed.stream:
        pieces, last = [], first
        try:
            async for event in chain_events(first, events):
                pieces.append(reader.push(event.text))
                last = event
        finally:
            await events.aclose()
        answer = AnswerPiece.joined([*pieces, reader.finish()])
        return web.json_response(_final(last, answer, chat=chat, started=started, load_s=load_s, prompt_s=prompt_s))
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    last = first
    try:
        async for event in chain_events(first, events):
            last = event
            piece = reader.push(event.text)
            if event.finish_reason is not None:
                piece = AnswerPiece.joined([piece, reader.finish()])
            if piece.reasoning or piece.content or piece.calls:
                await response.write(_line(_chunk(event.model, piece, chat=chat)))
        await response.write(_line(_final(last, AnswerPiece(), chat=chat, started=started, load_s=load_s,
                                          prompt_s=prompt_s)))
    except (StageError, ClusterError) as error:
        await response.write(_line({"error": without_addresses(str(error))}))
    finally:
        await events.aclose()
    await response.write_eof()
    return response


def _line(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload).encode() + b"\n"


def _chunk(model: str, piece: AnswerPiece, *, chat: bool) -> dict[str, Any]:
    """One line of the answer: its reply (and reasoning, calls) as Ollama writes them."""
    chunk: dict[str, Any] = {"model": model, "created_at": _iso(time.time()), "done": False}
    if chat:
        chunk["message"] = {"role": "assistant", "content": piece.content}
        if piece.reasoning:
            chunk["message"]["thinking"] = piece.reasoning
        if piece.calls:
            chunk["message"]["tool_calls"] = tool_call_entries(list(piece.calls), arguments_as_text=False)
    else:
        chunk["response"] = piece.content
        if piece.reasoning:
            chunk["thinking"] = piece.reasoning
    return chunk


def _final(last: Completion, answer: AnswerPiece, *, chat: bool, started: float, load_s: float,
           prompt_s: float) -> dict[str, Any]:
    """The last object: the whole answer when not streaming, and Ollama's counts and durations (ns)."""
    total_s = time.perf_counter() - started
    final = _chunk(last.model, answer, chat=chat)
    final.update(done=True, done_reason=last.finish_reason or "stop", total_duration=int(total_s * 1e9),
                 load_duration=int(load_s * 1e9), prompt_eval_count=last.prompt_tokens - last.cached_tokens,
                 prompt_eval_duration=int(prompt_s * 1e9), eval_count=last.completion_tokens,
                 eval_duration=int(max(total_s - load_s - prompt_s, 0.0) * 1e9))
    return final
