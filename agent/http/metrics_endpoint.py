"""`GET /metrics` (this agent's :class:`~agent.local.metrics.Metrics` in Prometheus' text format)
and the middleware that counts every answered request by route, model and status."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest

from agent.http.app_keys import METRICS

REQUEST_MODEL = web.RequestKey("ncm_model", str)  # the model a request was for, once known to exist (a label)
CLIENT_CLOSED = 499  # the status a request counts under when its client hung up first (nginx's)

routes = web.RouteTableDef()


@web.middleware
async def count_requests(request: web.Request, handler: Any) -> web.StreamResponse:
    """Count every answered request by route, model (when the handler named one) and status
    (:data:`CLIENT_CLOSED` when the client hung up before its answer ended)."""
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as error:
        status = error.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):  # aiohttp cancels the handler of a closed connection
        status = CLIENT_CLOSED
        raise
    finally:
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"
        request.app[METRICS].requests.labels(endpoint, request.get(REQUEST_MODEL, ""), str(status)).inc()


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    """This agent's metrics in Prometheus' text format."""
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
