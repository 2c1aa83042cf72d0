"""agent.http.proxy: requests this agent passes on to the orchestrator, against real aiohttp
servers on 127.0.0.1 standing for the orchestrators (TLS with certificates of the cluster's CA,
as on the peer port) and this agent's real Membership, whose peer table knows them. The
orchestrators' "deaths" are what membership sees: a node marked unreachable, and the
election that follows.

Checked: a request is passed on whole (the client named in X-Ncm-Client, hop headers
dropped) and its answer streamed back; an orchestrator that cannot be reached (or is no
member) is an error to retry; a completion streamed through here survives its orchestrator:
cut mid-way (the stream ends, the connection drops, or it freezes while another is elected),
it goes on at the next one after the tokens already sent, as one stream (same id and
created, one role event, no token ids); the orchestrator's own error event, a refused resume
and a new orchestrator not serving yet are handled; and without a successor, or after
MAX_RESUMES, the stream ends with an error event."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gzip
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent import __version__
from agent.cluster.membership import Membership
from agent.cluster.peer_client import PeerClient
from agent.cluster.tls import issue_node_files
from agent.core.advert import NodeAdvert
from agent.core.auth import admin_token
from agent.core.capacity import NodeCapacity
from agent.core.election import Election
from agent.core.errors import ClusterError
from agent.http import proxy
from agent.http.app_keys import ADMIN_TOKEN, CONFIG
from agent.http.clients import CLIENT_HEADER
from agent.http.proxy import MAX_RESUMES, RESUMABLE_HEADER, RESUME_FIELD, TOKENS_FIELD, ask_orchestrator
from agent.local.config import AgentConfig
from agent.local.events import EventLog
from tests.agent.agents import CLUSTER_KEY, free_ports, member_tls
from tests.deadlines import Deadline

SELF, A, B = "node-self", "node-a", "node-b"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 8}
WAIT = aiohttp.ClientTimeout(total=30)

Behaviour = Callable[[web.Request, "Upstream"], Awaitable[web.StreamResponse]]


@dataclass
class Seen:
    """A request as an orchestrator received it."""

    method: str
    path_qs: str
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Upstream:
    """An orchestrator: a TLS server on 127.0.0.1 that answers with ``behaviour``."""

    node_id: str
    behaviour: Behaviour
    api_url: str  # the key of its peer-table entry (never contacted: its peer port is what matters)
    seen: list[Seen] = field(default_factory=list)
    advert: NodeAdvert | None = None
    cluster: Cluster | None = None  # the cluster it is in, whose membership sees it die

    def dies(self) -> None:
        """Membership finds this node unreachable (and elects another, when there is one)."""
        assert self.cluster is not None
        self.cluster.membership.mark_unreachable(self.node_id)


class Cluster:
    """This agent (its Membership and PeerClient, a front app that passes every request on) and
    the orchestrators it knows."""

    def __init__(self, membership: Membership, client: PeerClient, front_url: str, upstreams: dict[str, Upstream],
                 release: asyncio.Event) -> None:
        self.membership, self.client, self.front_url = membership, client, front_url
        self.upstreams, self.release = upstreams, release

    def comes_back(self, node_id: str) -> None:
        """Membership reaches ``node_id`` again."""
        upstream = self.upstreams[node_id]
        assert upstream.advert is not None
        self.membership.table.contact_succeeded(upstream.api_url, upstream.advert, 1.0, time.monotonic())

    @property
    def orchestrator(self) -> str | None:
        election = self.membership.election
        return election.orchestrator if election is not None else None


@contextlib.asynccontextmanager
async def cluster(tmp_path: Path, behaviours: dict[str, Behaviour], *,
                  stranger: frozenset[str] = frozenset()) -> AsyncIterator[Cluster]:
    """Orchestrators ``behaviours`` (node id -> how it answers), all alive and configured to be
    orchestrators, A the one elected; those in ``stranger`` have a certificate of another
    cluster's CA."""
    release = asyncio.Event()  # lets handlers that hang go at the end
    upstreams: dict[str, Upstream] = {}
    runners: list[web.AppRunner] = []
    session = aiohttp.ClientSession()
    try:
        client = PeerClient(session, CLUSTER_KEY.encode(), SELF, member_tls(tmp_path / "self-tls"))
        config = AgentConfig(cluster_name="test", cluster_key=CLUSTER_KEY, host="127.0.0.1", mdns=False,
                             failure_threshold=1, state_dir=tmp_path / "state")
        membership = Membership(config, SELF, client, api_port=free_ports(1)[0], peer_port=free_ports(1)[0],
                                events=EventLog())
        for index, (node_id, behaviour) in enumerate(behaviours.items()):
            upstream = Upstream(node_id, behaviour, f"http://127.0.0.1:{1001 + index}")
            upstreams[node_id] = upstream

            async def answer(request: web.Request, upstream: Upstream = upstream) -> web.StreamResponse:
                upstream.seen.append(Seen(request.method, request.rel_url.path_qs, dict(request.headers),
                                          await request.read()))
                return await upstream.behaviour(request, upstream)

            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", answer)
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
            await runner.setup()
            runners.append(runner)
            key = b"another-cluster-key-987654321" if node_id in stranger else CLUSTER_KEY.encode()
            tls = issue_node_files(key, node_id, tmp_path / f"{node_id}-tls").server_context()
            await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls).start()
            peer_port = runner.addresses[0][1]
            upstream.advert = NodeAdvert(node_id=node_id, cluster="test", api_port=1001 + index, version=__version__,
                                         role="orchestrator" if node_id == A else "worker",
                                         capacity=NodeCapacity(node_id, ram_gib=8.0), configured_orchestrator=True,
                                         peer_port=peer_port)
            membership.table.discovered(upstream.api_url, "static", time.monotonic())
            assert membership.table.contact_succeeded(upstream.api_url, upstream.advert, 1.0, time.monotonic())
        membership.election = Election(A, 1)

        async def front(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            try:
                return await ask_orchestrator(request, membership, client, body)
            except ClusterError as error:
                return web.json_response({"error": str(error)}, status=503)

        app = web.Application()
        app[CONFIG], app[ADMIN_TOKEN] = config, admin_token(CLUSTER_KEY.encode())
        app.router.add_route("*", "/{tail:.*}", front)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        this = Cluster(membership, client, f"http://127.0.0.1:{runner.addresses[0][1]}", upstreams, release)
        for upstream in upstreams.values():
            upstream.cluster = this
        yield this
    finally:
        release.set()
        for runner in reversed(runners):
            await runner.cleanup()
        await session.close()


# --- what the orchestrators answer ------------------------------------------------------------
def role(stream_id: str, created: int) -> dict[str, Any]:
    return {"id": stream_id, "object": "chat.completion.chunk", "created": created, "model": "m",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            TOKENS_FIELD: []}


def piece(stream_id: str, created: int, text: str, tokens: list[int], finish: str | None = None) -> dict[str, Any]:
    return {"id": stream_id, "object": "chat.completion.chunk", "created": created, "model": "m",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}], TOKENS_FIELD: tokens}


async def events(request: web.Request, chunks: list[dict[str, Any]]) -> web.StreamResponse:
    """An event stream of ``chunks``, left open for the caller to end."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Orchestrator": "yes"})
    await response.prepare(request)
    for chunk in chunks:
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    return response


async def done(response: web.StreamResponse) -> web.StreamResponse:
    await response.write(b"data: [DONE]\n\n")
    return response


def drop(request: web.Request, response: web.StreamResponse | None = None) -> web.StreamResponse:
    """The connection goes away at once (a crash, a cable pulled): what the handler returns
    then (``response`` when it had started one) goes nowhere."""
    assert request.transport is not None
    request.transport.abort()
    return response if response is not None else web.Response()


def stream_then(chunks: list[dict[str, Any]], end: str, *, dies: bool = False) -> Behaviour:
    """Send ``chunks``, then end: ``done``, ``end`` (the stream ends early), ``drop`` or
    ``hang`` (until the test ends); with ``dies``: membership finds this node unreachable
    before the end."""
    async def behaviour(request: web.Request, upstream: Upstream) -> web.StreamResponse:
        response = await events(request, chunks)
        if dies:
            upstream.dies()
        if end == "done":
            return await done(response)
        if end == "drop":
            return drop(request, response)
        if end == "hang":
            assert upstream.cluster is not None
            await upstream.cluster.release.wait()
        return response

    return behaviour


# --- the client's side ---------------------------------------------------------------------------
@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    data: list[Any]  # the payloads of the data: lines ("[DONE]" as the string), or the body's JSON

    @property
    def text(self) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in self.data if isinstance(c, dict)
                       and "choices" in c)


async def ask(front_url: str, body: Any = CHAT, path: str = "/v1/chat/completions") -> Answer:
    async with aiohttp.ClientSession() as session, session.post(front_url + path, json=body,
                                                                timeout=WAIT) as response:
        if response.content_type != "text/event-stream":
            return Answer(response.status, dict(response.headers), [await response.json(content_type=None)])
        data = []
        async for line in response.content:
            if line.startswith(b"data: "):
                payload = line[len(b"data: "):].strip()
                data.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
        return Answer(response.status, dict(response.headers), data)


def without_tokens(chunk: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in chunk.items() if k != TOKENS_FIELD}


# --- requests that are not completions ------------------------------------------------------------
def test_a_request_is_passed_on_whole_with_the_client_named_and_its_answer_streamed_back(tmp_path: Path) -> None:
    async def answer(request: web.Request, _upstream: Upstream) -> web.StreamResponse:
        response = web.StreamResponse(status=201, headers={"Content-Type": "application/json", "X-Upstream": "yes"})
        await response.prepare(request)
        for part in (b'{"data": [', b'{"embedding": [0.5, 0.25]}', b"]}"):
            await response.write(part)
        return response

    async def scenario() -> None:
        async with cluster(tmp_path, {A: answer}) as c:
            body = json.dumps({"model": "e", "input": "hello"}).encode()
            async with aiohttp.ClientSession() as session, session.post(
                    c.front_url + "/v1/embeddings?dimensions=2", data=body, timeout=WAIT,
                    headers={"Content-Type": "application/json", "X-Trace": "t-1", CLIENT_HEADER: "address:10.9.9.9",
                             "Authorization": "Bearer some-key"}) as response:
                assert response.status == 201 and response.headers["X-Upstream"] == "yes"
                assert await response.json() == {"data": [{"embedding": [0.5, 0.25]}]}
            [seen] = c.upstreams[A].seen
            assert (seen.method, seen.path_qs, seen.body) == ("POST", "/v1/embeddings?dimensions=2", body)
            assert seen.headers["X-Trace"] == "t-1" and seen.headers["Authorization"] == "Bearer some-key"
            assert seen.headers[CLIENT_HEADER] == "address:127.0.0.1"  # what this agent saw, not what it was told
            assert seen.headers["Host"] == f"127.0.0.1:{c.upstreams[A].advert.peer_port}"  # the orchestrator's
            assert RESUMABLE_HEADER not in seen.headers

    asyncio.run(scenario())


def test_a_request_without_a_body_goes_without_one(tmp_path: Path) -> None:
    async def answer(_request: web.Request, _upstream: Upstream) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def scenario() -> None:
        async with cluster(tmp_path, {A: answer}) as c:
            async with aiohttp.ClientSession() as session, session.get(c.front_url + "/v1/models",
                                                                       timeout=WAIT) as response:
                assert response.status == 200
                assert await response.json() == {"object": "list", "data": [{"id": "m"}]}
            [seen] = c.upstreams[A].seen
            assert (seen.method, seen.path_qs, seen.body) == ("GET", "/v1/models", b"")
            assert "Transfer-Encoding" not in seen.headers and seen.headers.get("Content-Length", "0") == "0"

    asyncio.run(scenario())


def test_a_compressed_answer_reaches_the_client_decompressed_without_its_encoding(tmp_path: Path) -> None:
    plain = json.dumps({"object": "list", "data": ["x" * 2000]}).encode()

    async def answer(_request: web.Request, _upstream: Upstream) -> web.StreamResponse:
        return web.Response(body=gzip.compress(plain), headers={"Content-Encoding": "gzip",
                                                                "Content-Type": "application/json"})

    async def scenario() -> None:
        async with cluster(tmp_path, {A: answer}) as c:
            async with aiohttp.ClientSession(auto_decompress=False) as session, session.get(
                    c.front_url + "/v1/models", timeout=WAIT) as response:
                assert response.status == 200 and "Content-Encoding" not in response.headers
                assert await response.read() == plain

    asyncio.run(scenario())


def test_an_orchestrator_that_cannot_be_reached_is_an_error_to_retry(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, {A: stream_then([], "done")}) as c:
            upstream = c.upstreams[A]  # now known at a port where nothing listens
            moved = dataclasses.replace(upstream.advert, peer_port=free_ports(1)[0])
            c.membership.table.contact_succeeded(upstream.api_url, moved, 1.0, time.monotonic())
            answer = await ask(c.front_url, path="/v1/models")
            assert answer.status == 503
            assert answer.data[0]["error"] == ("the orchestrator stopped answering (ClientConnectorError); "
                                               "retry the request")

    asyncio.run(scenario())


def test_an_orchestrator_this_node_has_no_address_of_is_an_error(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, {A: stream_then([], "done")}) as c:
            c.membership.election = Election("node-far-away", 3)
            for path in ("/v1/models", "/v1/chat/completions"):
                answer = await ask(c.front_url, path=path)
                assert answer.status == 503
                assert answer.data[0]["error"] == "the orchestrator node-far-away is not reachable from this node"
            assert c.upstreams[A].seen == []

    asyncio.run(scenario())


def test_a_server_without_a_certificate_of_the_cluster_gets_no_request(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, {A: stream_then([], "done")}, stranger={A}) as c:
            answer = await ask(c.front_url, path="/v1/models")
            assert answer.status == 503 and "stopped answering (ClientConnectorCertificateError)" in \
                answer.data[0]["error"]
            assert c.upstreams[A].seen == []

    asyncio.run(scenario())


def test_an_answer_cut_mid_body_reaches_the_client_as_cut(tmp_path: Path) -> None:
    """The orchestrator sends half of a JSON answer and its connection drops: the client gets
    the half that came, and can tell that the answer is not whole (its status was already sent)."""
    async def answer(request: web.Request, _upstream: Upstream) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"object": "list", "da')
        return drop(request, response)

    async def scenario() -> None:
        async with cluster(tmp_path, {A: answer}) as c:
            async with aiohttp.ClientSession() as session, session.get(c.front_url + "/v1/models",
                                                                       timeout=WAIT) as response:
                assert response.status == 200
                received = b""
                with pytest.raises(aiohttp.ClientPayloadError):
                    async for part in response.content.iter_any():
                        received += part
            assert received == b'{"object": "list", "da'

    asyncio.run(scenario())


# --- completions, streamed ------------------------------------------------------------------------
def test_a_completion_stream_reaches_the_client_without_the_token_ids(tmp_path: Path) -> None:
    chunks = [role("chatcmpl-a", 100), piece("chatcmpl-a", 100, "Hel", [1, 2]), piece("chatcmpl-a", 100, "lo", [3]),
              piece("chatcmpl-a", 100, "", [], "stop")]

    async def scenario() -> None:
        async with cluster(tmp_path, {A: stream_then(chunks, "done"), B: stream_then([], "done")}) as c:
            answer = await ask(c.front_url)
            assert answer.status == 200 and answer.headers["Content-Type"] == "text/event-stream"
            assert answer.headers["X-Orchestrator"] == "yes"
            assert answer.data == [*map(without_tokens, chunks), "[DONE]"]
            [seen] = c.upstreams[A].seen
            assert seen.json == CHAT and RESUME_FIELD not in seen.json
            assert seen.headers[RESUMABLE_HEADER] == "1" and seen.headers[CLIENT_HEADER] == "address:127.0.0.1"
            assert seen.headers["Content-Type"] == "application/json"
            assert c.upstreams[B].seen == []

    asyncio.run(scenario())


@pytest.mark.parametrize("status, body", [
    (200, {"id": "chatcmpl-a", "object": "chat.completion", "choices": [{"message": {"content": "hello"}}]}),
    (400, {"error": {"message": "max_tokens must be >= 1", "type": "invalid_request_error", "param": "max_tokens",
                     "code": "invalid_value"}}),
    (503, {"error": {"message": "the model is loading", "type": "service_unavailable", "param": None,
                     "code": "model_loading"}}),
])
def test_an_answer_that_is_not_a_stream_is_passed_back_as_it_is(tmp_path: Path, status: int, body: dict) -> None:
    async def answer(_request: web.Request, _upstream: Upstream) -> web.StreamResponse:
        return web.json_response(body, status=status, headers={"X-Upstream": "yes"})

    async def scenario() -> None:
        async with cluster(tmp_path, {A: answer, B: stream_then([], "done")}) as c:
            got = await ask(c.front_url)
            assert (got.status, got.data, got.headers["X-Upstream"]) == (status, [body], "yes")
            assert len(c.upstreams[A].seen) == 1 and c.upstreams[B].seen == []

    asyncio.run(scenario())


@pytest.mark.parametrize("end", ["end", "drop"])
def test_a_stream_cut_mid_way_goes_on_at_the_next_orchestrator_as_one_stream(tmp_path: Path, end: str) -> None:
    first = [role("chatcmpl-a", 100), piece("chatcmpl-a", 100, "Hel", [1, 2]), piece("chatcmpl-a", 100, "lo", [3])]
    then = [role("chatcmpl-b", 200), piece("chatcmpl-b", 200, " wor", [4]), piece("chatcmpl-b", 200, "ld", [5, 6]),
            piece("chatcmpl-b", 200, "", [], "stop")]

    async def scenario() -> None:
        async with cluster(tmp_path, {A: stream_then(first, end, dies=True), B: stream_then(then, "done")}) as c:
            answer = await ask(c.front_url)
            assert answer.status == 200
            assert answer.text == "Hello world" and answer.data[-1] == "[DONE]"
            chunks = answer.data[:-1]
            assert all(TOKENS_FIELD not in chunk for chunk in chunks)
            assert {(chunk["id"], chunk["created"]) for chunk in chunks} == {("chatcmpl-a", 100)}
            assert sum(1 for chunk in chunks if chunk["choices"][0]["delta"].get("role")) == 1
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
            [resumed] = c.upstreams[B].seen
            assert resumed.json == {**CHAT, RESUME_FIELD: {"tokens": [1, 2, 3]}}
            assert resumed.headers[RESUMABLE_HEADER] == "1"
            assert c.orchestrator == B

    asyncio.run(scenario())


def test_a_frozen_orchestrator_is_left_as_soon_as_another_is_elected(tmp_path: Path) -> None:
    """It keeps its connection open and says nothing: the stream checks the election every
    WATCH_S and goes on at the new orchestrator."""
    first = [role("chatcmpl-a", 100), piece("chatcmpl-a", 100, "Hel", [1])]
    then = [role("chatcmpl-b", 200), piece("chatcmpl-b", 200, "lo", [2], "stop")]

    async def scenario() -> None:
        async with cluster(tmp_path, {A: stream_then(first, "hang", dies=True), B: stream_then(then, "done")}) as c:
            deadline = Deadline(10 * proxy.WATCH_S)  # a few of the stream's checks, not RESUME_WAIT_S
            answer = await ask(c.front_url)
            assert not deadline.expired(), f"the stream took {deadline.describe()}"
            assert answer.text == "Hello" and answer.data[-1] == "[DONE]"
            assert c.upstreams[B].seen[0].json[RESUME_FIELD] == {"tokens": [1]}

    asyncio.run(scenario())


def test_a_quiet_orchestrator_that_is_still_elected_is_waited_for(tmp_path: Path) -> None:
    """Silence alone (a long prefill) is no loss: the stream goes on when the orchestrator speaks."""
    async def slow(request: web.Request, _upstream: Upstream) -> web.StreamResponse:
        response = await events(request, [role("chatcmpl-a", 100)])
        await asyncio.sleep(2.5 * proxy.WATCH_S)  # the orchestrator is quiet through two of the stream's checks
        await response.write(b"data: " + json.dumps(piece("chatcmpl-a", 100, "late", [7], "stop")).encode() + b"\n\n")
        return await done(response)

    async def scenario() -> None:
        async with cluster(tmp_path, {A: slow, B: stream_then([], "done")}) as c:
            answer = await ask(c.front_url)
            assert answer.text == "late" and answer.data[-1] == "[DONE]"
            assert c.upstreams[B].seen == []

    asyncio.run(scenario())


def test_an_orchestrator_lost_before_answering_is_asked_again_at_the_next_one(tmp_path: Path) -> None:
    then = [role("chatcmpl-b", 200), piece("chatcmpl-b", 200, "hi", [9], "stop")]

    async def crashes(request: web.Request, upstream: Upstream) -> web.StreamResponse:
        upstream.dies()
        return drop(request)

    async def scenario() -> None:
        async with cluster(tmp_path, {A: crashes, B: stream_then(then, "done")}) as c:
            answer = await ask(c.front_url)
            assert answer.status == 200
            assert answer.data == [*map(without_tokens, then), "[DONE]"]  # B's stream as it is: B's id, its role
            [asked_again] = c.upstreams[B].seen
            assert asked_again.json == CHAT  # nothing to resume after

    asyncio.run(scenario())


def test_the_orchestrators_error_event_ends_the_stream_without_a_resume(tmp_path: Path) -> None:
    error = {"error": {"message": "internal error", "type": "server_error", "param": None, "code": "internal_error"}}

    async def scenario() -> None:
        chunks = [role("chatcmpl-a", 100), piece("chatcmpl-a", 100, "Hel", [1]), error]
        async with cluster(tmp_path, {A: stream_then(chunks, "end"), B: stream_then([], "done")}) as c:
            answer = await ask(c.front_url)
            assert answer.status == 200
            assert answer.data == [without_tokens(chunks[0]), without_tokens(chunks[1]), error]  # no [DONE]
            assert c.upstreams[B].seen == [] and len(c.upstreams[A].seen) == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("status, body, expected", [
    (400, json.dumps({"error": {"message": "the resume does not match", "type": "invalid_request_error",
                                "param": None, "code": "bad_resume"}}).encode(),
     {"error": {"message": "the resume does not match", "type": "invalid_request_error", "param": None,
                "code": "bad_resume"}}),
    (500, b"<html>boom</html>",
     {"error": {"message": "the new orchestrator could not go on with the request (HTTP 500)",
                "type": "service_unavailable", "param": None, "code": "orchestrator_lost"}}),
    (400, b'{"error": "a string, not an object"}',
     {"error": {"message": "the new orchestrator could not go on with the request (HTTP 400)",
                "type": "service_unavailable", "param": None, "code": "orchestrator_lost"}}),
])
def test_a_refused_resume_ends_the_stream_with_an_error_event(tmp_path: Path, status: int, body: bytes,
                                                             expected: dict) -> None:
    async def refuses(_request: web.Request, _upstream: Upstream) -> web.StreamResponse:
        return web.Response(status=status, body=body, content_type="application/json")

    async def scenario() -> None:
        first = stream_then([role("chatcmpl-a", 100), piece("chatcmpl-a", 100, "Hel", [1])], "end", dies=True)
        async with cluster(tmp_path, {A: first, B: refuses}) as c:
            answer = await ask(c.front_url)
            assert answer.status == 200
            assert answer.text == "Hel" and answer.data[-1] == expected
            assert len(c.upstreams[B].seen) == 1

    asyncio.run(scenario())


def test_a_new_orchestrator_not_serving_yet_is_asked_again_until_it_is(tmp_path: Path) -> None:
    then = [role("chatcmpl-b", 200), piece("chatcmpl-b", 200, "lo", [2], "stop")]
    answered = stream_then(then, "done")

    async def taking_over(request: web.Request, upstream: Upstream) -> web.StreamResponse:
        if len(upstream.seen) <= 2:
            return web.json_response({"error": {"message": "the deployments are moving", "type": "service_unavailable",
                                                "param": None, "code": "not_ready"}}, status=503)
        return await answered(request, upstream)

    async def scenario() -> None:
        first = stream_then([role("chatcmpl-a", 100), piece("chatcmpl-a", 100, "Hel", [1])], "end", dies=True)
        async with cluster(tmp_path, {A: first, B: taking_over}) as c:
            answer = await ask(c.front_url)
            assert answer.text == "Hello" and answer.data[-1] == "[DONE]"
            assert [s.json[RESUME_FIELD] for s in c.upstreams[B].seen] == [{"tokens": [1]}] * 3

    asyncio.run(scenario())


def test_without_a_successor_the_stream_ends_with_an_error_event(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy, "RESUME_WAIT_S", 0.5)  # how long to wait for an election: shortened for the test

    async def scenario() -> None:
        chunks = [role("chatcmpl-a", 100), piece("chatcmpl-a", 100, "Hel", [1])]
        async with cluster(tmp_path, {A: stream_then(chunks, "end")}) as c:
            answer = await ask(c.front_url)
            assert answer.status == 200 and answer.text == "Hel"
            assert answer.data[-1] == {"error": {
                "message": "the orchestrator stopped answering (the event stream ended early) and no other took over; "
                           "retry the request",
                "type": "service_unavailable", "param": None, "code": "orchestrator_lost"}}
            assert len(c.upstreams[A].seen) == 1

    asyncio.run(scenario())


def test_without_a_successor_a_request_not_answered_yet_is_an_error_to_retry(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy, "RESUME_WAIT_S", 0.5)

    async def crashes(request: web.Request, _upstream: Upstream) -> web.StreamResponse:
        return drop(request)

    async def scenario() -> None:
        async with cluster(tmp_path, {A: crashes}) as c:
            answer = await ask(c.front_url)
            assert answer.status == 503
            assert answer.data[0]["error"].startswith("the orchestrator stopped answering (")
            assert answer.data[0]["error"].endswith(") and no other took over; retry the request")

    asyncio.run(scenario())


def test_a_stream_is_resumed_at_most_max_resumes_times(tmp_path: Path) -> None:
    """Orchestrators that keep failing (each sends a token, then dies and the other comes back
    and is elected): after MAX_RESUMES resumes the stream ends with an error event."""
    asked: list[tuple[str, Any]] = []  # (orchestrator, what it was asked to resume after), in order

    async def one_token_then_dies(request: web.Request, upstream: Upstream) -> web.StreamResponse:
        asked.append((upstream.node_id, upstream.seen[-1].json.get(RESUME_FIELD)))
        token = len(asked)
        response = await events(request, [piece(f"chatcmpl-{token}", token, f"t{token} ", [token])])
        assert upstream.cluster is not None
        upstream.cluster.comes_back(B if upstream.node_id == A else A)
        upstream.dies()
        return response

    async def scenario() -> None:
        async with cluster(tmp_path, {A: one_token_then_dies, B: one_token_then_dies}) as c:
            answer = await ask(c.front_url)
            assert answer.status == 200
            assert answer.text == "t1 t2 t3 t4 " and answer.data[-1]["error"]["code"] == "orchestrator_lost"
            assert {(chunk["id"], chunk["created"]) for chunk in answer.data[:-1]} == {("chatcmpl-1", 1)}

    asyncio.run(scenario())
    assert len(asked) == MAX_RESUMES + 1
    assert asked == [(A, None), (B, {"tokens": [1]}), (A, {"tokens": [1, 2]}), (B, {"tokens": [1, 2, 3]})]
