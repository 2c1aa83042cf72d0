"""Who a request comes from, for the fair share of a model's slots (agent/core/admission.py):
its API key when the cluster has keys (a hash of it, never the key), else its address. An
agent that passes a request on to the orchestrator names the client in ``X-Ncm-Client``; the
orchestrator believes that header only from a member (on the peer port), so a LAN client
cannot pose as many."""

from __future__ import annotations

import hashlib

from aiohttp import web

from agent.http.app_keys import ADMIN_TOKEN, CONFIG

CLIENT_HEADER = "X-Ncm-Client"
MAX_CLIENT_CHARS = 80


def from_member(request: web.Request) -> bool:
    """Came in on the peer port (TLS with a certificate of the cluster's CA: only members get there)."""
    return request.transport is not None and request.transport.get_extra_info("ssl_object") is not None


def client_of(request: web.Request) -> str:
    """The client ``request`` is counted for."""
    named = request.headers.get(CLIENT_HEADER)
    if named and from_member(request):
        return named[:MAX_CLIENT_CHARS]
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    accepted = request.app[CONFIG].accepted_api_keys
    if scheme.lower() == "bearer" and accepted and token in (*accepted, request.app[ADMIN_TOKEN]):
        return "key:" + hashlib.sha256(token.encode()).hexdigest()[:16]
    return f"address:{request.remote or 'unknown'}"
