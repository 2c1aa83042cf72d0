"""Admission control on real in-process agents serving a tiny random model: per model, a limit
of requests in flight and a bounded FIFO queue; beyond them 429 with Retry-After, in the
OpenAI error shape, also through an agent that passes the request on to the orchestrator.

The model is :mod:`tests.agent.tiny`'s. A request is held in
flight by a gate in front of the orchestrator's generation; everything else is the real path.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from agent.http.app_keys import ORCHESTRATOR, ROUTER
from tests.agent.inprocess import LocalAgent, call, eventually
from tests.agent.tiny import TINY, tiny_cluster


class Gate:
    """Holds every generation on the orchestrator until opened; records the prompts in the
    order their generation began (the order requests were admitted)."""

    def __init__(self, orchestrator: LocalAgent) -> None:
        self.opened = asyncio.Event()
        self.started: list[str] = []
        self._orchestrator = orchestrator.app[ORCHESTRATOR]
        self._complete = self._orchestrator.complete
        self._orchestrator.complete = self._gated

    async def _gated(self, deployment: Any, prompt_ids: list[int], params: Any, generated: Any = (),
                     **options: Any) -> AsyncIterator[Any]:
        self.started.append(f"w{prompt_ids[-1]}")  # the prompts are one word: w<id>
        await self.opened.wait()
        async for event in self._complete(deployment, prompt_ids, params, generated, **options):
            yield event

    def open(self) -> None:
        self.opened.set()


async def complete(url: str, prompt: str, *, stream: bool = False, model: str = TINY, timeout_s: float = 30.0,
                   source: str = "127.0.0.1", headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    """POST /v1/completions from the loopback address ``source`` (a device of its own: a client
    of its own): (status, headers, JSON body, or the event lines when streaming)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": stream}
    connector = aiohttp.TCPConnector(local_addr=(source, 0))
    async with aiohttp.ClientSession(connector=connector) as session, session.post(
            url + "/v1/completions", json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s),
    ) as response:
        text = await response.text()
        if response.content_type == "text/event-stream":
            answer: Any = [line for line in text.splitlines() if line.startswith("data: ")]
        else:
            answer = json.loads(text)
        return response.status, dict(response.headers), answer


def test_one_in_flight_one_queued_and_the_third_gets_429_with_retry_after(tmp_path):
    """In flight 1, queue 1: a streamed request runs, a plain one passed on by another agent
    waits and is served after it, a third one (also passed on) gets 429 at once."""

    async def scenario():
        async with tiny_cluster(tmp_path, max_requests_in_flight=1, max_queued_requests=1) as (leader, others):
            router = leader.app[ROUTER]
            gate = Gate(leader)
            first = asyncio.create_task(complete(leader.url, "w5", stream=True))
            await eventually(lambda: gate.started == ["w5"], timeout_s=10, what="the first request in flight")
            second = asyncio.create_task(complete(others[0].url, "w6"))
            await eventually(lambda: router.admission.queued(TINY) == 1, timeout_s=10, what="the second queued")

            status, headers, answer = await complete(others[0].url, "w7")
            assert status == 429, answer
            assert set(answer["error"]) == {"message", "type", "param", "code"}
            assert answer["error"]["code"] == "rate_limit_exceeded" and answer["error"]["type"] == "requests"
            assert "max_requests_in_flight=1" in answer["error"]["message"]
            assert int(headers["Retry-After"]) >= 1
            assert gate.started == ["w5"] and not second.done()  # the queued one waits its turn
            info = {m["id"]: m for m in router.models()}[TINY]
            assert (info["requests_in_flight"], info["queued_requests"]) == (1, 1)

            gate.open()
            status, _, lines = await first
            assert status == 200 and lines[-1] == "data: [DONE]"
            status, _, answer = await second
            assert status == 200 and answer["model"] == TINY, answer
            assert gate.started == ["w5", "w6"]
            assert router.admission.in_flight(TINY) == 0 and router.admission.queued(TINY) == 0

    asyncio.run(scenario())


def test_the_queue_is_fifo_and_a_client_that_leaves_gives_up_its_place(tmp_path):
    async def scenario():
        async with tiny_cluster(tmp_path, max_requests_in_flight=1, max_queued_requests=3) as (leader, others):
            router = leader.app[ROUTER]
            gate = Gate(leader)
            # Each prompt wN comes from its own device (127.0.0.N): one client each.
            tasks = {"w5": asyncio.create_task(complete(leader.url, "w5", source="127.0.0.5"))}
            await eventually(lambda: gate.started == ["w5"], timeout_s=10, what="the first request in flight")
            senders = {"w6": leader, "w7": others[0], "w8": leader}
            for queued, prompt in enumerate(senders, start=1):  # one at a time: a known order
                tasks[prompt] = asyncio.create_task(complete(senders[prompt].url, prompt, stream=prompt == "w8",
                                                             source=f"127.0.0.{prompt[1:]}"))
                await eventually(lambda n=queued: router.admission.queued(TINY) == n, timeout_s=10,
                                 what=f"{queued} request(s) queued")
            status, headers, _ = await complete(leader.url, "w9", source="127.0.0.9")
            assert status == 429 and "Retry-After" in headers

            tasks.pop("w7").cancel()  # its client hangs up while it waits (its request came through another agent)
            await eventually(lambda: router.admission.queued(TINY) == 2, timeout_s=10, what="w7 out of the queue")
            tasks["w10"] = asyncio.create_task(complete(others[0].url, "w10", source="127.0.0.10"))  # its place is free
            await eventually(lambda: router.admission.queued(TINY) == 3, timeout_s=10, what="w10 queued")

            gate.open()
            results = {prompt: await task for prompt, task in tasks.items()}
            assert all(status == 200 for status, _, _ in results.values()), results
            assert gate.started == ["w5", "w6", "w8", "w10"]  # first come, first served; w7 never ran
            # the hang-up counts as such on the agent it reached, not as a server error
            metrics = (await call("GET", others[0].url + "/metrics"))[1]
            assert 'endpoint="/v1/completions",model="",status="499"} 1.0' in metrics, metrics
            assert 'status="500"' not in metrics

    asyncio.run(scenario())


def test_six_streams_of_one_app_cannot_block_a_seventh_client(tmp_path):
    """One app opens six streams that hold their slots (4 in flight, 32 queued): it gets
    three slots and waits with the rest; a request of another device starts
    at once. All go through an agent that passes them on: the orchestrator counts each for
    the device the agent saw (X-Ncm-Client), not for the agent."""

    async def scenario():
        async with tiny_cluster(tmp_path, max_requests_in_flight=4) as (leader, others):
            router = leader.app[ROUTER]
            gate = Gate(leader)
            app = [asyncio.create_task(complete(others[0].url, f"w{n}", stream=True, source="127.0.0.20"))
                   for n in range(5, 11)]
            await eventually(lambda: len(gate.started) == 3 and router.admission.queued(TINY) == 3, timeout_s=10,
                             what="three of the app's streams in flight and three queued")
            neighbour = asyncio.create_task(complete(others[0].url, "w11", source="127.0.0.21"))
            await eventually(lambda: "w11" in gate.started, timeout_s=10, what="the other device's request to start")
            assert len(gate.started) == 4 and router.admission.queued(TINY) == 3
            gate.open()
            results = [await task for task in (*app, neighbour)]
            assert all(status == 200 for status, _, _ in results), results
            assert sorted(gate.started) == sorted(f"w{n}" for n in range(5, 12))

    asyncio.run(scenario())


def test_a_client_cannot_pose_as_many_by_naming_itself(tmp_path):
    """X-Ncm-Client counts only from a member (on the peer port): an app that sends it with
    every request is still one client."""

    async def scenario():
        async with tiny_cluster(tmp_path, max_requests_in_flight=4) as (leader, _):
            router = leader.app[ROUTER]
            gate = Gate(leader)
            app = [asyncio.create_task(complete(leader.url, f"w{n}", source="127.0.0.30",
                                                headers={"X-Ncm-Client": f"address:10.0.0.{n}"}))
                   for n in range(5, 10)]
            await eventually(lambda: len(gate.started) == 3 and router.admission.queued(TINY) == 2, timeout_s=10,
                             what="three in flight and two queued, as for one client")
            gate.open()
            assert all(status == 200 for status, _, _ in [await task for task in app])

    asyncio.run(scenario())


def test_by_default_a_model_runs_as_many_requests_as_its_kv_memory_holds(tmp_path):
    """With max_requests_in_flight 0 (the default) a loaded model's count comes from the room
    its stages have for KV caches at full context: the tiny model's are small beside this
    machine's memory, so it runs the most, 8, from 8 devices at once, and says so."""

    async def scenario():
        async with tiny_cluster(tmp_path) as (leader, others):
            router = leader.app[ROUTER]
            assert router.config.max_requests_in_flight == 0
            gate = Gate(leader)
            requests = [asyncio.create_task(complete(others[0].url, f"w{n}", source=f"127.0.0.{40 + n}"))
                        for n in range(5, 14)]
            await eventually(lambda: len(gate.started) == 8 and router.admission.queued(TINY) == 1, timeout_s=30,
                             what="eight requests in flight and the ninth queued")
            status, models = await call("GET", leader.url + "/models")
            model = next(m for m in models["data"] if m["id"] == TINY)
            assert status == 200 and model["max_requests_in_flight"] == 8 and model["requests_in_flight"] == 8
            gate.open()
            assert all(status == 200 for status, _, _ in [await task for task in requests])

    asyncio.run(scenario())
