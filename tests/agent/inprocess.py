"""Agents in this test's own event loop: the real aiohttp application (`build_app`) on a
loopback port, static peers and fast timings, an empty model store unless given one.

Seconds instead of minutes: no process start, no model load. What needs real processes
(SIGKILL, mDNS between namespaces) stays in the process-level tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from agent.config import AgentConfig
from agent.service import AgentRunner, start_agent
from agent.service_keys import MEMBERSHIP
from shards.store import ModelStore
from tests.agent.agents import CLUSTER_KEY, free_ports

FAST = {"health_interval_s": 0.1, "peer_timeout_s": 1.0, "discovery_grace_s": 0.3, "failure_threshold": 3}


@dataclass
class LocalAgent:
    node_id: str
    port: int
    runner: web.AppRunner

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def app(self) -> web.Application:
        return self.runner.app

    @property
    def peer_url(self) -> str:
        """Where its internal endpoints answer (TLS, with a certificate of the cluster's CA)."""
        return self.app[MEMBERSHIP].peer_address_of(self.node_id)


async def start_app(app: web.Application, port: int, host: str = "127.0.0.1") -> web.AppRunner:
    runner = AgentRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=2.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


@contextlib.asynccontextmanager
async def local_agents(tmp: Path, count: int, **settings: Any) -> AsyncIterator[list[LocalAgent]]:
    """``count`` agents of cluster "test", each given the others as static peers."""
    ports = free_ports(count)
    agents = []
    try:
        for index, port in enumerate(ports):
            config = AgentConfig(
                cluster_name="test", cluster_key=CLUSTER_KEY, host="127.0.0.1", port=port,
                advertise_host="127.0.0.1", peers=tuple(f"http://127.0.0.1:{p}" for p in ports if p != port),
                state_dir=tmp / f"agent-{index}", mdns=False, threads=1, **{**FAST, **settings},
            )
            node_id = f"node-{index}"
            runner = await start_agent(config, node_id=node_id, store=ModelStore(tmp / f"home-{index}"),
                                       key=CLUSTER_KEY.encode(), shutdown_timeout_s=2.0)
            agents.append(LocalAgent(node_id, port, runner))
        yield agents
    finally:
        for agent in agents:
            await agent.runner.cleanup()


async def eventually(condition: Callable[[], Awaitable[Any] | Any], *, timeout_s: float, what: str,
                     interval_s: float = 0.05) -> Any:
    """Poll ``condition`` (sync or async) until it is truthy, or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(interval_s)


async def call(method: str, url: str, body: Any = None, *, headers: dict[str, str] | None = None,
               timeout_s: float = 10.0, tls: ssl.SSLContext | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.request(
        method, url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s), ssl=tls,
    ) as response:
        text = await response.text()
        try:
            return response.status, json.loads(text)
        except ValueError:
            return response.status, text
