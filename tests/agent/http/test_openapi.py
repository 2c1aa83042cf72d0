"""Fuzzing of the public API: schemathesis generates requests from `GET /openapi.json` (valid
and invalid ones) against a real agent serving the default model, and hypothesis-made
frames hit its data plane over a signed WebSocket. The invariants: no 5xx, errors in the
OpenAI shape, no hung connection, the agent still running, and the same greedy answer
afterwards."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

import aiohttp
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.core.auth import sign
from agent.http.openapi import openapi_document
from tests.agent.agents import ADMIN, CLUSTER_KEY, cluster_ready, make_agents, member_tls, shut_down, wait_for
from tests.agent.core.test_wire_fuzz import frame, headers

pytestmark = pytest.mark.slow
EXAMPLES_PER_OPERATION = 20
FRAME_EXAMPLES = 150
QUESTION = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0,
            "max_tokens": 8}
# Admin calls are fuzzed with the token where they stay on this machine: a fuzzed
# /cluster/join would send the agent to arbitrary addresses, so it is fuzzed without it.
WITH_ADMIN = ("/models/load", "/models/unload", "/models/sleep")


@pytest.fixture(scope="module")
def agent(smollm2_store, tmp_path_factory):
    agents = make_agents(tmp_path_factory.mktemp("fuzz"), smollm2_store.root, 1,
                         extra_env={"NCM_MAX_CONTEXT": "96", "NCM_PREFILL_CHUNK": "32", "NCM_ALLOW_FALLBACK": "false"})
    try:
        wait_for(lambda: cluster_ready(agents[0], 1), timeout_s=300, what="the agent to serve")
        status, body = agents[0].post("/v1/chat/completions", QUESTION)
        assert status == 200, body
        agents[0].reference = body["choices"][0]["message"]["content"]
        yield agents[0]
        assert agents[0].process.poll() is None, "the agent died during the fuzzing"
        status, body = agents[0].post("/v1/chat/completions", QUESTION)
        assert status == 200 and body["choices"][0]["message"]["content"] == agents[0].reference
    finally:
        shut_down(agents, keep_store=smollm2_store.root)


# The document the agent serves at /openapi.json (checked to be the same below).
schema = schemathesis.openapi.from_dict(openapi_document())


def test_the_agent_serves_its_openapi_document(agent):
    status, body = agent.get("/openapi.json")
    assert status == 200 and body == json.loads(json.dumps(openapi_document()))


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_server_error_or_an_unshaped_error(case, agent):
    if case.path in WITH_ADMIN:
        case.headers = {**(case.headers or {}), **ADMIN}
    response = case.call(base_url=agent.url, timeout=120)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        if case.path.startswith("/api/"):  # Ollama's shape
            assert isinstance(error, str) and error, response.text
        else:
            assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text


async def _fuzz_data_plane(url: str, node_id: str, frames: list[bytes], tls) -> None:
    path = "/internal/stream"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls)) as session:
        for data in frames:
            signed = sign(CLUSTER_KEY.encode(), "GET", path, b"", now=time.time(), nonce=secrets.token_hex(12),
                          node_id="fuzzer", target=node_id)
            async with session.ws_connect(url + path, headers=signed, max_msg_size=0, autoping=False) as ws:
                await ws.receive(timeout=10)  # the node's proof of membership
                await ws.send_bytes(data)
                await ws.ping()
                async with asyncio.timeout(30):  # the socket goes on (a pong) or is closed: never a hang
                    while (await ws.receive()).type not in (aiohttp.WSMsgType.PONG, aiohttp.WSMsgType.CLOSE,
                                                            aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING):
                        pass


def test_data_plane_frames_never_hang_or_crash_the_agent(agent, tmp_path):
    frames: list[bytes] = []

    @settings(max_examples=FRAME_EXAMPLES, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(headers, st.binary(max_size=64))
    def collect(header, payload):
        frames.append(frame(header, payload))

    collect()
    frames += [b"", b"NCM1", b"NCM1\xff\xff\xff\xff", b"\x00" * 1024, b"NCM1" + b"\x00\x00\x00\x00"]
    asyncio.run(_fuzz_data_plane(agent.peer_url(), agent.node_id(), frames, member_tls(tmp_path)))
    assert agent.process.poll() is None
    assert agent.get("/health", timeout_s=5)[0] == 200
