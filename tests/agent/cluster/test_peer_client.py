"""agent.cluster.peer_client: signed calls to a peer's internal endpoints over mutual TLS, and
what the client makes of the answers — against a small real aiohttp peer on loopback that
checks requests and signs answers with the cluster key as agents do (agent.core.auth)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from yarl import URL

from agent.cluster.peer_client import PeerAuthError, PeerClient, PeerError
from agent.cluster.tls import issue_node_files
from agent.core.auth import (
    ANY_NODE,
    HEADER_NODE,
    HEADER_NONCE,
    HEADER_TARGET,
    HEADER_TIMESTAMP,
    ReplayGuard,
    sign_answer,
    verify,
)
from agent.core.errors import AuthError, StaleRequestError
from agent.core.protocol import DESCRIBE_PATH
from tests.agent.inprocess import eventually

KEY = b"test-cluster-key-0123456789"
OTHER_KEY = b"another-cluster-key-9876543210"
PEER = "node-a"
TIMEOUT_S = 10.0
NONCE = web.RequestKey("answer_nonce", str)  # set on a request once it is checked: its answer is signed


class Peer:
    """A member's peer port: TLS with a certificate of the cluster's CA, every request checked
    (signature, time, target node), every answer to a member signed; ``unsigned`` paths answer
    without a signature, as a device without the key would."""

    def __init__(self, directory: Path, *, key: bytes = KEY, node_id: str = PEER) -> None:
        self.key, self.node_id = key, node_id
        self.tls = issue_node_files(key, node_id, directory)
        self.guard = ReplayGuard()
        self.release = asyncio.Event()
        self.socket_ends: list[aiohttp.WSMsgType] = []
        app = web.Application(middlewares=[self.check_request])
        app.on_response_prepare.append(self.sign)
        app.router.add_route("*", "/internal/echo{tail:.*}", self.echo)
        app.router.add_post(DESCRIBE_PATH, self.echo)
        app.router.add_get("/internal/empty", self.empty)
        app.router.add_get("/internal/busy", self.busy)
        app.router.add_get("/internal/text", self.text)
        app.router.add_get("/internal/slow", self.slow)
        app.router.add_get("/internal/unsigned", self.echo)
        app.router.add_get("/internal/stream", self.stream)
        self.app = app

    @web.middleware
    async def check_request(self, request: web.Request, handler: Any) -> web.StreamResponse:
        body = await request.read()
        try:
            verify(self.key, request.method, request.raw_path, body, request.headers, now=time.time(),
                   guard=self.guard, node_id=self.node_id, any_target=request.path == DESCRIBE_PATH)
        except AuthError as error:
            if isinstance(error, StaleRequestError):  # a member's request: the refusal is signed
                request[NONCE] = request.headers[HEADER_NONCE]
            return web.json_response({"error": {"message": str(error), "code": error.public_code}}, status=401)
        if not request.path.startswith("/internal/unsigned"):
            request[NONCE] = request.headers[HEADER_NONCE]
        return await handler(request)

    async def sign(self, request: web.Request, response: web.StreamResponse) -> None:
        if NONCE in request and not isinstance(response, web.WebSocketResponse):
            response.headers.update(sign_answer(self.key, responder=self.node_id, nonce=request[NONCE],
                                                status=response.status, body=response.body))

    async def echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({
            "method": request.method, "path": request.path, "query": list(request.query.items()),
            "content_type": request.headers.get("Content-Type"), "body": json.loads(body) if body else None,
            "sender": request.headers[HEADER_NODE], "target": request.headers[HEADER_TARGET],
        })

    async def empty(self, request: web.Request) -> web.Response:
        return web.Response(body=b"")

    async def text(self, request: web.Request) -> web.Response:
        return web.Response(text="not json")

    async def busy(self, request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "the model is loading", "code": "model_busy"}}, status=409)

    async def slow(self, request: web.Request) -> web.Response:
        await self.release.wait()
        return web.json_response({})

    async def stream(self, request: web.Request) -> web.WebSocketResponse:
        """The data plane's handshake: the first message proves the node holds the key (``proof``
        chooses a good one, a forged one, none or silence), then an echo of text messages."""
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        proof = request.query.get("proof", "good")
        if proof == "silent":
            await self.release.wait()
        elif proof == "close":
            await ws.close()
        else:
            hello = sign_answer(self.key, responder=self.node_id, nonce=request[NONCE], status=101, body=None)
            if proof == "forged":
                hello = {**hello, "X-Ncm-Signature": "0" * 64}
            await ws.send_str(json.dumps(hello if proof != "list" else list(hello)))
        async for message in ws:
            if message.type == aiohttp.WSMsgType.TEXT:
                await ws.send_str(message.data.upper())
        self.socket_ends.append(aiohttp.WSMsgType.CLOSE)
        return ws


@contextlib.asynccontextmanager
async def serving(peer: Peer) -> AsyncIterator[str]:
    """``peer`` on a loopback port over TLS; yields its base URL."""
    runner = web.AppRunner(peer.app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=peer.tls.server_context())
    await site.start()
    try:
        yield f"https://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        peer.release.set()
        await asyncio.wait_for(runner.cleanup(), TIMEOUT_S)


@contextlib.asynccontextmanager
async def member_client(directory: Path, *, key: bytes = KEY, clock: Any = time.time) -> AsyncIterator[PeerClient]:
    async with aiohttp.ClientSession() as session:
        yield PeerClient(session, key, "tester", issue_node_files(key, "tester", directory).client_context(),
                         clock=clock)


def test_a_signed_call_reaches_the_node_with_its_payload_and_names_who_answered(tmp_path: Path) -> None:
    async def scenario() -> None:
        peer = Peer(tmp_path / "peer")
        async with serving(peer) as base, member_client(tmp_path / "client") as client:
            answer, responder = await client.request_json_from("POST", base + "/", "/internal/echo", {"n": [1, 2]},
                                                               target=PEER, timeout_s=TIMEOUT_S)
            assert responder == PEER
            assert answer == {"method": "POST", "path": "/internal/echo", "query": [],
                              "content_type": "application/json", "body": {"n": [1, 2]},
                              "sender": "tester", "target": PEER}
            # No payload: no body and no JSON content type; request_json gives the answer alone.
            answer = await client.request_json("GET", base, "/internal/echo", target=PEER, timeout_s=TIMEOUT_S)
            assert answer["body"] is None and answer["content_type"] is None and answer["method"] == "GET"
            assert await client.request_json("GET", base, "/internal/empty", target=PEER, timeout_s=TIMEOUT_S) is None

    asyncio.run(scenario())


def test_a_first_contact_to_any_node_learns_which_node_answered(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with serving(Peer(tmp_path / "peer")) as base, member_client(tmp_path / "client") as client:
            answer, responder = await client.request_json_from("POST", base, DESCRIBE_PATH, {}, target=ANY_NODE,
                                                               timeout_s=TIMEOUT_S)
            assert responder == PEER and answer["target"] == ANY_NODE

    asyncio.run(scenario())


def test_the_signature_binds_the_clock_the_target_and_a_fresh_nonce() -> None:
    client = PeerClient(None, KEY, "tester", None, clock=lambda: 1234.5)  # type: ignore[arg-type]
    url, headers = client.signed_request("POST", "https://10.0.0.2:9000//", "/internal/x?a=1", b"{}", target=PEER)
    assert url == URL("https://10.0.0.2:9000/internal/x?a=1")
    assert headers[HEADER_TIMESTAMP] == "1234.500" and headers[HEADER_TARGET] == PEER
    assert headers[HEADER_NODE] == "tester"
    assert verify(KEY, "POST", "/internal/x?a=1", b"{}", headers, now=1240.0, guard=ReplayGuard(),
                  node_id=PEER) == "tester"
    with pytest.raises(StaleRequestError, match="addressed to node"):
        verify(KEY, "POST", "/internal/x?a=1", b"{}", headers, now=1240.0, guard=ReplayGuard(), node_id="node-b")
    with pytest.raises(StaleRequestError, match="off"):
        verify(KEY, "POST", "/internal/x?a=1", b"{}", headers, now=1234.5 + 60, guard=ReplayGuard(), node_id=PEER)
    _, again = client.signed_request("POST", "https://10.0.0.2:9000", "/internal/x?a=1", b"{}", target=PEER)
    assert again[HEADER_NONCE] != headers[HEADER_NONCE]


def test_an_answer_is_believed_only_when_signed_for_this_request_by_the_node_asked() -> None:
    client = PeerClient(None, KEY, "tester", None)  # type: ignore[arg-type]
    _, sent = client.signed_request("GET", "https://h:1", "/internal/state", target=PEER)
    body = b'{"ok": true}'
    signed = sign_answer(KEY, responder=PEER, nonce=sent[HEADER_NONCE], status=200, body=body)
    assert client.check_answer("u", sent, 200, signed, body, target=PEER) == PEER
    assert client.check_answer("u", sent, 200, signed, body, target=ANY_NODE) == PEER
    failures = {
        "unsigned": ({}, 200, body, PEER),
        "other key": (sign_answer(OTHER_KEY, responder=PEER, nonce=sent[HEADER_NONCE], status=200, body=body), 200,
                      body, PEER),
        "other request": (sign_answer(KEY, responder=PEER, nonce="0" * 24, status=200, body=body), 200, body, PEER),
        "other status": (signed, 500, body, PEER),
        "other body": (signed, 200, b'{"ok": false}', PEER),
    }
    for case, (headers, status, answered, target) in failures.items():
        with pytest.raises(PeerAuthError, match="cluster's key") as caught:
            client.check_answer("https://h:1/x", sent, status, headers, answered, target=target)
        assert caught.value.url == "https://h:1/x" and caught.value.status == status, case
    # Another member answered: it holds the key, but it is not the node that was asked.
    with pytest.raises(PeerError, match="node node-a answered where node node-b was expected") as caught:
        client.check_answer("u", sent, 200, signed, body, target="node-b")
    assert not isinstance(caught.value, PeerAuthError)


def test_an_error_answer_keeps_the_status_and_the_peers_json(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with serving(Peer(tmp_path / "peer")) as base, member_client(tmp_path / "client") as client:
            with pytest.raises(PeerError) as caught:
                await client.request_json("GET", base, "/internal/busy", target=PEER, timeout_s=TIMEOUT_S)
            error = caught.value
            assert not isinstance(error, PeerAuthError)
            assert error.status == 409 and error.url == base + "/internal/busy"
            assert error.peer_answer == {"error": {"message": "the model is loading", "code": "model_busy"}}
            assert str(error).startswith(f"{base}/internal/busy: HTTP 409: ") and "the model is loading" in str(error)
            # A path the peer does not know: its (signed) 404 has no JSON.
            with pytest.raises(PeerError, match="HTTP 404") as caught:
                await client.request_json("GET", base, "/internal/nothing", target=PEER, timeout_s=TIMEOUT_S)
            assert caught.value.status == 404 and caught.value.peer_answer is None

    asyncio.run(scenario())


def test_a_member_refusing_a_stale_request_is_an_error_not_an_impostor(tmp_path: Path) -> None:
    """A clock a minute behind: the peer refuses the request, signed (the caller is a member)."""
    async def scenario() -> None:
        async with serving(Peer(tmp_path / "peer")) as base, \
                member_client(tmp_path / "client", clock=lambda: time.time() - 60) as client:
            with pytest.raises(PeerError, match="HTTP 401") as caught:
                await client.request_json("GET", base, "/internal/echo", target=PEER, timeout_s=TIMEOUT_S)
            assert not isinstance(caught.value, PeerAuthError)
            assert caught.value.peer_answer["error"]["code"] == "stale_request"
            assert "off (clocks out of sync" in caught.value.peer_answer["error"]["message"]

    asyncio.run(scenario())


def test_a_request_meant_for_another_node_is_refused_by_the_node_that_got_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with serving(Peer(tmp_path / "peer")) as base, member_client(tmp_path / "client") as client:
            with pytest.raises(PeerError, match="node node-a answered where node node-b was expected") as caught:
                await client.request_json("GET", base, "/internal/echo", target="node-b", timeout_s=TIMEOUT_S)
            assert caught.value.status == 401 and not isinstance(caught.value, PeerAuthError)

    asyncio.run(scenario())


def test_answers_without_proof_of_the_key_are_not_believed(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with serving(Peer(tmp_path / "peer")) as base:
            # A peer that answers unsigned (HTTP 200, a plausible body).
            async with member_client(tmp_path / "client") as client:
                with pytest.raises(PeerAuthError, match=r"unsigned answer \(HTTP 200\)"):
                    await client.request_json("GET", base, "/internal/unsigned", target=PEER, timeout_s=TIMEOUT_S)
            # A client of another cluster: its TLS fails before any request is sent.
            async with member_client(tmp_path / "stranger", key=OTHER_KEY) as stranger:
                with pytest.raises(PeerAuthError, match="no TLS certificate of this cluster") as caught:
                    await stranger.request_json("GET", base, "/internal/echo", target=PEER, timeout_s=TIMEOUT_S)
                assert caught.value.url == base + "/internal/echo" and caught.value.status is None

    asyncio.run(scenario())


def test_a_peer_that_does_not_answer_in_time_or_in_json_is_an_error(tmp_path: Path) -> None:
    async def scenario() -> None:
        peer = Peer(tmp_path / "peer")
        async with serving(peer) as base, member_client(tmp_path / "client") as client:
            started = time.monotonic()
            with pytest.raises(PeerError, match=r"/internal/slow: no answer within 0.2 s$") as caught:
                await client.request_json("GET", base, "/internal/slow", target=PEER, timeout_s=0.2)
            assert time.monotonic() - started < TIMEOUT_S and caught.value.status is None
            with pytest.raises(PeerError, match="JSONDecodeError") as caught:
                await client.request_json("GET", base, "/internal/text", target=PEER, timeout_s=TIMEOUT_S)
            assert not isinstance(caught.value, PeerAuthError)

    asyncio.run(scenario())


def test_a_peer_that_is_not_listening_is_an_error_naming_the_url(tmp_path: Path) -> None:
    async def scenario() -> None:
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
            base = f"https://127.0.0.1:{closed.getsockname()[1]}"
            async with member_client(tmp_path / "client") as client:
                with pytest.raises(PeerError, match="ClientConnectorError") as caught:
                    await client.request_json("GET", base, "/internal/echo", target=PEER, timeout_s=TIMEOUT_S)
                assert not isinstance(caught.value, PeerAuthError)
                assert str(caught.value).startswith(base + "/internal/echo: ")
                with pytest.raises(PeerError, match="ClientConnectorError"):
                    await client.ws_connect(base, "/internal/stream", target=PEER, timeout_s=TIMEOUT_S)

    asyncio.run(scenario())


def test_a_data_plane_socket_opens_once_the_node_proves_it_holds_the_key(tmp_path: Path) -> None:
    async def scenario() -> None:
        peer = Peer(tmp_path / "peer")
        async with serving(peer) as base, member_client(tmp_path / "client") as client:
            ws = await client.ws_connect(base, "/internal/stream", target=PEER, timeout_s=TIMEOUT_S)
            try:
                await ws.send_str("step")
                message = await asyncio.wait_for(ws.receive(), TIMEOUT_S)
                assert (message.type, message.data) == (aiohttp.WSMsgType.TEXT, "STEP")
            finally:
                await asyncio.wait_for(ws.close(), TIMEOUT_S)
            await eventually(lambda: peer.socket_ends, timeout_s=TIMEOUT_S, what="the peer to see the socket end")

    asyncio.run(scenario())


@pytest.mark.parametrize(("proof", "error", "message"), [
    ("forged", PeerAuthError, r"bad answer signature \(HTTP 101\)"),
    ("list", PeerAuthError, r"unsigned answer \(HTTP 101\)"),
    ("close", PeerError, "closed before the node proved it is a member"),
    ("silent", PeerError, r"no connection within 0.3 s$"),
])
def test_a_data_plane_socket_without_proof_is_closed_and_refused(tmp_path: Path, proof: str, error: type,
                                                                 message: str) -> None:
    async def scenario() -> None:
        peer = Peer(tmp_path / "peer")
        async with serving(peer) as base, member_client(tmp_path / "client") as client:
            with pytest.raises(error, match=message) as caught:
                await client.ws_connect(base, f"/internal/stream?proof={proof}", target=PEER, timeout_s=0.3)
            assert caught.value.url.startswith(base + "/internal/stream")
            if proof in ("forged", "list"):  # the socket the peer opened is closed by the client
                await eventually(lambda: peer.socket_ends, timeout_s=TIMEOUT_S, what="the client to close the socket")

    asyncio.run(scenario())


def test_a_data_plane_socket_to_a_server_of_another_cluster_fails_on_tls(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with serving(Peer(tmp_path / "peer", key=OTHER_KEY)) as base, member_client(tmp_path / "c") as client:
            with pytest.raises(PeerAuthError, match="no TLS certificate of this cluster"):
                await client.ws_connect(base, "/internal/stream", target=PEER, timeout_s=TIMEOUT_S)

    asyncio.run(scenario())


segment = st.text(st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/?#."), min_size=1, max_size=8)
query = st.lists(st.tuples(st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=6),
                           st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=6)), max_size=3)


def test_any_path_and_query_is_signed_as_the_peer_receives_it(tmp_path: Path) -> None:
    """Whatever characters a path or query holds, the peer checks the signature over the bytes
    it got and sees the path and query the caller meant."""
    cases: list[tuple[list[str], list[tuple[str, str]]]] = []

    @given(st.lists(segment, min_size=1, max_size=3), query)
    def collect(segments: list[str], pairs: list[tuple[str, str]]) -> None:
        cases.append((segments, pairs))

    collect()

    async def scenario() -> None:
        async with serving(Peer(tmp_path / "peer")) as base, member_client(tmp_path / "client") as client:
            for segments, pairs in cases:
                path = "/internal/echo/" + "/".join(segments) + (f"?{urlencode(pairs)}" if pairs else "")
                answer = await client.request_json("PUT", base, path, [segments], target=PEER, timeout_s=TIMEOUT_S)
                assert answer["path"] == "/internal/echo/" + "/".join(segments), path
                assert [tuple(pair) for pair in answer["query"]] == pairs, path
                assert answer["body"] == [segments]

    asyncio.run(scenario())
