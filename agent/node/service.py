"""The agent service (`ncm serve`): one aiohttp application per device.

Public API (OpenAI + cluster views) and the internal peer endpoints share one port; internal
endpoints accept only requests signed with the cluster key. Every background task is owned
by a cleanup context and cancelled on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

import aiohttp
from aiohttp import web, web_protocol

from agent.cluster.discovery import Discovery
from agent.cluster.membership import Membership
from agent.cluster.pairing import InviteStore, join_pending, take_new_key
from agent.cluster.peer_client import PeerClient
from agent.cluster.tls import TLS_DIR, TlsFiles, issue_node_files
from agent.core.auth import HEADER_NONCE, ReplayGuard, admin_token, sign_answer, verify
from agent.core.deployments import ClusterState, weight_sources
from agent.core.errors import AuthError, KeyChangeRefusedError, NcmError, StaleRequestError, WireError
from agent.core.node_report import NodeReport, StageFault, WorkerReport
from agent.core.orders import RoutingOrder
from agent.core.protocol import (
    ABORT_PATH,
    COMMIT_PATH,
    COPY_PATH,
    DESCRIBE_PATH,
    EMBED_PATH,
    INTERNAL_PREFIX,
    MODEL_FILE_PATH,
    MODEL_LISTING_PATH,
    PAIR_PATH,
    REKEY_PATH,
    ROUTING_PATH,
    STATE_PATH,
    STREAM_PATH,
    UNLOAD_PATH,
    CloseFrame,
    CopyOrder,
    CopyQueued,
    EmbedOrder,
    Introduction,
    OrderStep,
    PingFrame,
    Rekeyed,
    RekeyOrder,
    StepFrame,
    UnloadOrder,
)
from agent.core.rate_limit import RateLimiter
from agent.core.wire import decode_frame, encode_frame
from agent.dataplane.links import Links, Replies
from agent.http import (
    cluster_endpoints,
    dashboard_page,
    embeddings,
    metrics_endpoint,
    model_endpoints,
    ollama,
    openai_api,
)
from agent.http.admin import admin_token_required, bearer_matches, changes_cluster, holds_admin_token
from agent.http.app_keys import (
    ADMIN_TOKEN,
    CLIENT,
    CONFIG,
    DATA_PLANE_SOCKETS,
    DRAIN_TIMEOUT_S,
    EMBEDDINGS,
    EVENTS,
    INVITES,
    LIFECYCLE,
    LINKS,
    MEMBERSHIP,
    METRICS,
    NODE_ID,
    ORCHESTRATOR,
    PAIR_LIMIT,
    REFUSED_INTERNAL,
    REFUSED_INVITES,
    REPLAY_GUARD,
    RESULTS,
    ROUTER,
    SCRUBBER,
    STORE,
    WORKER,
)
from agent.http.clients import from_member
from agent.http.errors_shape import answer_error, error_response, openai_errors
from agent.http.metrics_endpoint import count_requests
from agent.local.compat import TaskGroup, timeout
from agent.local.config import CLUSTER_KEY_FILE, AgentConfig, ConfigError
from agent.local.events import EventLog
from agent.local.files import write_private
from agent.local.identity import load_or_create_node_id
from agent.local.lifecycle import Lifecycle
from agent.local.log_throttle import ThrottledWarning
from agent.local.metrics import ClusterStateCollector, Metrics
from agent.local.sd_notify import SystemdNotifier, format_status, run_watchdog, watchdog_interval_s
from agent.models.embeddings import EmbeddingModels
from agent.models.router import ModelRouter
from agent.orchestration.orchestrator import Orchestrator
from agent.stage.scrub import Scrubber
from agent.stage.weights import complete_models, describe_model_files, ensure_encoder_files, resolve_model_file
from agent.stage.worker import StaleOrderError, Worker, WorkerState, failure_cause
from shards.errors import ShardsError
from shards.graph.fragment import FRAGMENTS_DIR, sweep_fragments
from shards.store.model_store import ModelStore
from shards.store.verify import intact

log = logging.getLogger(__name__)
# Strangers' connections: the headers of a request come in full within HEADER_READ_TIMEOUT_S of
# the connection (else it is closed), one address holds at most MAX_PENDING_PER_ADDRESS
# connections whose first request has not come in full, and a TLS handshake on the peer port
# ends within TLS_HANDSHAKE_TIMEOUT_S. What one request holds is bounded by aiohttp's header
# limits (8 KiB a line) and the body limit (client_max_size).
HEADER_READ_TIMEOUT_S = 10.0
MAX_PENDING_PER_ADDRESS = 64
TLS_HANDSHAKE_TIMEOUT_S = 10.0
SHUTDOWN_TIMEOUT_S = 30.0
PUBLIC_WITHOUT_TOKEN = ("/health", "/openapi.json", PAIR_PATH, *dashboard_page.PAGE_PATHS)
ANSWER_NONCE = web.RequestKey("answer_nonce", str)  # the nonce of the member's request a signed answer binds

internal = web.RouteTableDef()


def stored_cluster_key(config: AgentConfig) -> bytes | None:
    """The configured key, else the one in the state directory; None when there is none yet."""
    if config.cluster_key:
        return config.cluster_key.encode()
    path = config.state_dir / CLUSTER_KEY_FILE
    return path.read_text(encoding="utf-8").strip().encode() if path.exists() else None


def cluster_key(config: AgentConfig) -> bytes:
    """The configured key, else one generated once in the state directory (single-node use)."""
    key = stored_cluster_key(config)
    if key is not None:
        return key
    path = config.state_dir / CLUSTER_KEY_FILE
    write_private(path, secrets.token_hex(32) + "\n")
    log.warning("no cluster_key configured: generated one in %s; add devices with `ncm invite` here and "
                "`ncm join` on them", path)
    return path.read_text(encoding="utf-8").strip().encode()


# --- middlewares -----------------------------------------------------------------------------------
@web.middleware
async def peer_auth(request: web.Request, handler: Any) -> web.StreamResponse:
    """Internal endpoints: only peers holding the cluster key (HMAC over the whole URL, the
    target node, time and nonce). Answers to members are signed (:func:`sign_answers`)."""
    if not request.path.startswith(INTERNAL_PREFIX):
        return await handler(request)
    if not from_member(request):
        return error_response(403, "internal endpoints answer only over TLS on the peer port (GET /health names it)",
                              code="peer_port_only")
    body = await request.read()
    try:
        verify(
            request.app[CLIENT].key, request.method, request.raw_path, body, request.headers,
            now=time.time(), guard=request.app[REPLAY_GUARD], node_id=request.app[NODE_ID],
            any_target=request.path == DESCRIBE_PATH,
        )
    except AuthError as error:
        if isinstance(error, StaleRequestError):  # a member's request: the refusal is signed
            request[ANSWER_NONCE] = request.headers[HEADER_NONCE]
        request.app[REFUSED_INTERNAL].warn(request.remote or "?", f"{request.method} {request.path}: {error}")
        return answer_error(error)
    request[ANSWER_NONCE] = request.headers[HEADER_NONCE]
    return await handler(request)


async def sign_answers(request: web.Request, response: web.StreamResponse) -> None:
    """Sign every answer to a member's internal request, so that the member acts only on
    answers of key holders (streamed bodies are signed without their bytes)."""
    nonce = request.get(ANSWER_NONCE)
    if nonce is None:
        return
    body = response.body if isinstance(response, web.Response) and isinstance(response.body, bytes) else None
    response.headers.update(sign_answer(request.app[CLIENT].key, responder=request.app[NODE_ID], nonce=nonce,
                                        status=response.status, body=body))


@web.middleware
async def access(request: web.Request, handler: Any) -> web.StreamResponse:
    """Public endpoints: those that change the cluster need the admin token, always; the
    others need an API key (or the admin token) when `api_keys` / `api_token` are set."""
    if request.path.startswith(INTERNAL_PREFIX) or request.path in PUBLIC_WITHOUT_TOKEN:
        return await handler(request)
    if changes_cluster(request):
        if not holds_admin_token(request):
            return admin_token_required()
        return await handler(request)
    keys = request.app[CONFIG].accepted_api_keys
    if keys and not holds_admin_token(request) and not bearer_matches(request, keys):
        return error_response(401, "a valid API key is needed: send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key")
    return await handler(request)


# --- internal endpoints ----------------------------------------------------------------------------
@internal.post(DESCRIBE_PATH)
async def describe(request: web.Request) -> web.Response:
    membership = request.app[MEMBERSHIP]
    try:
        membership.introduced(Introduction.from_json(await request.json()), request.remote)
    except json.JSONDecodeError:
        pass
    return web.json_response(membership.describe(request.remote).to_json())


def internal_error(error: NcmError) -> web.Response:
    """An internal endpoint's refusal, as the error's class answers it: ``{"error", "code",
    "param", "retry_after_s"}`` (what :class:`~agent.core.errors.RelayedError` reads back)."""
    answer = error.answer()
    return web.json_response(answer.to_json(), status=answer.status)


async def read_message(request: web.Request, kind: Any) -> Any:
    """The body of an internal POST as the message class ``kind`` (WireError when it is none)."""
    try:
        body = await request.json()
    except json.JSONDecodeError as error:
        raise WireError(f"the body is not JSON: {error}") from None
    return kind.from_json(body)


@internal.post(ROUTING_PATH)
async def set_routing(request: web.Request) -> web.Response:
    """Stage an order: build its fragments; the order served changes at the commit."""
    try:
        order = await read_message(request, RoutingOrder)
    except WireError as error:
        return internal_error(error)
    worker = request.app[WORKER]
    try:
        # Shielded: a deployment goes on even if the orchestrator's connection drops meanwhile.
        return web.json_response(await asyncio.shield(worker.stage(order)))
    except StaleOrderError as error:
        return internal_error(error)
    except Exception as error:  # noqa: BLE001 - reported to the orchestrator, the agent keeps running
        log.debug("plan %d not staged", order.plan_version, exc_info=True)
        fault = worker.fault or StageFault(failure_cause(error), f"{type(error).__name__}: {error}")
        return web.json_response(fault.to_json(), status=500)


async def _order_step(request: web.Request, action: str) -> web.Response:
    worker = request.app[WORKER]
    step = worker.commit if action == "commit" else worker.abort
    try:
        order = await read_message(request, OrderStep)
        return web.json_response(await asyncio.shield(step(order.name, order.plan_version, order.epoch)))
    except (WireError, StaleOrderError) as error:
        return internal_error(error)


@internal.post(COMMIT_PATH)
async def commit_routing(request: web.Request) -> web.Response:
    """Switch to a staged order: every node of its route has staged it."""
    return await _order_step(request, "commit")


@internal.post(ABORT_PATH)
async def abort_routing(request: web.Request) -> web.Response:
    """Drop a staged order: some node of its route could not stage it."""
    return await _order_step(request, "abort")


@internal.post(COPY_PATH)
async def keep_copy(request: web.Request) -> web.Response:
    """The orchestrator asks this node to hold a whole copy of the fallback model (fetched in
    the background, when the disk has room)."""
    try:
        copy = await read_message(request, CopyOrder)
    except WireError as error:
        return internal_error(error)
    return web.json_response(CopyQueued(request.app[WORKER].keep_whole_copy(copy.model, list(copy.sources))).to_json(),
                             status=202)


@internal.post(UNLOAD_PATH)
async def unload_model(request: web.Request) -> web.Response:
    """The orchestrator drops a model (unloaded, evicted or asleep): free its fragments."""
    try:
        order = await read_message(request, UnloadOrder)
        return web.json_response(await asyncio.shield(request.app[WORKER].unload(order.name, order.epoch)))
    except (WireError, StaleOrderError) as error:
        return internal_error(error)


@internal.post(REKEY_PATH)
async def rekey(request: web.Request) -> web.Response:
    """The orchestrator removed a node: take the new cluster key and restart with it."""
    try:
        order = await read_message(request, RekeyOrder)
        await asyncio.to_thread(take_new_key, request.app[CONFIG], order)
    except (WireError, KeyChangeRefusedError) as error:
        return internal_error(error)
    request.app[INVITES].revoke_all()  # none is redeemed in the moment before the restart either
    request.app[LIFECYCLE].restart_now()  # this answer goes out first
    log.info("the cluster key was changed by the orchestrator (a node was removed): restarting with it")
    return web.json_response(Rekeyed(request.app[NODE_ID]).to_json())


@internal.post(EMBED_PATH)
async def embed(request: web.Request) -> web.Response:
    """Embed texts with an embedding model the router placed here, fetched first when this
    node does not store it."""
    try:
        order = await read_message(request, EmbedOrder)
        store, models = request.app[STORE], request.app[EMBEDDINGS]
        if not store.has_encoder(order.model):
            await ensure_encoder_files(request.app[CLIENT], store, order.model, list(order.sources))
        result = await models.embed(order.model, list(order.texts), truncate=order.truncate)
        if order.keep_alive_s is not None:
            models.keep_alive(order.model, order.keep_alive_s, close=order.close)
    except NcmError as error:
        return internal_error(error)
    return web.json_response(result.to_json())


@internal.get(STATE_PATH)
async def state(request: web.Request) -> web.Response:
    return web.json_response(request.app[WORKER].status())


@internal.get(MODEL_LISTING_PATH)
async def model_listing(request: web.Request) -> web.Response:
    store = request.app[STORE]
    name = request.match_info["name"]
    if not store.has(name) and not store.has_encoder(name):
        raise web.HTTPNotFound(text=f"model {name} is not here")
    return web.json_response((await asyncio.to_thread(describe_model_files, store.models_dir / name)).to_json())


@internal.get(MODEL_FILE_PATH.replace("{path}", "{path:.+}"))
async def model_file(request: web.Request) -> web.StreamResponse:
    store = request.app[STORE]
    name = request.match_info["name"]
    encoder = store.has_encoder(name)
    if not store.has(name) and not encoder:
        raise web.HTTPNotFound(text=f"model {name} is not here")
    relative = request.match_info["path"]
    try:
        path = resolve_model_file(store.models_dir / name, relative)
    except FileNotFoundError:
        raise web.HTTPNotFound(text="no such file") from None
    try:
        files = (store.encoder_manifest(name) if encoder else store.manifest(name)).files
        entry = next((e for e in files.values() if e.path == relative), None)
    except ShardsError:
        raise web.HTTPNotFound(text=f"model {name} is unreadable here") from None
    if entry is not None and not await asyncio.to_thread(intact, store.models_dir / name, entry):
        log.warning("not offering %s of %s to a peer: it does not match the manifest", relative, name)
        raise web.HTTPNotFound(text=f"{relative} is corrupt here")
    return web.FileResponse(path, chunk_size=1 << 20)  # honours Range: transfers resume


@internal.get(STREAM_PATH)
async def stream(request: web.Request) -> web.WebSocketResponse:
    """The data plane on one persistent socket: steps in (run and handed on), results and
    failures for this orchestrator, closes, pings."""
    # A frame over the limit closes the socket (1009) before it is held whole in memory.
    ws = web.WebSocketResponse(max_msg_size=request.app[WORKER].max_frame_bytes(), compress=False)
    await ws.prepare(request)
    # The first message proves to the caller that this node holds the cluster key.
    await ws.send_str(json.dumps(sign_answer(request.app[CLIENT].key, responder=request.app[NODE_ID],
                                             nonce=request[ANSWER_NONCE], status=101, body=None)))
    worker = request.app[WORKER]
    sockets = request.app[DATA_PLANE_SOCKETS]
    sockets.add(ws)

    async with TaskGroup() as steps:
        async for message in ws:
            if message.type != aiohttp.WSMsgType.BINARY:
                continue
            try:
                header, tensor = decode_frame(message.data)
            except WireError as error:
                log.warning("closing data plane from %s: %s", request.remote, error)
                await ws.close(code=aiohttp.WSCloseCode.UNSUPPORTED_DATA, message=str(error).encode()[:120])
                break
            kind = header["kind"]
            if kind == "step":  # run, handed on; its outcome goes to its reply node
                steps.create_task(worker.relay(StepFrame.from_header(header), tensor))
            elif kind == "close":
                close = CloseFrame.from_header(header)
                worker.close_session(close.sid, keep=close.keep)
            elif kind in ("result", "error"):  # a step's outcome, sent straight to this orchestrator
                request.app[RESULTS].deliver(header)
            elif kind == "ping":
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await ws.send_bytes(encode_frame(PingFrame.from_header(header).pong().header()))
    sockets.discard(ws)
    return ws


async def close_data_plane(app: web.Application) -> None:
    """On shutdown: data-plane sockets never end by themselves, so close them (steps in
    flight fail with a clear error at their orchestrator) and the links to other stages."""
    for ws in list(app[DATA_PLANE_SOCKETS]):
        await ws.close(code=aiohttp.WSCloseCode.GOING_AWAY, message=b"agent stopping")
    await app[LINKS].close()
    if ORCHESTRATOR in app:
        await app[ORCHESTRATOR].requests.close()


# --- the application -------------------------------------------------------------------------------
def build_app(config: AgentConfig, *, node_id: str, store: ModelStore, api_port: int, peer_port: int, key: bytes,
              tls: TlsFiles, drain_timeout_s: float = SHUTDOWN_TIMEOUT_S) -> web.Application:
    """The agent; ``drain_timeout_s``: how long a stopping agent lets the requests it runs finish."""
    app = web.Application(middlewares=[ollama.error_shape, count_requests, peer_auth, access, openai_errors],
                          client_max_size=16 * 1024 * 1024)
    app[CONFIG] = config
    app[NODE_ID] = node_id
    app[STORE] = store
    app[REPLAY_GUARD] = ReplayGuard()
    app[ADMIN_TOKEN] = admin_token(key)
    app[LIFECYCLE] = Lifecycle(asyncio.Event())
    app[INVITES] = InviteStore(config.state_dir, key)
    app[PAIR_LIMIT] = RateLimiter(cluster_endpoints.PAIR_ATTEMPTS_PER_S, cluster_endpoints.PAIR_ATTEMPTS_BURST)
    app[REFUSED_INVITES] = ThrottledWarning(logging.getLogger(cluster_endpoints.__name__), "refused an invite")
    app[REFUSED_INTERNAL] = ThrottledWarning(log, "refused an internal request")
    app[DATA_PLANE_SOCKETS] = set()
    app[DRAIN_TIMEOUT_S] = drain_timeout_s
    app[EVENTS] = EventLog()
    app[METRICS] = Metrics()
    app[EMBEDDINGS] = EmbeddingModels(store, config.threads, idle_s=config.sleep_idle_s)
    app[EVENTS].listen(app[METRICS].count_event)
    app.on_shutdown.append(close_data_plane)
    app.on_response_prepare.append(sign_answers)
    app.add_routes(internal)
    app.add_routes(cluster_endpoints.routes)
    app.add_routes(model_endpoints.routes)
    app.add_routes(openai_api.routes)
    app.add_routes(ollama.routes)
    app.add_routes(embeddings.routes)
    app.add_routes(dashboard_page.routes)
    app.add_routes(metrics_endpoint.routes)

    async def peers(app: web.Application) -> AsyncIterator[None]:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256, keepalive_timeout=60))
        client = PeerClient(session, key, node_id, tls.client_context())
        app[CLIENT] = client
        app[LINKS] = Links(client)
        app[RESULTS] = Replies()
        events = app[EVENTS]
        app[MEMBERSHIP] = Membership(
            config, node_id, client, api_port=api_port, peer_port=peer_port, events=events,
            describe_extra=lambda: NodeReport(complete_models(store), WorkerReport.from_json(app[WORKER].status()),
                                              app[WORKER].device_memory(), app[EMBEDDINGS].open_models(time.monotonic())),
            held_bytes=lambda: app[WORKER].held_bytes())
        app[WORKER] = Worker(node_id, config, store, client, app[LINKS], app[RESULTS], app[METRICS],
                             app[MEMBERSHIP].agents_on_host, beside_bytes=lambda: (
                                 app[EMBEDDINGS].held_bytes() + app[ORCHESTRATOR].requests.drafts.held_bytes()))
        app[ROUTER] = ModelRouter(config, store, app[MEMBERSHIP], events, lambda models: Orchestrator(
            node_id, config, app[MEMBERSHIP], app[WORKER], client, store, events, models, app[RESULTS]))
        app[ORCHESTRATOR] = app[ROUTER].orchestrator
        state = ClusterStateCollector(
            models=app[ROUTER].models, worker_status=app[WORKER].status, device_memory=app[WORKER].device_memory,
            degraded=lambda: {n for n, d in app[ORCHESTRATOR].deployments.items() if d.order.degraded},
            alive_nodes=lambda: len(app[MEMBERSHIP].alive_nodes()), is_orchestrator=lambda: app[ROUTER].enabled)
        app[METRICS].registry.register(state)
        events.listen(state.account)
        yield
        await app[LINKS].close()
        app[WORKER].close()
        await session.close()

    def sources_of(model: str) -> list[tuple[str, str]]:
        """Live peers to fetch ``model``'s files from, those holding it whole first."""
        holdings = {node: report.models for node, report in app[MEMBERSHIP].peer_reports().items()}
        return [(node, app[MEMBERSHIP].peer_address_of(node)) for node in weight_sources(model, holdings, node_id)]

    async def background(app: web.Application) -> AsyncIterator[None]:
        discovery = Discovery(app[MEMBERSHIP], config.interfaces) if config.mdns else None
        if discovery is not None:
            await discovery.start()
        scrubber = app[SCRUBBER] = Scrubber(
            store, config.state_dir, app[CLIENT], app[EVENTS], sources_of=sources_of,
            record_repair=app[WORKER].fragments.note_repair, interval_s=config.scrub_interval_s,
            rate_bytes_s=config.scrub_rate_mib_s * 1024 * 1024)
        await asyncio.to_thread(scrubber.started)
        tasks = [
            asyncio.create_task(scrubber.run(), name="scrub"),
            asyncio.create_task(app[MEMBERSHIP].run(), name="membership"),
            asyncio.create_task(app[ORCHESTRATOR].run(), name="orchestrator"),
            asyncio.create_task(app[ROUTER].run(), name="model-router"),
            asyncio.create_task(app[WORKER].reap_idle_sessions(), name="session-reaper"),
            asyncio.create_task(app[WORKER].copies.fetch_copies(), name="fallback-copies"),
            asyncio.create_task(join_pending(config, app[CLIENT].session, app[LIFECYCLE]), name="pending-join"),
            asyncio.create_task(app[EMBEDDINGS].close_when_idle(), name="embedding-models"),
        ]
        if discovery is not None:
            tasks.append(asyncio.create_task(discovery.run(), name="mdns-refresh"))
        yield
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if discovery is not None:
            await discovery.stop()
        app[EMBEDDINGS].close_all()
        scrubber.stopped_cleanly()

    app.cleanup_ctx.extend([peers, background])
    return app


def status_line(app: web.Application) -> str:
    orchestrator, worker = app[ORCHESTRATOR], app[WORKER]
    peers = len(app[MEMBERSHIP].alive_nodes()) - 1
    layers = [f["layers"] for f in worker.status()["fragments"]]
    if worker.state == WorkerState.READY and layers:
        span = (min(a for a, _ in layers), max(b for _, b in layers))
        state = "degraded, serving" if orchestrator.state == ClusterState.DEGRADED else "serving"
        return format_status(state, model=worker.current.model if worker.current else None, layers=span, peers=peers)
    if app[MEMBERSHIP].election is None:
        return format_status("discovering", peers=peers)
    return format_status(worker.state if worker.state != WorkerState.IDLE else "waiting for a plan", peers=peers)


def sweep_fragment_caches(store: ModelStore) -> None:
    """Clear what upgrades and crashes left in the store: staging folders of imports and
    fetches that were killed, and stale builds in the models' fragment caches."""
    store.sweep_staging()
    for manifest in store.list():
        try:
            removed = sweep_fragments(store.models_dir / manifest.name / FRAGMENTS_DIR, now_s=time.time())
        except OSError as error:
            log.warning("cannot sweep the fragments of %s: %s", manifest.name, error)
            continue
        if removed:
            log.info("removed %d stale fragment build(s) of %s", removed, manifest.name)


class _AgentRequestHandler(web_protocol.RequestHandler):
    """aiohttp's request handler, with the limits strangers need (see HEADER_READ_TIMEOUT_S)
    and parse-level refusals (a body in an encoding it cannot decode, a malformed request
    line) answered in the OpenAI error shape."""

    def __init__(self, manager: _AgentServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._agent_server = manager
        self._address: str | None = None  # while its first request's headers are not in
        self._head = b""
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if not self._agent_server.pending_allowed(address):
            self._agent_server.dropped_connections.warn(address, f"more than {MAX_PENDING_PER_ADDRESS} connections without a request")
            transport.close()
            return
        self._address = address
        self._header_timer = asyncio.get_running_loop().call_later(HEADER_READ_TIMEOUT_S, self._headers_too_slow)

    def data_received(self, data: bytes) -> None:
        if self._address is not None:
            seen = self._head + data  # the end of the headers can come with the body, or split over reads
            if b"\r\n\r\n" in seen:  # the first request's headers are in: no longer a stranger's trickle
                self._headers_in()
            else:
                self._head = seen[-3:]
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._headers_in()
        super().connection_lost(exc)

    def _headers_in(self) -> None:
        if self._address is not None:
            self._agent_server.pending_done(self._address)
            self._address, self._head = None, b""
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        self._agent_server.dropped_connections.warn(self._address or "?", f"no request in full within {HEADER_READ_TIMEOUT_S:g} s")
        if self.transport is not None:
            self.transport.close()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        response = super().handle_error(request, status, exc, message)
        if not 400 <= status < 500:
            return response
        shaped = error_response(status, message or HTTPStatus(status).phrase)
        shaped.force_close()
        return shaped


class _AgentServer(web.Server):
    """Makes :class:`_AgentRequestHandler` s and counts each address's pending connections
    (the runner turns aiohttp's server into this class after making it, and gives it
    ``pending``: no ``__init__`` here)."""

    pending: Counter[str]  # address -> connections whose first request has not come in full
    dropped_connections: ThrottledWarning

    def __call__(self) -> web_protocol.RequestHandler:
        return _AgentRequestHandler(self, loop=self._loop, **self._kwargs)

    def pending_allowed(self, address: str) -> bool:
        if self.pending[address] >= MAX_PENDING_PER_ADDRESS:
            return False
        self.pending[address] += 1
        return True

    def pending_done(self, address: str) -> None:
        self.pending[address] -= 1
        if self.pending[address] <= 0:
            del self.pending[address]


class _PeerSite(web.SockSite):
    """The peer port's listening socket: TLS, with a bounded handshake."""

    async def start(self) -> None:
        await web.BaseSite.start(self)
        self._server = await asyncio.get_running_loop().create_server(
            self._runner.server, sock=self._sock, ssl=self._ssl_context, backlog=self._backlog,
            ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S)


class AgentRunner(web.AppRunner):
    """The application runner of an agent: parse-level refusals in the OpenAI error shape, and
    a stop that lets the requests this node runs as orchestrator finish first."""

    async def cleanup(self) -> None:
        """Stop listening, let the requests this node orchestrates finish (up to the drain
        timeout: its connections, its links and the data plane it serves as a stage stay up
        meanwhile), then shut the application down."""
        for site in list(self.sites):
            await site.stop()
        app = self.app
        if ORCHESTRATOR in app and not await app[ORCHESTRATOR].requests.drained(app[DRAIN_TIMEOUT_S]):
            log.warning("stopping with requests in flight after %g s: they go on on the next orchestrator",
                        app[DRAIN_TIMEOUT_S])
        await super().cleanup()

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _AgentServer
        server.pending = Counter()
        server.dropped_connections = ThrottledWarning(log, "dropped a connection")
        return server


async def start_agent(config: AgentConfig, *, node_id: str, store: ModelStore, key: bytes,
                      shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S) -> web.AppRunner:
    """Build the application and listen: the public API on ``config.port``, the internal
    endpoints over mutual TLS on the peer port (``config.peer_port``, or any free port)."""
    tls = await asyncio.to_thread(issue_node_files, key, node_id, config.state_dir / TLS_DIR)
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    try:
        peer_socket = socket.create_server((config.host, config.peer_port), family=family)
    except OSError as error:
        raise ConfigError(f"cannot listen on {config.host}:{config.peer_port}: {error.strerror}") from None
    app = build_app(config, node_id=node_id, store=store, api_port=config.port,
                    peer_port=config.advertise_peer_port or peer_socket.getsockname()[1], key=key, tls=tls,
                    drain_timeout_s=shutdown_timeout_s)
    # handler_cancellation: a client that disconnects cancels its request (a waiting request
    # leaves the model queue, a generation stops) also when it came through another agent.
    runner = AgentRunner(app, shutdown_timeout=shutdown_timeout_s, access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port, reuse_address=True).start()
        await _PeerSite(runner, peer_socket, ssl_context=tls.server_context()).start()
    except OSError as error:
        await runner.cleanup()
        peer_socket.close()
        raise ConfigError(f"cannot listen on {config.host}:{config.port}: {error.strerror}") from None
    return runner


async def serve(config: AgentConfig) -> None:
    """Run the agent until SIGTERM / SIGINT."""
    node_id = load_or_create_node_id(config.state_dir)
    store = ModelStore(config.models_home)
    await asyncio.to_thread(sweep_fragment_caches, store)
    key = cluster_key(config)
    notifier = SystemdNotifier.from_env()
    runner = await start_agent(config, node_id=node_id, store=store, key=key)
    app = runner.app
    log.info("node %s listening on %s:%d, peers over TLS on port %d (cluster %r)", node_id, config.host,
             config.port, app[MEMBERSHIP].peer_port, config.cluster_name)
    lifecycle = app[LIFECYCLE]
    stop = lifecycle.stop
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if notifier is not None:
        notifier.ready(status_line(app))
    watchdog = asyncio.create_task(run_watchdog(notifier, watchdog_interval_s()), name="watchdog")
    try:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                async with timeout(5.0):
                    await stop.wait()
            if notifier is not None:
                notifier.status(status_line(app))
    finally:
        log.info("stopping: finishing requests in flight (up to %g s)", SHUTDOWN_TIMEOUT_S)
        if notifier is not None:
            notifier.stopping("stopping")
        watchdog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watchdog
        await runner.cleanup()
        if notifier is not None:
            notifier.close()
    if lifecycle.restart:
        # Joined a cluster by invite: start again as its member, in the same process (the
        # service manager sees no exit), reading the key and settings the join left.
        log.info("restarting as a member of the cluster it joined")
        os.execv(sys.executable, [sys.executable, "-m", "agent.cli", *sys.argv[1:]])
