"""agent.local.compat: the 3.11 names the agent uses (``tomllib``, ``timeout``, ``TaskGroup``)
behave as the code relies on, whichever Python provides them: TOML that the config writer
(tomli_w) writes reads back the same, a timeout raises what the code catches
(``asyncio.TimeoutError``, also for aiohttp's own timeouts on a real socket), and a task group
waits for its tasks and cancels the others when one fails."""

from __future__ import annotations

import asyncio
import datetime
import string

import aiohttp
import pytest
import tomli_w
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from agent.local import compat
from agent.local.compat import TaskGroup, timeout, tomllib

KEYS = st.text(string.ascii_letters + string.digits + "_-", min_size=1, max_size=12)
SCALARS = (st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False)
           | st.text(st.characters(exclude_categories=("Cs",)), max_size=20)
           | st.dates(min_value=datetime.date(1, 1, 1)))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
                      max_leaves=12)


def test_the_module_exports_exactly_the_three_names() -> None:
    assert sorted(compat.__all__) == ["TaskGroup", "timeout", "tomllib"]
    assert all(getattr(compat, name) is not None for name in compat.__all__)


@given(st.dictionaries(KEYS, VALUES, max_size=6))
def test_what_tomli_w_writes_tomllib_reads_back_unchanged(document: dict) -> None:
    assert tomllib.loads(tomli_w.dumps(document)) == document


def test_tomllib_reads_a_file_opened_in_binary_mode_and_names_bad_toml(tmp_path) -> None:
    good = tmp_path / "agent.toml"
    good.write_bytes('port = 9000\npeers = ["http://a:1"]\n[agent]\nmdns = false\n'.encode())
    with good.open("rb") as handle:
        assert tomllib.load(handle) == {"port": 9000, "peers": ["http://a:1"], "agent": {"mdns": False}}
    with pytest.raises(tomllib.TOMLDecodeError):
        tomllib.loads("port = [\n")
    assert issubclass(tomllib.TOMLDecodeError, ValueError)


def test_a_timeout_that_expires_raises_asyncio_timeout_error_and_cancels_the_wait() -> None:
    async def scenario() -> None:
        never = asyncio.Event()
        waiter = asyncio.ensure_future(never.wait())
        with pytest.raises(asyncio.TimeoutError):
            async with timeout(0.05):
                await waiter
        assert waiter.cancelled()

    asyncio.run(scenario())


def test_work_done_within_the_timeout_is_not_interrupted() -> None:
    async def scenario() -> list[int]:
        done = []
        async with timeout(30.0):
            for n in range(3):
                await asyncio.sleep(0)
                done.append(n)
        return done

    assert asyncio.run(scenario()) == [0, 1, 2]


def test_aiohttps_own_timeout_on_a_real_socket_is_caught_as_asyncio_timeout_error() -> None:
    """What the code's ``except asyncio.TimeoutError`` must catch: a server that does not answer
    within the client's timeout (the handler waits until the test lets it go)."""
    async def scenario() -> None:
        release = asyncio.Event()

        async def silent(_request: web.Request) -> web.Response:
            await release.wait()
            return web.Response(text="late")

        app = web.Application()
        app.router.add_get("/", silent)
        runner = web.AppRunner(app, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as session:
                with pytest.raises(asyncio.TimeoutError):
                    async with session.get(f"http://127.0.0.1:{port}/",
                                           timeout=aiohttp.ClientTimeout(total=0.2)) as response:
                        await response.read()
        finally:
            release.set()
            await runner.cleanup()

    asyncio.run(scenario())


def test_a_task_group_waits_for_all_its_tasks() -> None:
    async def scenario() -> list[str]:
        finished: list[str] = []

        async def step(name: str, turns: int) -> None:
            for _ in range(turns):
                await asyncio.sleep(0)
            finished.append(name)

        async with TaskGroup() as group:
            for name, turns in (("slow", 5), ("fast", 1), ("middle", 3)):
                group.create_task(step(name, turns))
        return finished

    assert asyncio.run(scenario()) == ["fast", "middle", "slow"]


def test_a_failing_task_cancels_its_siblings_and_the_group_raises_its_error() -> None:
    async def scenario() -> None:
        cancelled = asyncio.Event()
        sibling_started = asyncio.Event()

        async def forever() -> None:
            sibling_started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise

        async def failing() -> None:
            await sibling_started.wait()
            raise ValueError("bad step")

        with pytest.raises(Exception) as caught:  # an ExceptionGroup (3.11), the backport's on 3.10
            async with timeout(10.0):
                async with TaskGroup() as group:
                    group.create_task(forever())
                    group.create_task(failing())
        errors = caught.value.exceptions
        assert [type(e) for e in errors] == [ValueError] and str(errors[0]) == "bad step"
        assert cancelled.is_set()

    asyncio.run(scenario())
