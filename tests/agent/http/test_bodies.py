"""Malformed requests get a 4xx in the OpenAI error shape, on the orchestrator and through a
worker that passes them on; the agents keep serving. In-process agents, no model."""

from __future__ import annotations

import asyncio
import gzip
import secrets
import time

import aiohttp
import pytest

from agent.core.auth import sign
from agent.http.app_keys import MEMBERSHIP, WORKER
from agent.stage.worker import FRAME_HEADER_BYTES, MIN_FRAME_LIMIT_BYTES
from tests.agent.agents import CLUSTER_KEY, member_tls
from tests.agent.inprocess import eventually, local_agents

JSON = {"Content-Type": "application/json"}
CASES = [
    ("nested 100k deep", b"[" * 100_000 + b"]" * 100_000, JSON, "nests too deeply"),
    ("an integer of 5000 digits", b'{"max_tokens": ' + b"9" * 5000 + b"}", JSON, "not valid JSON"),
    ("a lone surrogate", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', JSON, "unpaired surrogates"),
    ("bytes that are not UTF-8", b'{"model": "\xff\xfe"}', JSON, "UTF-8"),
    ("a role given as a list", b'{"messages": [{"role": ["user"], "content": "hi"}]}', JSON, "role must be one of"),
    ("an unknown charset", b'{"messages": 1}', {"Content-Type": "application/json; charset=klingon"}, "'messages'"),
    ("invalid gzip", b"not gzip at all", {**JSON, "Content-Encoding": "gzip"}, "could not be read as gzip"),
    ("a model name of 5000 characters", b'{"model": "' + b"m" * 5000 + b'", "messages": [{"role": "user", "content": "hi"}]}',
     JSON, "'model' is 5000 characters long; a model name or alias has at most 256"),
]


async def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    # A connection per request: the server closes one whose body it could not read.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session, session.post(
            url + "/v1/chat/completions", data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as r:
        return r.status, await r.json()


@pytest.fixture
def agents_loop(tmp_path):
    """Two in-process agents, and which of them is the orchestrator."""

    async def start():
        context = local_agents(tmp_path, 2)
        agents = await context.__aenter__()
        await eventually(lambda: all(a.app[MEMBERSHIP].election for a in agents), timeout_s=20, what="an election")
        orchestrator = agents[0].app[MEMBERSHIP].election.orchestrator
        return context, sorted(agents, key=lambda a: a.node_id != orchestrator)

    loop = asyncio.new_event_loop()
    context, agents = loop.run_until_complete(start())
    yield loop, agents
    loop.run_until_complete(context.__aexit__(None, None, None))
    loop.close()


@pytest.mark.parametrize("name, body, headers, message", CASES, ids=[c[0] for c in CASES])
def test_a_malformed_body_is_a_400_in_the_openai_shape_on_every_agent(agents_loop, name, body, headers, message):
    loop, agents = agents_loop
    for agent in agents:  # the orchestrator, then a worker that passes the request on
        status, answer = loop.run_until_complete(post(agent.url, body, headers))
        assert status == 400, (agent.node_id, answer)
        assert set(answer["error"]) == {"message", "type", "param", "code"}
        assert message in answer["error"]["message"] and answer["error"]["type"] == "invalid_request_error"


def test_a_gzip_body_is_understood_through_a_worker_too(agents_loop):
    loop, agents = agents_loop
    body = gzip.compress(b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}')
    for agent in agents:
        status, answer = loop.run_until_complete(post(agent.url, body, {**JSON, "Content-Encoding": "gzip"}))
        assert status == 404 and answer["error"]["code"] == "model_not_found", answer


def test_a_data_plane_frame_over_the_limit_closes_the_socket_and_the_agent_serves_on(agents_loop, tmp_path):
    loop, agents = agents_loop
    agent = agents[0]
    worker = agent.app[WORKER]
    limit = worker.max_frame_bytes()
    assert limit == MIN_FRAME_LIMIT_BYTES + FRAME_HEADER_BYTES  # no model stored: the floor

    async def send_frame(size: int) -> aiohttp.WSMessage:
        path = "/internal/stream"
        signed = sign(CLUSTER_KEY.encode(), "GET", path, b"", now=time.time(), nonce=secrets.token_hex(12),
                      node_id="tester", target=agent.node_id)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=member_tls(tmp_path))) as session, \
                session.ws_connect(agent.peer_url + path, headers=signed, max_msg_size=0) as ws:
            await ws.receive(timeout=10)  # the node's proof of membership
            await ws.send_bytes(b"NCM1" + b"\x00" * (size - 4))
            return await ws.receive(timeout=30)

    closed = loop.run_until_complete(send_frame(limit + 1))
    assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
    status, _ = loop.run_until_complete(post(agent.url, b"{}", JSON))
    assert status == 400  # the agent answers on
