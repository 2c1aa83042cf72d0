"""What needs the admin token: the endpoints that change the cluster or reveal its invites, and
the bearer comparisons (constant time) the access middleware and the handlers use."""

from __future__ import annotations

import hmac
import logging
from typing import Any

from aiohttp import web

from agent.http.app_keys import (
    ADMIN_TOKEN,
)
from agent.http.errors_shape import error_response

log = logging.getLogger(__name__)


def wants_reload(request: web.Request) -> bool:
    return request.query.get("reload") in ("1", "true")


ADMIN_ENDPOINTS = frozenset({("POST", "/cluster/join"), ("POST", "/cluster/remove"), ("POST", "/models/load"),
                             ("POST", "/models/unload"), ("POST", "/models/sleep"), ("POST", "/api/pull")})


def bearer_matches(request: web.Request, accepted: Any) -> bool:
    """Whether the request's bearer token is one of ``accepted`` (each compared in constant time)."""
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    # bytes that are no UTF-8 come as surrogate escapes: encoded back as they were, they match nothing
    given = value.strip().encode("utf-8", "surrogateescape") if scheme.lower() == "bearer" else b""
    return any([hmac.compare_digest(given, key.encode()) for key in accepted])


def holds_admin_token(request: web.Request) -> bool:
    return bearer_matches(request, (request.app[ADMIN_TOKEN],))


def admin_token_required(field: str | None = None) -> web.Response:
    return error_response(401, "this changes the cluster and needs the admin token: send 'Authorization: Bearer "
                               "<admin token>' (`ncm admin-token` on any member prints it)",
                          param=field, code="admin_token_required")


def changes_cluster(request: web.Request) -> bool:
    """Requests that change the cluster or reveal its invites (they need the admin token)."""
    return ((request.method, request.path) in ADMIN_ENDPOINTS or request.path.startswith("/cluster/invites")
            or (request.path == "/models" and wants_reload(request)))
