"""agent.local.lifecycle: how the service ends. A signal (wired as ``serve`` wires SIGTERM)
stops it without a restart; ``restart_now`` (a join, a new key) stops it and asks for a start
again, waking whoever waits on the stop, and an answer sent by the request that asked for it
still reaches its client."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
from aiohttp import web

from agent.local.compat import timeout
from agent.local.lifecycle import Lifecycle


def test_a_new_lifecycle_is_running_and_not_restarting() -> None:
    lifecycle = Lifecycle(asyncio.Event())
    assert not lifecycle.stop.is_set() and lifecycle.restart is False


def test_restart_now_stops_and_asks_for_a_restart_and_wakes_the_waiter() -> None:
    async def scenario() -> tuple[bool, bool]:
        lifecycle = Lifecycle(asyncio.Event())
        waiter = asyncio.create_task(lifecycle.stop.wait())
        await asyncio.sleep(0)  # the waiter is waiting
        assert not waiter.done()
        lifecycle.restart_now()
        async with timeout(5.0):
            await waiter
        lifecycle.restart_now()  # asked twice (a join and a key rotation at once): the same outcome
        return lifecycle.stop.is_set(), lifecycle.restart

    assert asyncio.run(scenario()) == (True, True)


def test_a_signal_stops_the_service_without_a_restart() -> None:
    async def scenario() -> Lifecycle:
        lifecycle = Lifecycle(asyncio.Event())
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, lifecycle.stop.set)
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            async with timeout(5.0):
                await lifecycle.stop.wait()
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)
        return lifecycle

    lifecycle = asyncio.run(scenario())
    assert lifecycle.stop.is_set() and lifecycle.restart is False


def test_the_request_that_asks_for_a_restart_gets_its_answer_before_the_service_stops() -> None:
    """As the join endpoint does: the handler calls restart_now and answers; the service loop,
    woken by the stop, then cleans up (requests in flight finish first)."""
    async def scenario() -> tuple[int, dict, bool]:
        lifecycle = Lifecycle(asyncio.Event())

        async def join(_request: web.Request) -> web.Response:
            lifecycle.restart_now()
            return web.json_response({"joined": True})

        app = web.Application()
        app.router.add_post("/cluster/join", join)
        runner = web.AppRunner(app, shutdown_timeout=2.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]

        async def service() -> None:
            await lifecycle.stop.wait()
            await runner.cleanup()

        serving = asyncio.create_task(service())
        async with aiohttp.ClientSession() as session, session.post(
                f"http://127.0.0.1:{port}/cluster/join", timeout=aiohttp.ClientTimeout(total=10)) as response:
            status, answer = response.status, await response.json()
        async with timeout(10.0):
            await serving
        return status, answer, lifecycle.restart

    assert asyncio.run(scenario()) == (200, {"joined": True}, True)
