"""The dashboard: a page at `/` of every agent, served from the package (no build step, no
third-party host: a home network may have no internet). The page reads the public API
(`/cluster/*`, `/models`, the event streams) with the token the user gives it."""

from __future__ import annotations

import functools
from pathlib import Path

from aiohttp import web

ASSETS_DIR = Path(__file__).parent / "dashboard"
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
PAGE_PATHS = ("/", *(f"/dashboard/{name}" for name in ASSETS))  # public: the data behind them is not

routes = web.RouteTableDef()


@functools.lru_cache(maxsize=None)
def _read(name: str) -> bytes:
    return (ASSETS_DIR / name).read_bytes()  # once per process: the files ship with the package


def _asset(name: str, content_type: str) -> web.Response:
    return web.Response(body=_read(name), content_type=content_type, charset="utf-8",
                        headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})


@routes.get("/")
async def page(request: web.Request) -> web.Response:
    response = _asset("index.html", "text/html")
    # Only what the page itself serves: no inline script, no other host.
    response.headers["Content-Security-Policy"] = ("default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                                   "script-src 'self'; connect-src 'self'")
    return response


@routes.get("/dashboard/{name}")
async def asset(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in ASSETS:
        raise web.HTTPNotFound(reason=f"no dashboard file {name!r}")
    return _asset(name, ASSETS[name])
