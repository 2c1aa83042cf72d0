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
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from agent.cluster import membership
from agent.http.app_keys import MEMBERSHIP
from agent.local.config import AgentConfig
from agent.local.probe import Accelerators, find_accelerators
from agent.node.service import AgentRunner, start_agent
from shards.store.model_store import ModelStore
from tests.agent.agents import CLUSTER_KEY, free_ports
from tests.deadlines import Deadline

FAST = {"health_interval_s": 0.1, "peer_timeout_s": 1.0, "discovery_grace_s": 0.3, "failure_threshold": 3}
SEED_SPLIT = {"default_placement": "split"}  # as tests.agent.agents.SEED_SPLIT


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
async def local_agents(tmp: Path, count: int, *, per_agent: Sequence[Mapping[str, Any]] = (),
                       **settings: Any) -> AsyncIterator[list[LocalAgent]]:
    """``count`` agents of cluster "test", each given the others as static peers; ``per_agent[i]``
    (when given) adds settings of agent i only (its capacity, being the configured orchestrator)."""
    ports = free_ports(count)
    agents = []
    try:
        for index, port in enumerate(ports):
            config = AgentConfig(
                cluster_name="test", cluster_key=CLUSTER_KEY, host="127.0.0.1", port=port,
                advertise_host="127.0.0.1", peers=tuple(f"http://127.0.0.1:{p}" for p in ports if p != port),
                state_dir=tmp / f"agent-{index}", mdns=False, threads=1,
                **{**FAST, **SEED_SPLIT, **settings, **(per_agent[index] if index < len(per_agent) else {})},
            )
            node_id = f"node-{index}"
            runner = await start_agent(config, node_id=node_id, store=ModelStore(tmp / f"home-{index}"),
                                       key=CLUSTER_KEY.encode(), shutdown_timeout_s=2.0)
            agents.append(LocalAgent(node_id, port, runner))
        yield agents
    finally:
        for agent in agents:
            await agent.runner.cleanup()


_calibrations: dict[tuple[str, ...], Accelerators] = {}
_calibrating = threading.Lock()


def calibrated_once(providers: tuple[str, ...] = (), stop: threading.Event | None = None) -> Accelerators:
    """:func:`agent.local.probe.find_accelerators` (the backends' self-test and calibration, a second or
    more on a small machine) run once per test process and providers: in-process agents are on one
    machine, so they may share its result. Opt in with :func:`share_calibration`."""
    with _calibrating:
        if providers not in _calibrations:
            _calibrations[providers] = find_accelerators(providers)
        return _calibrations[providers]


def share_calibration(monkeypatch: Any) -> None:
    """Agents started in this test take the backends' calibration of the first agent of the
    process (``monkeypatch``: pytest's fixture, which undoes this after the test)."""
    monkeypatch.setattr(membership, "find_accelerators", calibrated_once)


async def eventually(condition: Callable[[], Awaitable[Any] | Any], *, timeout_s: float, what: str,
                     interval_s: float = 0.05) -> Any:
    """Poll ``condition`` (sync or async) until it is truthy, or fail after ``timeout_s``
    (stretched while the machine is busy: :class:`tests.deadlines.Deadline`)."""
    deadline = Deadline(timeout_s)
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if deadline.expired():
            raise AssertionError(f"timed out after {deadline.describe()} waiting for {what}")
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


class SseEvents:
    """`GET /models/sse` read in a task: (event kind, data) pairs, in order."""

    def __init__(self, url: str) -> None:
        self.items: list[tuple[str, dict[str, Any]]] = []
        self.task = asyncio.create_task(self._read(url))

    async def _read(self, url: str) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=60)
        async with aiohttp.ClientSession() as session, session.get(url + "/models/sse", timeout=timeout) as response:
            assert response.status == 200 and response.content_type == "text/event-stream"
            kind = "message"
            async for raw in response.content:
                line = raw.decode().rstrip("\n")
                if line.startswith("event: "):
                    kind = line[len("event: "):]
                elif line.startswith("data: "):
                    self.items.append((kind, json.loads(line[len("data: "):])))

    def states(self, model: str, *, after: int = 0) -> list[str]:
        """The states ``model`` entered (status changes that repeat a state left out)."""
        states = [data["state"] for kind, data in self.items[after:] if kind == "status_change" and data["model"] == model]
        return [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]]

    def of(self, model: str, *, after: int = 0) -> list[tuple[str, dict[str, Any]]]:
        """Every event about ``model`` (from the ``after``-th on), with its kind."""
        return [(kind, data) for kind, data in self.items[after:] if data["model"] == model]

    def changes(self, model: str, *, after: int = 0) -> list[dict[str, Any]]:
        return [data for kind, data in self.items[after:] if kind == "status_change" and data["model"] == model]

    async def reach(self, model: str, state: str, *, after: int) -> None:
        """Wait until the stream (a connection of its own) has told that ``model`` entered ``state``."""
        await eventually(lambda: self.states(model, after=after)[-1:] == [state], timeout_s=10,
                         what=f"the event of {model} entering {state}")

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


class Loop:
    """An event loop in a thread of its own: the agents and servers the tests share keep running
    (health checks, elections) between the tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._entered = contextlib.AsyncExitStack()

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout_s: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def enter(self, context: contextlib.AbstractAsyncContextManager[Any]) -> Any:
        """Enter ``context`` on the loop; :meth:`close` leaves it (what was entered, in reverse)."""
        return self.run(self._entered.enter_async_context(context))

    def close(self) -> None:
        try:
            self.run(self._entered.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """``app`` on a free loopback port; yields its base URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield "http://127.0.0.1:%d" % runner.addresses[0][1]
    finally:
        await runner.cleanup()
