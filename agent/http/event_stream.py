"""Server-Sent Events for the cluster's and the models' event feeds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from agent.local.compat import timeout

log = logging.getLogger(__name__)


SSE_KEEPALIVE_S = 15.0


async def event_stream(request: web.Request, events: asyncio.Queue[Any],
                        encode: Callable[[Any], tuple[str, Any]]) -> web.StreamResponse:
    """Write ``events`` as Server-Sent Events (``encode``: an event's name and data) until the
    client leaves; a comment every :data:`SSE_KEEPALIVE_S` keeps idle connections open."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    with contextlib.suppress(ConnectionResetError):
        while True:
            try:
                async with timeout(SSE_KEEPALIVE_S):
                    event = await events.get()
            except asyncio.TimeoutError:
                await response.write(b": keep-alive\n\n")
                continue
            kind, data = encode(event)
            await response.write(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())
    return response
