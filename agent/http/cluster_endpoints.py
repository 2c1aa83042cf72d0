"""The cluster views and membership endpoints of the public port: health, the OpenAPI document,
nodes, status, events and plan, joining, invites and pairing, and removing a device. Any agent
answers; what needs the orchestrator is passed to it."""

from __future__ import annotations

import logging
import time
from typing import Any

from aiohttp import web

from agent.cluster.pairing import join_by_invite, rotate_key, seal
from agent.core.capacity import score
from agent.core.errors import (
    ClusterError,
    InvalidRequestError,
    InviteError,
    WireError,
)
from agent.core.invites import DEFAULT_INVITE_TTL_S, JoinString, fingerprint
from agent.core.protocol import PAIR_PATH, PairAnswer, PairRequest
from agent.http.app_keys import (
    CLIENT,
    CONFIG,
    EVENTS,
    INVITES,
    LIFECYCLE,
    MEMBERSHIP,
    METRICS,
    NODE_ID,
    ORCHESTRATOR,
    PAIR_LIMIT,
    REFUSED_INVITES,
    WORKER,
)
from agent.http.bodies import read_json
from agent.http.errors_shape import answer_error, error_response
from agent.http.event_stream import event_stream
from agent.http.openapi import openapi_document
from agent.http.proxy import on_orchestrator
from agent.local.metrics import THROUGHPUT_WINDOW_S

log = logging.getLogger(__name__)

routes = web.RouteTableDef()


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
    reports = membership.peer_reports()
    for url, entry in sorted(membership.table.entries.items()):
        advert = entry.advert
        nodes.append({
            "id": advert.node_id if advert else None, "url": url, "alive": entry.alive, "self": False,
            "source": entry.source, "role": advert.role if advert else None,
            "score": float(score(advert.capacity)) if advert else None,
            "capacity": advert.capacity.to_dict() if advert else None, "latency_ms": entry.latency_ms,
            "failures": entry.failures,
            **{key: reports[advert.node_id].raw.get(key) if advert and advert.node_id in reports else None
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


@routes.post(PAIR_PATH)
async def pair(request: web.Request) -> web.Response:
    """A new device redeems an invite: the cluster key, sealed with the invite's secret."""
    retry_after_s = request.app[PAIR_LIMIT].allow(request.remote or "", now=time.monotonic())
    if retry_after_s is not None:
        request.app[REFUSED_INVITES].warn(request.remote or "?", "too many attempts: refused without looking")
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
        request.app[REFUSED_INVITES].warn(request.remote or "?", str(error))
        return answer_error(error)
    log.info("invite %s redeemed by %s", pairing.invite, request.remote)
    iv, sealed_key = seal(invite.secret, pairing.nonce, pairing.invite, request.app[CLIENT].key)
    return web.json_response(PairAnswer(request.app[CONFIG].cluster_name, tuple(request.app[MEMBERSHIP].live_peer_urls()),
                                        iv, sealed_key).to_json())


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
        return await event_stream(request, events, lambda event: ("cluster", event.to_json()))


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
