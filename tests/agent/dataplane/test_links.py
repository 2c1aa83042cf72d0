"""One network trip per hop: each stage hands a step to the next and the tail sends the token
straight to the orchestrator; nothing comes back along the chain. And a node whose peer port
is reached through a forwarder (``advertise_peer_port``) is reached there by its peers, for the
data plane too. On in-process agents serving the tiny model."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import agent.dataplane.links
import agent.node.service
from agent.http.app_keys import WORKER
from tests.agent.agents import free_ports
from tests.agent.inprocess import call
from tests.agent.tiny import TINY, tiny_cluster

BODY = {"model": TINY, "prompt": "w7 w8 w9", "max_tokens": 12, "temperature": 0}


def counting(decode: Any, kinds: Counter[str]) -> Any:
    def decode_and_count(data: bytes) -> Any:
        header, tensor = decode(data)
        kinds[header["kind"]] += 1
        return header, tensor
    return decode_and_count


def test_a_token_crosses_each_link_once_and_nothing_comes_back_along_the_chain(tmp_path, monkeypatch) -> None:
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 3, layers=4) as (leader, others):
            status, first = await call("POST", leader.url + "/v1/completions", BODY, timeout_s=30)
            assert status == 200, first
            nodes = [hop.node_id for hop in leader.app[WORKER].serving[TINY].route.hops]
            assert len(set(nodes)) == 3, nodes
            # Frames as the agents (all in this process) read them: on the sockets they serve,
            # and on the links they opened to others.
            served, linked = Counter[str](), Counter[str]()
            monkeypatch.setattr(agent.node.service, "decode_frame", counting(agent.node.service.decode_frame, served))
            monkeypatch.setattr(agent.dataplane.links, "decode_frame", counting(agent.dataplane.links.decode_frame, linked))
            status, again = await call("POST", leader.url + "/v1/completions", BODY, timeout_s=30)
            assert status == 200, again
            assert again["choices"][0]["text"] == first["choices"][0]["text"]
            steps = again["usage"]["completion_tokens"]  # the prefill's, then one a token after the first
            path = [leader.node_id, *nodes]
            hops = sum(a != b for a, b in zip(path, path[1:]))  # the orchestrator's own stage is no hop
            assert served["step"] == steps * hops
            assert served["result"] == (steps if nodes[-1] != leader.node_id else 0)
            assert not linked, linked  # no result or error frame came back on a link

    asyncio.run(scenario())


async def forward(front: int, real: int, connections: list[int]) -> asyncio.AbstractServer:
    """A TCP forwarder 127.0.0.1:front -> 127.0.0.1:real that counts its connections."""
    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(front)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", real)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

    return await asyncio.start_server(accept, "127.0.0.1", front)


def test_peers_reach_a_node_at_its_advertised_peer_port(tmp_path) -> None:
    async def scenario() -> None:
        front, real = free_ports(2)
        connections: list[int] = []
        server = await forward(front, real, connections)
        try:
            forwarded = {"peer_port": real, "advertise_peer_port": front}
            async with tiny_cluster(tmp_path, 2, layers=4, per_agent=[{}, forwarded]) as (leader, others):
                agents = {a.node_id: a for a in (leader, *others)}
                status, health = await call("GET", agents["node-1"].url + "/health")
                assert health["peer_port"] == front
                hops = leader.app[WORKER].serving[TINY].route.hops
                assert {h.node_id for h in hops} == {"node-0", "node-1"}, hops  # both serve layers
                status, body = await call("POST", leader.url + "/v1/completions", BODY, timeout_s=30)
                assert status == 200, body
                assert connections  # the others came through the forwarder
        finally:
            server.close()

    asyncio.run(scenario())
