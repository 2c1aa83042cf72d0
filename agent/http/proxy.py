"""Requests an agent passes on to the orchestrator, over the orchestrator's peer port (TLS).

A completion streamed through this agent survives the orchestrator: the orchestrator tells
this agent, in each event, the token ids behind its text (``ncm_tokens``, removed before the
event goes to the client). When the orchestrator is lost mid-stream, this agent waits for the
next election (at most :data:`RESUME_WAIT_S`) and asks the new orchestrator to go on after
those tokens (``ncm_resume`` in the body, honoured only from members). The client sees one
stream: the same ``id`` and ``created``, no second role event, nothing repeated or missing.
A request that had not answered yet is simply asked again.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from agent.cluster.membership import Membership
from agent.cluster.peer_client import PeerClient
from agent.core.errors import ClusterError
from agent.http.app_keys import CLIENT, MEMBERSHIP, NODE_ID
from agent.http.bodies import read_body
from agent.http.clients import CLIENT_HEADER, client_of
from agent.local.compat import timeout

log = logging.getLogger(__name__)
PROXY_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=300.0)
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "content-encoding"}
RESUMABLE_PATHS = ("/v1/chat/completions", "/v1/completions")
RESUMABLE_HEADER = "X-Ncm-Resumable"  # asks the orchestrator for the token ids of each event
TOKENS_FIELD = "ncm_tokens"
RESUME_FIELD = "ncm_resume"
RESUME_WAIT_S = 30.0
SETTLE_POLL_S = 0.2
WATCH_S = 0.5  # how often a quiet stream checks whether its orchestrator was replaced
MAX_RESUMES = 3


class _Lost(Exception):
    """The orchestrator stopped answering (``reason``)."""


def _target(membership: Membership, orchestrator: str) -> str:
    try:
        return membership.peer_address_of(orchestrator)
    except KeyError:
        raise ClusterError(f"the orchestrator {orchestrator} is not reachable from this node") from None


async def _next_orchestrator(membership: Membership, lost: str, timeout_s: float) -> str | None:
    """The orchestrator elected after ``lost`` (None if there is none within ``timeout_s``)."""
    changes = membership.subscribe()
    try:
        async with timeout(timeout_s):
            while True:
                election = membership.election
                if election is not None and election.orchestrator != lost:
                    return election.orchestrator
                changes.clear()
                await changes.wait()
    except asyncio.TimeoutError:
        return None
    finally:
        membership.unsubscribe(changes)


async def _events(content: aiohttp.StreamReader, membership: Membership, orchestrator: str) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of an event stream; _Lost as soon as another orchestrator is
    elected (a frozen one keeps its connection open but says nothing)."""
    while True:
        try:
            async with timeout(WATCH_S):
                line = await content.readline()
        except asyncio.TimeoutError:
            election = membership.election
            if election is not None and election.orchestrator != orchestrator:
                raise _Lost(f"{election.orchestrator} was elected in its place") from None
            continue
        if not line:
            return
        line = line.strip()
        if line.startswith(b"data: "):
            yield line[len(b"data: "):]


def _role_only(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices") or []
    return bool(choices) and all((c.get("delta") or {}).get("role") and not (c.get("delta") or {}).get("content")
                                 and c.get("finish_reason") is None for c in choices)


async def ask_orchestrator(request: web.Request, membership: Membership, client: PeerClient,
                           body: bytes) -> web.StreamResponse:
    """Pass ``request`` (its ``body`` decompressed) on to the orchestrator and its answer back."""
    election = membership.election
    assert election is not None
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
    headers[CLIENT_HEADER] = client_of(request)  # the client this agent saw, for its fair share
    if request.method == "POST" and request.path in RESUMABLE_PATHS:
        return await _resumable(request, membership, client, body, headers, election.orchestrator)
    response: web.StreamResponse | None = None
    try:
        async with client.session.request(request.method, _target(membership, election.orchestrator)
                                          + request.rel_url.path_qs, data=body or None, headers=headers,
                                          timeout=PROXY_TIMEOUT, ssl=client.ssl) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        if response is None:
            raise ClusterError(f"the orchestrator stopped answering ({type(error).__name__}); retry the request") from None
        # Its status went out already: the client must see the answer cut, not ended. Dropping
        # the connection without the body's end tells it so (an incomplete chunked body).
        log.warning("the orchestrator's answer to %s %s was cut: %s", request.method, request.path, error)
        if request.transport is not None:
            request.transport.close()
        return response
    await response.write_eof()
    return response


async def _resumable(request: web.Request, membership: Membership, client: PeerClient, raw: bytes,
                     headers: dict[str, str], orchestrator: str) -> web.StreamResponse:
    body = json.loads(raw)
    headers = {**headers, RESUMABLE_HEADER: "1", "Content-Type": "application/json"}
    generated: list[int] = []
    response: web.StreamResponse | None = None
    first: dict[str, Any] = {}  # the id and created of the stream, kept across orchestrators
    resumes = 0
    loop = asyncio.get_running_loop()
    settle_until = 0.0  # after a loss: until when a new orchestrator's 503 means "not ready yet"
    while True:
        payload = {**body, RESUME_FIELD: {"tokens": generated}} if generated else body
        try:
            async with client.session.post(_target(membership, orchestrator) + request.rel_url.path_qs,
                                           data=json.dumps(payload).encode(), headers=headers,
                                           timeout=PROXY_TIMEOUT, ssl=client.ssl) as upstream:
                if upstream.content_type != "text/event-stream" or upstream.status != 200:
                    answer = await upstream.read()
                    if upstream.status == 503 and loop.time() < settle_until:
                        raise _Lost(f"the new orchestrator is not serving yet: {answer[:200]!r}")
                    if response is not None:  # a resume refused: end the stream with its error
                        await _write_error(response, _error_of(answer, upstream.status))
                        await response.write_eof()
                        return response
                    return web.Response(status=upstream.status, body=answer, headers={
                        k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS})
                if response is None:
                    response = web.StreamResponse(status=200, headers={
                        k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS})
                    await response.prepare(request)
                async for data in _events(upstream.content, membership, orchestrator):
                    if data == b"[DONE]":
                        await response.write(b"data: [DONE]\n\n")
                        await response.write_eof()
                        return response
                    chunk = json.loads(data)
                    if "error" in chunk:  # the orchestrator's own verdict: it ends the stream
                        await _write_error(response, chunk)
                        await response.write_eof()
                        return response
                    generated.extend(int(t) for t in chunk.pop(TOKENS_FIELD, ()))
                    if first and _role_only(chunk):
                        continue  # the client had its role event from the first orchestrator
                    for key in ("id", "created"):
                        first.setdefault(key, chunk.get(key))
                        chunk[key] = first[key]
                    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                raise _Lost("the event stream ended early")
        except (aiohttp.ClientError, asyncio.TimeoutError, _Lost) as error:
            reason = str(error) if isinstance(error, _Lost) else type(error).__name__
        if settle_until and loop.time() < settle_until and membership.election is not None \
                and membership.election.orchestrator == orchestrator:
            await asyncio.sleep(SETTLE_POLL_S)  # the new orchestrator is taking over the deployments
            continue
        resumes += 1
        log.warning("the orchestrator %s stopped answering (%s) %s", orchestrator, reason,
                    f"after {len(generated)} token(s); going on with the next one" if response is not None
                    else "before answering; asking the next one")
        successor = await _next_orchestrator(membership, orchestrator, RESUME_WAIT_S) if resumes <= MAX_RESUMES else None
        settle_until = loop.time() + RESUME_WAIT_S
        if successor is None:
            message = f"the orchestrator stopped answering ({reason}) and no other took over; retry the request"
            if response is None:
                raise ClusterError(message)
            await _write_error(response, {"error": {"message": message, "type": "service_unavailable", "param": None,
                                                    "code": "orchestrator_lost"}})
            await response.write_eof()
            return response
        orchestrator = successor


def _error_of(answer: bytes, status: int) -> dict[str, Any]:
    try:
        error = json.loads(answer)
        if isinstance(error, dict) and isinstance(error.get("error"), dict):
            return error
    except ValueError:
        pass
    return {"error": {"message": f"the new orchestrator could not go on with the request (HTTP {status})",
                      "type": "service_unavailable", "param": None, "code": "orchestrator_lost"}}


async def _write_error(response: web.StreamResponse, error: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(error).encode() + b"\n\n")


async def pass_to_orchestrator(request: web.Request) -> web.StreamResponse | None:
    """Pass the request on to the orchestrator when this node is not it (None: handle here)."""
    membership = request.app[MEMBERSHIP]
    election = membership.election
    if election is None:
        raise ClusterError("no orchestrator has been elected yet; the cluster is starting")
    if election.orchestrator == request.app[NODE_ID]:
        return None
    body = await read_body(request)  # decompressed: the Content-Encoding header is not passed on
    return await ask_orchestrator(request, membership, request.app[CLIENT], body)


def on_orchestrator(handler: Any) -> Any:
    """Run ``handler`` on the orchestrator: other agents pass the request on to it."""
    @functools.wraps(handler)
    async def wrapper(request: web.Request) -> web.StreamResponse:
        proxied = await pass_to_orchestrator(request)
        return proxied if proxied is not None else await handler(request)
    return wrapper
