"""Public HTTP API: OpenAI-compatible endpoints, cluster views and health.

Any agent answers; requests that need the orchestrator are passed to it. Errors use the
OpenAI error shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from agent.cluster.pairing import join_by_invite, rotate_key, seal
from agent.core.capacity import score
from agent.core.chat_request import ChatRequest, check_model_name, parse_request
from agent.core.errors import (
    ClusterError,
    InvalidRequestError,
    InviteError,
    NcmError,
    PresetError,
    PublicAnswer,
    RelayedError,
    RouterError,
    WireError,
    without_addresses,
)
from agent.core.invites import DEFAULT_INVITE_TTL_S, JoinString, fingerprint
from agent.core.protocol import PAIR_PATH, PairRequest
from agent.core.request_fields import OPENAI_CHAT, OPENAI_COMPLETION, check_fields
from agent.dataplane.links import StageError
from agent.http.app_keys import (
    ADMIN_TOKEN,
    CLIENT,
    CONFIG,
    EMBEDDINGS,
    EVENTS,
    INVITES,
    LIFECYCLE,
    MEMBERSHIP,
    METRICS,
    NODE_ID,
    ORCHESTRATOR,
    PAIR_LIMIT,
    ROUTER,
    WORKER,
)
from agent.http.clients import client_of, from_member
from agent.http.metrics_endpoint import REQUEST_MODEL
from agent.http.openapi import openapi_document
from agent.http.proxy import RESUMABLE_HEADER, RESUME_FIELD, TOKENS_FIELD, ask_orchestrator
from agent.local.compat import timeout
from agent.local.log_throttle import ThrottledWarning
from agent.local.metrics import THROUGHPUT_WINDOW_S
from agent.orchestration.orchestrator import Completion, Deployment
from agent.orchestration.public_errors import public_reason
from shards.errors import ShardsError
from shards.runtime.answer_reader import AnswerPiece, AnswerReader
from shards.runtime.call_stream import CallDelta
from shards.runtime.grammar import ThinkFirst, json_schema_grammar
from shards.runtime.reasoning import ReasoningSplitter, ReasoningSupport, prompt_opens_thinking, reasoning_support
from shards.runtime.sampling import SamplingParams, TokenLogprobs
from shards.runtime.tool_calls import PARALLEL_BY_DEFAULT, ToolCall, call_grammar, prompt_messages, tool_format
from shards.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)
SSE_KEEPALIVE_S = 15.0
BODY_READ_TIMEOUT_S = 30.0

routes = web.RouteTableDef()


def error_response(status: int, message: str, *, type_: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    kind = type_ or PublicAnswer(status, code or "", message).kind
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}},
                             status=status, headers=headers)


def answer_error(error: NcmError) -> web.Response:
    """The OpenAI-shaped answer of ``error``: what its class says (:meth:`NcmError.answer`)."""
    answer = error.answer()
    headers = {"Retry-After": f"{answer.retry_after_s:.0f}"} if answer.retry_after_s else None
    return error_response(answer.status, answer.message, param=answer.param, code=answer.code, headers=headers)


# The errors a public endpoint answers with their own answer; any other is a 500.
PUBLIC_ERRORS = (InvalidRequestError, StageError, RouterError, PresetError, ClusterError, InviteError, RelayedError)


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Turn every failure of a public endpoint into the OpenAI error shape."""
    try:
        return await handler(request)
    except PUBLIC_ERRORS as error:
        return answer_error(error)
    except web.HTTPException as error:
        if error.status >= 400 and error.content_type != "application/json":
            return error_response(error.status, error.reason or "error", code=str(error.status))
        raise


# --- health and cluster views -------------------------------------------------------------------
@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    membership = request.app[MEMBERSHIP]
    return web.json_response({
        "status": "ok",
        "node_id": request.app[NODE_ID],
        "role": membership.role,
        "orchestrator": membership.election.orchestrator if membership.election else None,
        "peer_port": membership.peer_port,
    })


@routes.get("/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


@routes.get("/cluster/nodes")
async def cluster_nodes(request: web.Request) -> web.Response:
    membership = request.app[MEMBERSHIP]
    nodes = [{
        "id": request.app[NODE_ID], "url": membership.self_url(), "alive": True, "self": True,
        "role": membership.role, "score": float(score(membership.capacity)), "capacity": membership.capacity.to_dict(),
        "detected": membership.detected.to_dict(), "accelerators": membership.accelerators.to_dict(),
        "latency_ms": 0.0, "worker": request.app[WORKER].status(),
    }]
    extras = membership.peer_extras()
    for url, entry in sorted(membership.table.entries.items()):
        advert = entry.advert
        nodes.append({
            "id": advert.node_id if advert else None, "url": url, "alive": entry.alive, "self": False,
            "source": entry.source, "role": advert.role if advert else None,
            "score": float(score(advert.capacity)) if advert else None,
            "capacity": advert.capacity.to_dict() if advert else None, "latency_ms": entry.latency_ms,
            "failures": entry.failures,
            **{key: extras.get(advert.node_id, {}).get(key) if advert else None
               for key in ("worker", "detected", "accelerators")},
        })
    election = membership.election
    return web.json_response({
        "node_id": request.app[NODE_ID],
        "cluster": request.app[CONFIG].cluster_name,
        "orchestrator": election.orchestrator if election else None,
        "epoch": election.epoch if election else 0,
        "nodes": nodes,
        "rejected": [{"url": url, "reason": reason} for url, reason in membership.table.rejected.items()],
    })


@routes.post("/cluster/join")
async def cluster_join(request: web.Request) -> web.Response:
    """`ncm join`: {"url": ...} adds a static peer at run time; {"invite": join string} makes
    this agent a member of the cluster that issued the invite (it restarts to be one)."""
    body = await read_json(request)
    if isinstance(body, dict) and isinstance(body.get("invite"), str):
        return await _join_by_invite(request, body["invite"])
    url = body.get("url") if isinstance(body, dict) else None
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) > 255:
        raise InvalidRequestError("'url' must be an http(s):// URL of another agent, or 'invite' a join string", "url")
    request.app[MEMBERSHIP].discovered(url, "static")
    return web.json_response({"message": f"contacting {url} now"})


async def _join_by_invite(request: web.Request, text: str) -> web.Response:
    try:
        cluster, peers = await join_by_invite(request.app[CONFIG], request.app[CLIENT].session, text)
    except InviteError as error:
        raise InvalidRequestError(str(error), "invite", "invite_refused") from None
    request.app[LIFECYCLE].restart_now()  # this answer goes out first: stopping waits for requests in flight
    log.info("joined cluster %r: restarting as its member", cluster)
    return web.json_response({"message": f"joined cluster {cluster!r}; the agent restarts as its member",
                              "cluster": cluster, "peers": peers})


def _invite_settings(body: Any) -> tuple[float, int]:
    body = body if isinstance(body, dict) else {}
    ttl_s, uses = body.get("ttl_s", DEFAULT_INVITE_TTL_S), body.get("uses", 1)
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not -1e9 < ttl_s < 1e9:
        raise InvalidRequestError("'ttl_s' must be a number of seconds (at most 30 days)", "ttl_s")
    if isinstance(uses, bool) or not isinstance(uses, int):
        raise InvalidRequestError("'uses' must be an integer", "uses")
    return float(ttl_s), uses


@routes.post("/cluster/invites")
async def create_invite(request: web.Request) -> web.Response:
    """`ncm invite`: a join string for a new device (admin)."""
    ttl_s, uses = _invite_settings(await read_json(request) if request.can_read_body else {})
    invite = request.app[INVITES].create(ttl_s=ttl_s, uses=uses)
    membership = request.app[MEMBERSHIP]
    join = JoinString(request.app[CONFIG].cluster_name, membership.reachable_url(), invite.invite_id, invite.secret,
                      fingerprint(request.app[CLIENT].key))
    return web.json_response({"join": join.encode(), **invite.public(time.time())})


@routes.get("/cluster/invites")
async def list_invites(request: web.Request) -> web.Response:
    return web.json_response({"data": [i.public(time.time()) for i in request.app[INVITES].active()]})


@routes.delete("/cluster/invites/{invite_id}")
async def revoke_invite(request: web.Request) -> web.Response:
    request.app[INVITES].revoke(request.match_info["invite_id"])  # InviteNotFoundError: 404
    return web.json_response({"revoked": request.match_info["invite_id"]})


# A stranger may try invites: a few attempts a minute per address (a newcomer needs one), and
# one log line per minute however many are refused.
PAIR_ATTEMPTS_PER_S = 0.2
PAIR_ATTEMPTS_BURST = 10
refused_pairings = ThrottledWarning(log, "refused an invite")


@routes.post(PAIR_PATH)
async def pair(request: web.Request) -> web.Response:
    """A new device redeems an invite: the cluster key, sealed with the invite's secret."""
    retry_after_s = request.app[PAIR_LIMIT].allow(request.remote or "", now=time.monotonic())
    if retry_after_s is not None:
        refused_pairings.warn(request.remote or "?", "too many attempts: refused without looking")
        return error_response(429, "too many pairing attempts from this address; retry later", code="rate_limit_exceeded",
                              headers={"Retry-After": f"{retry_after_s:.0f}"})
    try:
        pairing = PairRequest.from_json(await read_json(request))
    except WireError as error:
        raise InvalidRequestError(str(error)) from None
    try:
        if pairing.cluster is not None and pairing.cluster != request.app[CONFIG].cluster_name:
            raise InviteError(f"the join string names cluster {pairing.cluster!r}, not this one (copy the join string "
                              "again, whole); the invite is still open")
        invite = request.app[INVITES].redeem(pairing)
    except InviteError as error:
        refused_pairings.warn(request.remote or "?", str(error))
        return answer_error(error)
    log.info("invite %s redeemed by %s", pairing.invite, request.remote)
    return web.json_response({"cluster": request.app[CONFIG].cluster_name,
                              "peers": request.app[MEMBERSHIP].live_peer_urls(),
                              **seal(invite.secret, pairing.nonce, pairing.invite, request.app[CLIENT].key)})


async def pass_to_orchestrator(request: web.Request) -> web.StreamResponse | None:
    """Pass the request on to the orchestrator when this node is not it (None: handle here)."""
    membership = request.app[MEMBERSHIP]
    election = membership.election
    if election is None:
        raise ClusterError("no orchestrator has been elected yet; the cluster is starting")
    if election.orchestrator == request.app[NODE_ID]:
        return None
    body = await _read_body(request)  # decompressed: the Content-Encoding header is not passed on
    return await ask_orchestrator(request, membership, request.app[CLIENT], body)


def on_orchestrator(handler: Any) -> Any:
    """Run ``handler`` on the orchestrator: other agents pass the request on to it."""
    @functools.wraps(handler)
    async def wrapper(request: web.Request) -> web.StreamResponse:
        proxied = await pass_to_orchestrator(request)
        return proxied if proxied is not None else await handler(request)
    return wrapper


@routes.post("/cluster/remove")
@on_orchestrator
async def remove_node(request: web.Request) -> web.Response:
    """`ncm remove NODE` (admin): the cluster key changes on every other member, so the
    removed device's key opens nothing any more. Every member restarts to take the new key."""
    body = await read_json(request)
    node = body.get("node") if isinstance(body, dict) else None
    membership = request.app[MEMBERSHIP]
    if not isinstance(node, str) or (node not in membership.alive_nodes() and membership.table.url_of(node) is None):
        raise InvalidRequestError("'node' must be the id of a node of this cluster (see GET /cluster/nodes)", "node")
    answer = await rotate_key(membership, request.app[CLIENT], request.app[CONFIG], request.app[LIFECYCLE], node)
    request.app[INVITES].revoke_all()  # issued under the key the removed device holds
    return web.json_response(answer)


@routes.get("/cluster/status")
@on_orchestrator
async def cluster_status(request: web.Request) -> web.StreamResponse:
    orchestrator = request.app[ORCHESTRATOR]
    membership = request.app[MEMBERSHIP]
    return web.json_response({
        **orchestrator.status(),
        "orchestrator": request.app[NODE_ID],
        "nodes_alive": sorted(membership.alive_nodes()),
        "throughput": {"tokens_per_s": request.app[METRICS].tokens_per_s(), "window_s": THROUGHPUT_WINDOW_S},
    })


@routes.get("/cluster/events")
@on_orchestrator
async def cluster_events(request: web.Request) -> web.StreamResponse:
    """Server-Sent Events: the orchestrator's recent cluster events, then every new one."""
    with request.app[EVENTS].subscribe() as events:
        return await _event_stream(request, events, lambda event: ("cluster", event.to_json()))


@routes.get("/cluster/plan")
@on_orchestrator
async def cluster_plan(request: web.Request) -> web.StreamResponse:
    orchestrator = request.app[ORCHESTRATOR]
    plan, order = orchestrator.plan, orchestrator.order
    if plan is None or order is None:
        raise ClusterError(f"no plan is deployed ({orchestrator.state}: {orchestrator.message})")
    layers = [{"layer": layer, "holders": list(holders), "coverage": len(holders)}
              for layer, holders in enumerate(plan.redundancy_map)]
    return web.json_response({
        "model": order.model, "plan_version": order.plan_version, "epoch": order.epoch,
        "plan": plan.to_dict(), "route": order.route.to_list(), "layers": layers,
        "uncovered_layers": plan.uncovered_layers(),
    })


# --- OpenAI surface ------------------------------------------------------------------------------
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


# --- model management (design §10) -------------------------------------------------------------------
def _autoload(request: web.Request) -> bool | None:
    value = request.query.get("autoload")
    if value is None:
        return None
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise InvalidRequestError("autoload must be true or false", "autoload")


def _wants_reload(request: web.Request) -> bool:
    return request.query.get("reload") in ("1", "true")


ADMIN_ENDPOINTS = frozenset({("POST", "/cluster/join"), ("POST", "/cluster/remove"), ("POST", "/models/load"),
                             ("POST", "/models/unload"), ("POST", "/models/sleep"), ("POST", "/api/pull")})


def bearer_matches(request: web.Request, accepted: Any) -> bool:
    """Whether the request's bearer token is one of ``accepted`` (each compared in constant time)."""
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    given = value.strip().encode() if scheme.lower() == "bearer" else b""
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
            or (request.path == "/models" and _wants_reload(request)))


@routes.get("/models")
@on_orchestrator
async def models(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER]
    if _wants_reload(request):
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
        return await _event_stream(request, events, lambda event: (event.pop("event"), event))


async def _event_stream(request: web.Request, events: asyncio.Queue[Any],
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


async def _read_body(request: web.Request) -> bytes:
    """The request body as sent, decompressed (a body that does not decompress is a 400)."""
    try:
        async with timeout(BODY_READ_TIMEOUT_S):  # a truncated compressed body can leave the read waiting
            return await request.read()
    except asyncio.TimeoutError:
        raise InvalidRequestError(f"the request body did not arrive in full within {BODY_READ_TIMEOUT_S:g} s") from None
    except (RequestPayloadError, HttpProcessingError):
        raise InvalidRequestError(
            f"the request body could not be read as {request.headers.get('Content-Encoding', 'sent')}") from None


async def read_json(request: web.Request) -> Any:
    """The body as JSON: UTF-8 whatever charset is declared (JSON's encoding), no unpaired
    surrogates, nesting and numbers that the parser takes without running out of stack."""
    raw = await _read_body(request)
    try:
        body = json.loads(raw.decode("utf-8"))
        json.dumps(body, ensure_ascii=False).encode("utf-8")  # unpaired surrogates (\ud800) cannot be text
    except UnicodeError:
        raise InvalidRequestError("the request body must be UTF-8 JSON text without unpaired surrogates") from None
    except RecursionError:
        raise InvalidRequestError("the request body nests too deeply") from None
    except ValueError as error:  # JSONDecodeError, or an integer of more digits than allowed
        raise InvalidRequestError(f"the request body is not valid JSON ({str(error)[:80]})") from None
    return body


def sampling_params(chat: ChatRequest, prompt_tokens: int, max_context: int, grammar: str | None = None, *,
                    default_max_tokens: int = 0) -> SamplingParams:
    """How ``chat`` samples: at most ``max_tokens``, else ``default_max_tokens`` (0: none),
    and never past the context."""
    room = max_context - prompt_tokens
    if room < 1:
        raise InvalidRequestError(
            f"the prompt has {prompt_tokens} tokens but the context holds {max_context}; shorten it",
            "messages" if chat.messages else "prompt", "context_length_exceeded")
    max_tokens = min(chat.max_tokens or default_max_tokens or room, room)
    try:
        return SamplingParams(max_tokens=max_tokens, grammar=grammar, **chat.sampling_fields())
    except ShardsError as error:
        raise InvalidRequestError(str(error)) from None


async def _completion(request: web.Request, *, chat: bool) -> web.StreamResponse:
    body = await read_json(request)
    if isinstance(body, dict):
        check_fields(body, OPENAI_CHAT if chat else OPENAI_COMPLETION,
                     internal=(RESUME_FIELD,) if from_member(request) else ())
    parsed = parse_request(body, chat=chat)
    autoload = _autoload(request)
    proxied = await pass_to_orchestrator(request)
    if proxied is not None:
        if proxied.status < 400:  # a name the orchestrator accepted: a bounded set, fit for a label
            request[REQUEST_MODEL] = parsed.model or ""
        return proxied
    router = request.app[ROUTER]
    arrived = time.perf_counter()
    name = request[REQUEST_MODEL] = router.resolve(parsed.model)
    async with router.use(name, client=client_of(request), autoload=autoload) as deployment:
        # Server-Timing: how long the router held the request (resolve, load or wake, admission).
        timing = {"Server-Timing": f"router;dur={1000 * (time.perf_counter() - arrived):.3f}"}
        return await _generate(request, parsed, deployment, chat=chat, headers=timing,
                               resume=_resume_tokens(request, body, deployment))


def _resume_tokens(request: web.Request, body: Any, deployment: Deployment) -> tuple[int, ...]:
    """The ids a lost orchestrator sampled for this request, when a member passes it on to go on
    after them (see :mod:`agent.http.proxy`); ignored from anyone else."""
    resume = body.get(RESUME_FIELD) if isinstance(body, dict) and from_member(request) else None
    if resume is None:
        return ()
    tokens = resume.get("tokens") if isinstance(resume, dict) else None
    vocab = deployment.tokenizer.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                               for t in tokens):
        raise InvalidRequestError(f"'{RESUME_FIELD}.tokens' must be a list of token ids", RESUME_FIELD)
    return tuple(tokens)


@dataclasses.dataclass(frozen=True)
class Generation:
    """A generation started: its events, and the reader of its text (reasoning, reply, calls)."""

    events: AsyncIterator[Completion]
    reader: AnswerReader


def _prompt(parsed: ChatRequest, deployment: Deployment, *, call_pieces: bool
            ) -> tuple[list[int], str | None, AnswerReader]:
    """The prompt's ids, the grammar of the answer and its reader (``call_pieces``: the calls'
    pieces are sent as they come; see
    :mod:`shards.runtime.tool_calls` and :mod:`shards.runtime.reasoning`)."""
    tokenizer = deployment.tokenizer
    if parsed.messages is None:
        assert parsed.prompt is not None
        if parsed.think or parsed.template_variables:
            field = parsed.think_field if parsed.think else "chat_template_kwargs"
            raise InvalidRequestError(f"'{field}' needs the chat template: send messages, without raw", field)
        return tokenizer.encode(parsed.prompt), _schema_grammar(parsed.json_schema), AnswerReader()
    tools = [{"name": t.name, "description": t.description, "parameters": t.parameters}
             for t in parsed.tools] if parsed.calls_tools else []
    template = tokenizer.spec.chat_template
    fmt = tool_format(template)
    support = reasoning_support(template)
    think, variables = _thinking(parsed, support, deployment.name)
    parallel = PARALLEL_BY_DEFAULT[fmt] if parsed.parallel_tool_calls is None else parsed.parallel_tool_calls
    messages, extra = prompt_messages(fmt, parsed.messages, tools, parallel=parallel)
    try:
        prompt_ids = tokenizer.encode_chat(messages, **variables, **extra)
    except ShardsError as error:
        raise InvalidRequestError(f"cannot apply the chat template: {error}", "messages") from None
    splitter = think_first = None
    if support is not None:
        inside = prompt_opens_thinking(tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:]))
        splitter = ReasoningSplitter(inside=inside)
        if think is not False or not support.switch:  # a constrained answer comes after the thinking
            think_first = ThinkFirst(opened=inside, tokens=tokenizer.added_token_texts)
    if not tools:
        grammar = _schema_grammar(parsed.json_schema, think_first)
    else:  # with a response_format, an answer that calls no tool follows its schema
        try:
            grammar = call_grammar(fmt, tools, parsed.tool_choice, parallel=parallel,
                                   tokens=tokenizer.added_token_texts, answer_schema=parsed.json_schema,
                                   think=think_first)
        except ShardsError as error:
            raise InvalidRequestError(f"the tools cannot be turned into a grammar: {error}",
                                      "tools" if parsed.json_schema is None else "response_format") from None
    return prompt_ids, grammar, AnswerReader(tool_format=fmt if tools else None, reasoning=splitter,
                                             show_reasoning=think is not False, stream_calls=grammar is not None,
                                             call_pieces=call_pieces)


PROMPT_TAIL_TOKENS = 8  # enough of a prompt's end to see whether its template opened a think block


def _thinking(parsed: ChatRequest, support: ReasoningSupport | None, model: str) -> tuple[bool | None, dict[str, Any]]:
    """Whether the answer thinks (None: as the template decides) and the template's variables
    that say so; a model that cannot think refuses to."""
    variables = dict(parsed.template_variables)
    think = parsed.think
    if support is None:
        if think:
            raise InvalidRequestError(f"\"{model}\" does not support thinking ('{parsed.think_field}' asks for it)",
                                      parsed.think_field)
        return think, variables
    if support.switch and think is not None:
        variables["enable_thinking"] = think
    if support.effort and parsed.reasoning_effort:
        variables["reasoning_effort"] = parsed.reasoning_effort
    return think, variables


def _schema_grammar(schema: dict[str, Any] | None, think: ThinkFirst | None = None) -> str | None:
    try:
        return None if schema is None else json_schema_grammar(schema, think)
    except ShardsError as error:
        raise InvalidRequestError(f"the JSON schema cannot be used: {error}", "response_format") from None


def start_generation(request: web.Request, parsed: ChatRequest, deployment: Deployment, *,
                     max_context: int | None = None, resume: tuple[int, ...] = (),
                     call_pieces: bool = False) -> Generation:
    """A generation of ``parsed`` (its messages through the chat template, with its tools,
    else its prompt as it is) on ``deployment``, timed and counted; ``max_context`` narrows
    the model's context; ``call_pieces``: the caller streams the calls' pieces (OpenAI)."""
    prompt_ids, grammar, reader = _prompt(parsed, deployment, call_pieces=call_pieces)
    params = sampling_params(parsed, len(prompt_ids), max_context or deployment.settings.max_context, grammar,
                             default_max_tokens=request.app[CONFIG].default_max_tokens)
    if resume:  # the reader reads on where the lost orchestrator's stopped (its text went out already)
        decoder = deployment.tokenizer.stream_decoder(skip_special_tokens=True)
        for token in resume:
            reader.push(decoder.push(token))
    events = request.app[METRICS].observe_generation(
        deployment.name, request.app[ORCHESTRATOR].complete(deployment, prompt_ids, params, resume,
                                                            cache_prompt=parsed.cache_prompt))
    return Generation(events, reader)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_entries(calls: list[ToolCall], *, arguments_as_text: bool) -> list[dict[str, Any]]:
    """Calls as the APIs answer them: OpenAI's (ids, arguments as JSON text) or Ollama's."""
    entries = []
    for call in calls:
        arguments: Any = json.dumps(call.arguments, ensure_ascii=False) if arguments_as_text else call.arguments
        entry: dict[str, Any] = {"function": {"name": call.name, "arguments": arguments}}
        if arguments_as_text:
            entry = {"id": _call_id(), "type": "function", **entry}
        entries.append(entry)
    return entries


def call_delta_entries(deltas: tuple[CallDelta, ...]) -> list[dict[str, Any]]:
    """Pieces of calls as OpenAI streams them: a call's first piece has its id, type and
    name; the next ones, more of its arguments' text."""
    entries: list[dict[str, Any]] = []
    for delta in deltas:
        if delta.name is None:
            entries.append({"index": delta.index, "function": {"arguments": delta.arguments}})
        else:
            entries.append({"index": delta.index, "id": _call_id(), "type": "function",
                            "function": {"name": delta.name, "arguments": delta.arguments}})
    return entries


def chat_logprobs(tokenizer: Tokenizer, entries: tuple[TokenLogprobs, ...]) -> dict[str, Any]:
    """OpenAI's ``choices[].logprobs`` of a chat answer: one entry per token."""
    def token(token_id: int, logprob: float) -> dict[str, Any]:
        piece = tokenizer.token_bytes(token_id)
        return {"token": piece.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(piece)}

    return {"content": [{**token(e.token, e.logprob), "top_logprobs": [token(i, lp) for i, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(tokenizer: Tokenizer, entries: tuple[TokenLogprobs, ...], offset: int) -> dict[str, Any]:
    """The legacy completions' ``choices[].logprobs``; ``offset``: where the text starts."""
    texts = [tokenizer.token_bytes(e.token).decode("utf-8", errors="replace") for e in entries]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": [e.logprob for e in entries], "text_offset": offsets,
            "top_logprobs": [{tokenizer.token_bytes(i).decode("utf-8", errors="replace"): lp for i, lp in e.top}
                             for e in entries]}


async def _generate(request: web.Request, parsed: ChatRequest, deployment: Deployment, *, chat: bool,
                    headers: dict[str, str], resume: tuple[int, ...] = ()) -> web.StreamResponse:
    generation = start_generation(request, parsed, deployment, resume=resume, call_pieces=parsed.stream)
    events, reader = generation.events, generation.reader
    created = int(time.time())
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    with_tokens = bool(request.headers.get(RESUMABLE_HEADER)) and from_member(request)

    def usage_of(last: Completion) -> dict[str, Any]:
        return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                "total_tokens": last.prompt_tokens + last.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": last.cached_tokens}}

    tokenizer = deployment.tokenizer
    if not parsed.stream:
        pieces, last, logprobs = [], Completion("", deployment.name), []
        async for event in events:
            pieces.append(reader.push(event.text))
            logprobs += event.logprobs
            last = event
        answer = AnswerPiece.joined([*pieces, reader.finish()])
        text_out, calls = answer.content, list(answer.calls)
        finish = "tool_calls" if calls else last.finish_reason
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if parsed.logprobs is not None:
            choice["logprobs"] = (chat_logprobs(tokenizer, tuple(logprobs)) if chat
                                  else completion_logprobs(tokenizer, tuple(logprobs), 0))
        if chat:
            choice["message"] = {"role": "assistant", "content": text_out or (None if calls else "")}
            if answer.reasoning:
                choice["message"]["reasoning_content"] = answer.reasoning
            if calls:
                choice["message"]["tool_calls"] = tool_call_entries(calls, arguments_as_text=True)
        else:
            choice["text"] = text_out
        return web.json_response({"id": ident, "object": "chat.completion" if chat else "text_completion",
                                  "created": created, "model": last.model, "choices": [choice],
                                  "usage": usage_of(last)}, headers=headers)

    # Streaming: the first step runs before the headers go out, so early failures are still 4xx/5xx.
    first = await anext(events)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
    await response.prepare(request)
    kind = "chat.completion.chunk" if chat else "text_completion"

    sent_chars = 0  # of the text, for the legacy completions' text offsets

    async def send(model: str, piece: AnswerPiece, finish: str | None, *, role: bool = False,
                   tokens: tuple[int, ...] = (), logprobs: tuple[TokenLogprobs, ...] = ()) -> None:
        nonlocal sent_chars
        text = piece.content
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if piece.reasoning:
                delta["reasoning_content"] = piece.reasoning
            if text:
                delta["content"] = text
            if piece.deltas:
                delta["tool_calls"] = call_delta_entries(piece.deltas)
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            if logprobs:
                choice["logprobs"] = chat_logprobs(tokenizer, logprobs)
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            if logprobs:
                choice["logprobs"] = completion_logprobs(tokenizer, logprobs, sent_chars)
            sent_chars += len(text or "")
        chunk = {"id": ident, "object": kind, "created": created, "model": model, "choices": [choice]}
        if with_tokens:
            chunk[TOKENS_FIELD] = list(tokens)
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

    try:
        if chat:
            await send(first.model, AnswerPiece(), None, role=True)
        last = first
        async for event in chain_events(first, events):
            last = event
            piece = reader.push(event.text)
            if event.finish_reason is None:
                await send(event.model, piece, None, tokens=event.tokens, logprobs=event.logprobs)
                continue
            piece = AnswerPiece.joined([piece, reader.finish()])
            if piece.calls:  # its last pieces, then the finish on its own, as OpenAI ends a call
                await send(event.model, piece, None, tokens=event.tokens, logprobs=event.logprobs)
                await send(event.model, AnswerPiece(), "tool_calls")
            else:
                await send(event.model, piece, event.finish_reason, tokens=event.tokens, logprobs=event.logprobs)
        if parsed.include_usage:
            chunk = {"id": ident, "object": kind, "created": created, "model": last.model, "choices": [],
                     "usage": usage_of(last)}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
    except (StageError, ClusterError) as error:
        # Headers are gone: report the failure inside the stream, in the OpenAI error shape.
        payload = {"error": {"message": without_addresses(str(error)), "type": "service_unavailable",
                             "param": None, "code": getattr(error, "code", "cluster_unavailable")}}
        await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
    except Exception as error:  # noqa: BLE001 - a bug ends the stream with an error event, never silently
        log.exception("completion %s failed", ident)
        payload = {"error": {"message": public_reason(error), "type": "server_error", "param": None,
                             "code": "internal_error"}}
        await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
    finally:
        await events.aclose()
    await response.write_eof()
    return response


async def chain_events(first: Completion, rest: AsyncIterator[Completion]) -> AsyncIterator[Completion]:
    """``first`` and, unless it ended the generation, the events after it."""
    yield first
    if first.finish_reason is None:
        async for event in rest:
            yield event


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=True)


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=False)
