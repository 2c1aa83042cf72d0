"""The model management endpoints (design §10) and OpenAI's model list: what the router holds,
loading, unloading and sleeping a model, and their events."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from agent.core.chat_request import check_model_name
from agent.core.errors import (
    InvalidRequestError,
)
from agent.http.admin import wants_reload
from agent.http.app_keys import (
    EMBEDDINGS,
    ROUTER,
)
from agent.http.bodies import read_json
from agent.http.event_stream import event_stream
from agent.http.metrics_endpoint import REQUEST_MODEL
from agent.http.proxy import on_orchestrator

log = logging.getLogger(__name__)

routes = web.RouteTableDef()


@routes.get("/v1/models")
@on_orchestrator
async def list_models(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER]
    names = [info["id"] for info in router.models()] + request.app[EMBEDDINGS].names()
    return web.json_response({"object": "list", "data": [_model_object(name) for name in names]})


def _model_object(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "ncm"}


@routes.get("/v1/models/{model}")
@on_orchestrator
async def show_model(request: web.Request) -> web.StreamResponse:
    """One model, by a name or alias (``name:latest`` too): its canonical name answers."""
    name = check_model_name(request.match_info["model"])
    embedding = request.app[EMBEDDINGS].resolve(name)
    return web.json_response(_model_object(embedding or request.app[ROUTER].resolve(name)))


def autoload_of(request: web.Request) -> bool | None:
    value = request.query.get("autoload")
    if value is None:
        return None
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise InvalidRequestError("autoload must be true or false", "autoload")


@routes.get("/models")
@on_orchestrator
async def models(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER]
    if wants_reload(request):
        router.reload(strict=True)  # a section whose weights no live node stores is refused, named
    return web.json_response({"object": "list", "data": router.models()})


@routes.post("/models/load")
@routes.post("/models/unload")
@routes.post("/models/sleep")
@on_orchestrator
async def models_load_unload(request: web.Request) -> web.StreamResponse:
    """Body {"model": name or alias}: load it (answers once ready), unload it, or put it to
    sleep (its memory released, its plan kept)."""
    body = await read_json(request)
    name = body.get("model") if isinstance(body, dict) else None
    if name is None:
        raise InvalidRequestError("the body must be {\"model\": \"<name or alias>\"}", "model")
    check_model_name(name)
    router = request.app[ROUTER]
    canonical = router.resolve(name)
    request[REQUEST_MODEL] = canonical
    action = {"load": router.load, "unload": router.unload, "sleep": router.sleep}[request.path.rsplit("/", 1)[1]]
    return web.json_response({"success": True, "model": await action(canonical)})


@routes.get("/models/sse")
@on_orchestrator
async def models_sse(request: web.Request) -> web.StreamResponse:
    """Server-Sent Events: the state of every model, then every change (status, progress, memory)."""
    with request.app[ROUTER].subscribe() as events:
        # every stream gets the same event (a fanout): read it, never change it
        return await event_stream(request, events,
                                  lambda event: (event["event"], {k: v for k, v in event.items() if k != "event"}))
