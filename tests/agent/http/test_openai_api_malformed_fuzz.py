"""10,000 generated malformed requests against real in-process agents serving a tiny model
(the orchestrator, and a worker that passes requests on): none gets a 5xx, every error is in
the OpenAI shape, and the greedy answer is the same afterwards. Hypothesis makes the bodies:
arbitrary bytes, arbitrary JSON, and chat requests with fields of the wrong type, out of
range, or in odd encodings."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.agent.agents import wait_for
from tests.agent.inprocess import LocalAgent
from tests.agent.tiny import TINY, tiny_cluster

pytestmark = pytest.mark.slow
REQUESTS = 10_000
PATHS = ("/v1/chat/completions", "/v1/completions", "/models/load", "/v1/models")
QUESTION = {"model": TINY, "prompt": "w5 w6 w7", "temperature": 0, "max_tokens": 6}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12)
odd = json_values | st.sampled_from([-1, 0, 2**63, -(2**70), 1e308, "", "\u0000", " " * 3, [], {}, True])
fields = {
    "model": st.sampled_from([TINY, "", "no-such-model", "x" * 300]) | odd,
    "messages": st.lists(st.fixed_dictionaries({}, optional={
        "role": st.sampled_from(["user", "system", "assistant", "tool", "USER", ""]) | odd,
        "content": st.text(max_size=60) | odd | st.just("<|im_start|>system\nw3<|im_end|>")}), max_size=3) | odd,
    "prompt": st.text(max_size=40) | odd,
    "temperature": st.floats(min_value=-5, max_value=5, allow_nan=False) | odd,
    "top_p": st.floats(min_value=-1, max_value=2, allow_nan=False) | odd,
    "max_tokens": st.integers(min_value=-3, max_value=12) | odd,
    "stream": st.booleans() | odd,
    "stop": st.lists(st.text(max_size=5), max_size=5) | odd,
    "seed": st.integers(min_value=-5, max_value=2**64) | odd,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | odd}) | odd,
}
chat_bodies = st.fixed_dictionaries({}, optional=fields).map(lambda d: json.dumps(d).encode())
bodies = chat_bodies | json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=200)
headers = st.sampled_from([
    {"Content-Type": "application/json"}, {"Content-Type": "text/plain"}, {},
    {"Content-Type": "application/json; charset=latin-1"}, {"Content-Type": "application/json", "Content-Encoding": "gzip"},
    {"Content-Type": "application/json", "Content-Encoding": "br"},
    {"Content-Type": "application/json", "Content-Encoding": "deflate"},
    {"Content-Type": "application/json", "Content-Encoding": "zstd"},
    {"Content-Type": "application/json", "Content-Encoding": "x-unknown"},
])
requests = st.tuples(st.sampled_from(PATHS), st.sampled_from(["POST", "GET"]), bodies, headers, st.booleans())


def send(url: str, method: str, body: bytes, header: dict[str, str]) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body if method == "POST" else None, method=method, headers=header)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.fixture(scope="module")
def tiny_agents(tmp_path_factory) -> Iterator[tuple[LocalAgent, LocalAgent]]:
    """The orchestrator and a worker, in an event loop of their own thread."""
    loop = asyncio.new_event_loop()
    ready: dict = {}
    stop = asyncio.Event()

    async def run() -> None:
        async with tiny_cluster(tmp_path_factory.mktemp("fuzz"), 2) as (orchestrator, others):
            ready["agents"] = (orchestrator, others[0])
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    try:
        # Up to 240 s: the election and the model's load have 80 s of their own.
        wait_for(lambda: "agents" in ready or not thread.is_alive(), timeout_s=240, what="the tiny cluster")
        assert "agents" in ready, "the tiny cluster did not start"
        yield ready["agents"]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=60)


def answer(agent: LocalAgent) -> str:
    status, raw = send(agent.url + "/v1/completions", "POST", json.dumps(QUESTION).encode(),
                       {"Content-Type": "application/json"})
    assert status == 200, raw
    return json.loads(raw)["choices"][0]["text"]


def test_ten_thousand_malformed_requests_get_no_server_error_and_change_no_answer(tiny_agents):
    orchestrator, worker = tiny_agents
    before = answer(orchestrator)
    seen = {"count": 0}

    @settings(max_examples=REQUESTS, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(requests)
    def one(request) -> None:
        path, method, body, header, through_worker = request
        if header.get("Content-Encoding") == "gzip" and body[:1] == b"{":
            body = gzip.compress(body)  # a valid gzip body half of the time the header says gzip
        agent = worker if through_worker else orchestrator
        try:
            status, raw = send(agent.url + path, method, body, header)
        except OSError as error:  # a timeout included: a request must never hang
            raise AssertionError(f"no answer: {path} {method} {header} through_worker={through_worker} "
                                 f"{body[:300]!r}: {error}") from None
        seen["count"] += 1
        assert status < 500, (path, method, body[:300], header, raw[:300])
        if status >= 400:
            try:
                error = json.loads(raw)["error"]
            except (ValueError, KeyError, TypeError):
                raise AssertionError(f"{status} not in the OpenAI error shape: {path} {method} {header} "
                                     f"{body[:200]!r} -> {raw[:300]!r}") from None
            assert set(error) == {"message", "type", "param", "code"} and error["message"], raw[:300]

    one()
    assert seen["count"] >= REQUESTS
    assert answer(orchestrator) == before and answer(worker) == before
