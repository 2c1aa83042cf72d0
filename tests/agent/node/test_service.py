"""Strangers' connections on both ports of an in-process agent: a request whose headers never
come in full (slowloris) is dropped after the header timeout, one address holds a bounded
number of such connections, a TLS handshake that never ends is dropped on the peer port, the
memory they took comes back, and /cluster/pair takes a few attempts a minute per address and
logs one line however many it refuses."""

from __future__ import annotations

import asyncio
import gc
import logging
import secrets
from urllib.parse import urlsplit

import psutil
import pytest

from agent.node import service
from tests.agent.inprocess import call, local_agents


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    try:
        return await reader.read(65536) == b""
    except ConnectionError:
        return True


def test_slow_and_half_open_connections_are_dropped_and_their_memory_comes_back(tmp_path, monkeypatch):
    monkeypatch.setattr(service, "HEADER_READ_TIMEOUT_S", 1.0)
    monkeypatch.setattr(service, "TLS_HANDSHAKE_TIMEOUT_S", 1.0)

    async def scenario() -> None:
        async with local_agents(tmp_path, 1) as (agent,):
            api, peer = urlsplit(agent.url), urlsplit(agent.peer_url)

            async def flood() -> None:
                slow = []
                for index in range(200):  # slowloris: a request line and one header, then nothing
                    reader, writer = await asyncio.open_connection("127.0.0.1", api.port,
                                                                   local_addr=(f"127.0.1.{index % 50 + 1}", 0))
                    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
                    slow.append((reader, writer))
                half_open = [await asyncio.open_connection("127.0.0.1", peer.port) for _ in range(50)]  # no TLS hello
                for reader, _ in (*slow, *half_open):
                    assert await asyncio.wait_for(closed_by_server(reader), timeout=30)  # the defaults: never, 60 s
                for _, writer in (*slow, *half_open):
                    writer.close()
                gc.collect()

            await flood()  # the first flood also makes what any first connections make
            rss_after_one = psutil.Process().memory_info().rss
            for _ in range(3):
                await flood()
            assert psutil.Process().memory_info().rss <= rss_after_one * 1.1
            assert (await call("GET", agent.url + "/health"))[0] == 200

    asyncio.run(scenario())


def test_headers_that_came_with_a_long_body_count_as_in_whatever_follows(tmp_path, monkeypatch):
    """The end of the headers read in the same chunk as more than 4 KiB of body: the request is
    in, however long its body or its answer then takes (a long prompt read for longer than the
    header timeout was dropped)."""
    monkeypatch.setattr(service, "HEADER_READ_TIMEOUT_S", 1.0)

    async def scenario() -> None:
        async with local_agents(tmp_path, 1) as (agent,):
            reader, writer = await asyncio.open_connection("127.0.0.1", urlsplit(agent.url).port)
            body = b'{"model": "none", "messages": [], "x": "' + b"y" * 16384 + b'"}'
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body[:-1])
            await writer.drain()
            with pytest.raises(asyncio.TimeoutError):  # past the header timeout, the connection stays open
                await asyncio.wait_for(reader.read(1), timeout=2 * service.HEADER_READ_TIMEOUT_S)
            writer.write(body[-1:])
            assert (await asyncio.wait_for(reader.read(), timeout=30)).startswith(b"HTTP/1.1 ")
            writer.close()

    asyncio.run(scenario())


def test_one_address_holds_a_bounded_number_of_connections_without_a_request(tmp_path, monkeypatch):
    monkeypatch.setattr(service, "MAX_PENDING_PER_ADDRESS", 5)

    async def scenario() -> None:
        async with local_agents(tmp_path, 1) as (agent,):
            port = urlsplit(agent.url).port
            held = [await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.2.1", 0)) for _ in range(8)]
            extra_closed = [await asyncio.wait_for(closed_by_server(reader), timeout=30) for reader, _ in held[5:]]
            assert extra_closed == [True, True, True]
            assert (await call("GET", agent.url + "/health"))[0] == 200  # another address is served meanwhile
            assert not any(reader.at_eof() for reader, _ in held[:5])  # the first five wait (the header timeout)
            reader, writer = held[0]
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert (await asyncio.wait_for(reader.read(), timeout=30)).startswith(b"HTTP/1.1 200")
            for _, writer in held:
                writer.close()

    asyncio.run(scenario())


def test_pairing_attempts_are_rate_limited_and_logged_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="agent.http.cluster_endpoints")

    async def scenario() -> None:
        async with local_agents(tmp_path, 1) as (agent,):
            statuses = []
            for _ in range(20):
                nonce = secrets.token_hex(8)
                status, answer = await call("POST", agent.url + "/cluster/pair",
                                            {"invite": "0123abcd0123abcd", "nonce": nonce, "proof": "0" * 64})
                statuses.append(status)
            assert statuses[:10] == [403] * 10 and set(statuses[10:]) == {429}
            assert answer["error"]["code"] == "rate_limit_exceeded"
            refused = [r for r in caplog.records if "refused an invite" in r.getMessage()]
            assert len(refused) == 1, [r.getMessage() for r in refused]

    asyncio.run(scenario())
