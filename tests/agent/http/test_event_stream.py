"""Server-Sent Events from a queue (agent/http/event_stream.py), on a real aiohttp application on
loopback read with aiohttp's client: each event as ``event: <name>`` and one ``data:`` line of
JSON, in the queue's order, whatever the data holds (newlines, any Unicode); a comment when the
queue stays quiet for SSE_KEEPALIVE_S; and the handler ends once its client has left. The
agent's feeds that use it (`/cluster/events`, `/models/sse`) are tested with their endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.http import event_stream as sse
from tests.agent.inprocess import eventually

READ_TIMEOUT = aiohttp.ClientTimeout(total=30, sock_connect=5, sock_read=10)


class Feed:
    """An application whose `GET /events` streams the events put in :attr:`queue`, each encoded
    as (its "kind", the rest); :attr:`ended` is set when the handler returns."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.ended = asyncio.Event()
        self.outcome: str | None = None
        self.app = web.Application()
        self.app.router.add_get("/events", self.handler)

    async def handler(self, request: web.Request) -> web.StreamResponse:
        try:
            response = await sse.event_stream(request, self.queue, lambda event: (event["kind"], event["data"]))
            self.outcome = "returned"
            return response
        except BaseException as error:
            self.outcome = type(error).__name__
            raise
        finally:
            self.ended.set()


@contextlib.asynccontextmanager
async def serving(feed: Feed, *, cancel_handlers: bool = True) -> AsyncIterator[str]:
    """``feed`` on a free loopback port; ``cancel_handlers``: as the agent serves, a handler is
    cancelled when its client leaves (else it finds out when it next writes)."""
    runner = web.AppRunner(feed.app, access_log=None, handler_cancellation=cancel_handlers, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield "http://127.0.0.1:%d/events" % runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def frames(response: aiohttp.ClientResponse, count: int) -> list[str]:
    """The next ``count`` frames of the stream (the text between blank lines)."""
    found: list[str] = []
    lines: list[str] = []
    while len(found) < count:
        raw = await response.content.readline()
        assert raw, f"the stream ended after {found}"
        line = raw.decode("utf-8")
        assert line.endswith("\n"), line
        if line == "\n":
            found.append("".join(lines))
            lines = []
        else:
            lines.append(line)
    return found


def parsed(frame: str) -> tuple[str, Any]:
    """An event frame as a client reads it: its name, and its data (one line of JSON)."""
    lines = frame.split("\n")[:-1]
    assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), frame
    return lines[0][len("event: "):], json.loads(lines[1][len("data: "):])


def test_events_go_out_in_order_with_their_names_and_json_data():
    events = [{"kind": "status_change", "data": {"model": "tiny", "state": "loading"}},
              {"kind": "progress", "data": {"model": "tiny", "progress": 0.5}},
              {"kind": "cluster", "data": [1, "two", None, True]},
              {"kind": "status_change", "data": {"model": "tiny", "state": "ready"}}]

    async def scenario() -> None:
        feed = Feed()
        async with serving(feed) as url, aiohttp.ClientSession(timeout=READ_TIMEOUT) as session:
            for event in events[:2]:  # waiting before the client comes
                feed.queue.put_nowait(event)
            async with session.get(url) as response:
                assert response.status == 200
                assert response.headers["Content-Type"] == "text/event-stream"
                assert response.headers["Cache-Control"] == "no-cache"
                first = await frames(response, 2)
                for event in events[2:]:  # and while it reads
                    feed.queue.put_nowait(event)
                rest = await frames(response, 2)
        assert [parsed(frame) for frame in first + rest] == [(e["kind"], e["data"]) for e in events]
        assert first[0] == 'event: status_change\ndata: {"model": "tiny", "state": "loading"}\n'

    asyncio.run(scenario())


SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                    max_leaves=12)
NAMES = st.from_regex(r"[a-z][a-z_]{0,15}", fullmatch=True)


@settings(max_examples=40, deadline=None)
@given(events=st.lists(st.tuples(NAMES, JSON), min_size=1, max_size=6))
def test_any_json_data_comes_back_whole_one_data_line_per_event(events):
    """Newlines, carriage returns and any Unicode inside the data never break a frame."""
    async def scenario() -> list[tuple[str, Any]]:
        feed = Feed()
        for kind, data in events:
            feed.queue.put_nowait({"kind": kind, "data": data})
        async with serving(feed) as url, aiohttp.ClientSession(timeout=READ_TIMEOUT) as session, \
                session.get(url) as response:
            return [parsed(frame) for frame in await frames(response, len(events))]

    assert asyncio.run(scenario()) == events


def test_a_quiet_stream_sends_keep_alive_comments_and_the_next_event_after_them(monkeypatch):
    monkeypatch.setattr(sse, "SSE_KEEPALIVE_S", 0.05)

    async def scenario() -> None:
        feed = Feed()
        async with serving(feed) as url, aiohttp.ClientSession(timeout=READ_TIMEOUT) as session, \
                session.get(url) as response:
            quiet = await frames(response, 3)
            assert quiet == [": keep-alive\n"] * 3
            feed.queue.put_nowait({"kind": "cluster", "data": {"kind": "join", "node": "node-1"}})
            while (frame := (await frames(response, 1))[0]) == ": keep-alive\n":
                pass  # a comment may have gone out before the event
            assert parsed(frame) == ("cluster", {"kind": "join", "node": "node-1"})

    asyncio.run(scenario())


def test_no_keep_alive_goes_out_before_the_interval(monkeypatch):
    monkeypatch.setattr(sse, "SSE_KEEPALIVE_S", 30.0)

    async def scenario() -> None:
        feed = Feed()
        async with serving(feed) as url, aiohttp.ClientSession(timeout=READ_TIMEOUT) as session, \
                session.get(url) as response:
            feed.queue.put_nowait({"kind": "first", "data": 1})
            assert [parsed(f) for f in await frames(response, 1)] == [("first", 1)]
            with contextlib.suppress(asyncio.TimeoutError):
                extra = await asyncio.wait_for(response.content.readline(), timeout=0.5)
                raise AssertionError(f"something went out of a quiet stream: {extra!r}")

    asyncio.run(scenario())


def test_the_handler_returns_once_its_client_has_left(monkeypatch):
    """Found at the next write (here a keep-alive): the stream's subscription ends with it."""
    monkeypatch.setattr(sse, "SSE_KEEPALIVE_S", 0.05)

    async def scenario() -> None:
        feed = Feed()
        async with serving(feed, cancel_handlers=False) as url:
            async with aiohttp.ClientSession(timeout=READ_TIMEOUT) as session, session.get(url) as response:
                feed.queue.put_nowait({"kind": "only", "data": {}})
                assert [parsed(f) for f in await frames(response, 1)] == [("only", {})]
                assert not feed.ended.is_set()
            await eventually(feed.ended.is_set, timeout_s=5, what="the handler to end after its client left")
            assert feed.outcome == "returned"  # the reset connection is not an error of the handler

    asyncio.run(scenario())


def test_the_default_keep_alive_is_well_inside_common_proxy_timeouts():
    """nginx and most load balancers close a connection quiet for 60 s."""
    assert 1.0 <= sse.SSE_KEEPALIVE_S < 60.0
