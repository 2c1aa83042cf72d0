"""One network trip per hop: the tail sends each result straight to the orchestrator, so a
request goes on while the answers coming back along the chain are held at a middle stage
(they would take it nowhere before). And a node whose peer port is reached through a
forwarder (``advertise_peer_port``) is reached there by its peers, for the data plane too.
On in-process agents serving the tiny model."""

from __future__ import annotations

import asyncio
from typing import Any

from agent.service_keys import WORKER
from tests.agent.agents import free_ports
from tests.agent.inprocess import call
from tests.agent.tiny import TINY, tiny_cluster

BODY = {"model": TINY, "prompt": "w7 w8 w9", "max_tokens": 12, "temperature": 0}


def test_tokens_come_straight_from_the_tail_while_the_chain_holds_its_answers(tmp_path) -> None:
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 3, layers=4) as (leader, others):
            status, first = await call("POST", leader.url + "/v1/completions", BODY, timeout_s=30)
            assert status == 200, first
            hops = leader.app[WORKER].serving[TINY].route.hops
            assert len(hops) == 3, hops
            middle = next(a for a in (leader, *others) if a.node_id == hops[1].node_id)
            worker = middle.app[WORKER]
            step, release, held = worker.step, asyncio.Event(), []

            async def holding(frame: Any, tensor: Any) -> Any:
                result = await step(frame, tensor)  # computed and passed on: the tail has answered
                held.append(frame.seq)
                await release.wait()  # ... but the answer does not go back
                return result

            worker.step = holding
            try:
                status, again = await call("POST", leader.url + "/v1/completions", BODY, timeout_s=30)
            finally:
                release.set()
                worker.step = step
            assert status == 200, again
            assert again["choices"][0]["text"] == first["choices"][0]["text"]
            # every step held there: the prefill, then one per token after the first
            assert len(held) == again["usage"]["completion_tokens"] > 1

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
