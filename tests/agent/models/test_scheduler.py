"""What the model scheduler (:mod:`agent.models.scheduler`) carries out, on in-process agents
serving copies of the tiny model (the router's own scheduler, its real registry, catalog and
orchestrator):

- Ollama's keep_alive: how long an idle model stays loaded; 0 unloads an idle model at once
  (never one serving a request), or, from a request that may not change the cluster, only
  gives the model its own idle rule back; a negative value keeps it loaded;
- the run loop puts a model idle past its keep-alive to sleep, and forgets the keep-alive;
- a load is recorded with its duration and follows the nodes that hold its order; one whose
  weights are gone fails with the reason, in the event log and the model events;
- a stop that outlasts the model's stop timeout, or fails, still counts as unloaded;
- a router that stopped takes no more work; a tick on a node that does not lead only wakes
  the waiters.
"""

from __future__ import annotations

import asyncio
import inspect
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from agent.core.errors import ClusterError, ModelLoadError
from agent.http.app_keys import ROUTER, WORKER
from agent.local.events import ClusterEvent
from agent.models.router import ModelRouter
from tests.agent.inprocess import LocalAgent, eventually
from tests.agent.tiny import TINY, tiny_cluster

B = "tiny-b"


def router_of(agent: LocalAgent) -> ModelRouter:
    return agent.app[ROUTER]


def state(agent: LocalAgent, name: str) -> str:
    return str(router_of(agent).registry.entries[name].state)


def recorded(agent: LocalAgent, kind: str, model: str) -> list[ClusterEvent]:
    return [e for e in router_of(agent).scheduler.events.history if e.kind == kind and e.model == model]


def drain(queue: asyncio.Queue[dict[str, Any]]) -> list[dict[str, Any]]:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def presets(tmp: Path, text: str) -> Path:
    path = tmp / "models.ini"
    path.write_text(text)
    return path


def test_keep_alive_sets_how_long_an_idle_model_stays_loaded(tmp_path):
    async def scenario() -> None:
        file = presets(tmp_path, f"[{TINY}]\nsleep-idle-seconds = 600\n")
        async with tiny_cluster(tmp_path, 1, models_preset=file) as (leader, _):
            scheduler = router_of(leader).scheduler
            assert scheduler.sleeps_after_s(TINY) == 600.0  # the preset's idle rule
            scheduler.keep_alive(TINY, 2.5)
            assert scheduler.sleeps_after_s(TINY) == 2.5
            scheduler.keep_alive(TINY, -1)
            assert scheduler.sleeps_after_s(TINY) == 0.0  # never
            scheduler.keep_alive(TINY, 0, unload=False)  # a request that may not change the cluster
            assert scheduler.sleeps_after_s(TINY) == 600.0 and state(leader, TINY) == "ready"
            assert not router_of(leader).registry.entries[TINY].stopping
            assert scheduler.sleeps_after_s("not-a-model") == 0.0

    asyncio.run(scenario())


def test_keep_alive_zero_unloads_an_idle_model_at_once_and_records_why(tmp_path):
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 1) as (leader, _):
            router = router_of(leader)
            scheduler = router.scheduler
            assert TINY in leader.app[WORKER].status()["models"]
            with scheduler.model_events.subscribe() as queue:
                drain(queue)
                scheduler.keep_alive(TINY, 0)
                assert router.registry.entries[TINY].stopping  # the stop began at once
                await eventually(lambda: state(leader, TINY) == "unloaded", timeout_s=10, what="tiny unloaded")
                changes = [e for e in drain(queue) if e["model"] == TINY]
            reason = "unloaded after the request (keep_alive 0)"
            assert changes[-1]["state"] == "unloaded" and changes[-1]["detail"] == reason, changes
            [unload] = recorded(leader, "unload", TINY)
            assert unload.message == f"{TINY}: {reason}" and unload.duration_s is not None and unload.duration_s >= 0
            assert TINY not in router.orchestrator.deployments
            assert TINY not in leader.app[WORKER].status()["models"]  # the worker let go of its fragments

    asyncio.run(scenario())


def test_keep_alive_zero_leaves_a_model_serving_a_request_loaded(tmp_path):
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 1) as (leader, _):
            router = router_of(leader)
            scheduler = router.scheduler
            scheduler.keep_alive(TINY, 30)
            async with router.use(TINY, client="tester"):
                scheduler.keep_alive(TINY, 0)  # no preemption: the model is busy
                entry = router.registry.entries[TINY]
                assert entry.state == "ready" and not entry.stopping and entry.active_requests == 1
            assert scheduler.sleeps_after_s(TINY) == 0.0  # its keep-alive of 30 s is dropped all the same
            assert state(leader, TINY) == "ready" and recorded(leader, "unload", TINY) == []

    asyncio.run(scenario())


def test_the_run_loop_puts_a_model_idle_past_its_keep_alive_to_sleep_and_forgets_the_keep_alive(tmp_path):
    async def scenario() -> None:
        file = presets(tmp_path, f"[{TINY}]\nsleep-idle-seconds = 1\n\n[{B}]\nsleep-idle-seconds = 1\n")
        async with tiny_cluster(tmp_path, 1, names=(TINY, B), models_preset=file) as (leader, _):
            router = router_of(leader)
            scheduler = router.scheduler
            scheduler.keep_alive(TINY, -1)  # kept loaded, however long it is idle
            await asyncio.wait_for(router.load(B), timeout=30)  # used after tiny: idle for less time than tiny
            await eventually(lambda: state(leader, B) == "sleeping", timeout_s=10, what=f"{B} asleep after 1 s idle")
            assert state(leader, TINY) == "ready"  # idle for longer than its 1 s, kept by its keep-alive
            [sleep] = recorded(leader, "sleep", B)
            assert sleep.message == f"{B}: idle"
            assert B not in leader.app[WORKER].status()["models"]
            assert scheduler.sleeps_after_s(B) == 1.0

            scheduler.keep_alive(TINY, 0.5)
            await eventually(lambda: state(leader, TINY) == "sleeping", timeout_s=10,
                             what="tiny asleep after its keep-alive")
            assert recorded(leader, "sleep", TINY)[0].message == f"{TINY}: idle"
            assert scheduler.sleeps_after_s(TINY) == 1.0  # the keep-alive went with the stop: its preset's rule

    asyncio.run(scenario())


def test_a_load_is_recorded_with_its_duration_and_follows_the_nodes_holding_its_order(tmp_path):
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, names=(TINY, B)) as (leader, (follower,)):
            router = router_of(leader)
            scheduler = router.scheduler
            assert scheduler.progress(B) == 0.0
            with scheduler.model_events.subscribe() as queue:
                drain(queue)
                started = time.monotonic()
                await asyncio.wait_for(router.load(B), timeout=30)
                took = time.monotonic() - started
                changes = [e for e in drain(queue) if e["model"] == B]
            states = [e["state"] for e in changes]
            assert states[0] == "measuring" and states[-1] == "ready", states
            assert [e["progress"] for e in changes if e["state"] == "loading"] == [0.0, 0.5, 1.0]  # node by node
            assert scheduler.progress(B) == 1.0
            [load] = recorded(leader, "load", B)
            assert load.message == f"{B} loaded" and 0 < load.duration_s <= took
            assert recorded(leader, "load_failed", B) == []

            # the follower's scheduler decides nothing (it does not lead) but wakes its waiters
            other = router_of(follower).scheduler
            waiting = other.changed
            other.tick()
            assert waiting.is_set() and not other.changed.is_set()
            assert router_of(follower).registry.entries == {}

    asyncio.run(scenario())


def test_a_load_whose_weights_are_gone_fails_with_the_reason_recorded(tmp_path):
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 1, names=(TINY, "gone"), allow_fallback=False) as (leader, _):
            router = router_of(leader)
            shutil.rmtree(tmp_path / "home-0" / "models" / "gone")
            with router.scheduler.model_events.subscribe() as queue:
                drain(queue)
                with pytest.raises(ModelLoadError) as failed:
                    await asyncio.wait_for(router.load("gone"), timeout=30)
                changes = [e for e in drain(queue) if e["model"] == "gone"]
            assert "no live node stores the weights of 'gone'" in str(failed.value)
            assert failed.value.retry_after_s is None  # not before a node that stores them joins
            entry = router.registry.entries["gone"]
            assert entry.state == "failed" and "no live node stores the weights of 'gone'" in entry.reason
            assert changes[-1]["state"] == "failed"
            [event] = recorded(leader, "load_failed", "gone")
            assert event.message.startswith("gone failed to load: no live node stores the weights of 'gone'")
            assert state(leader, TINY) == "ready"

    asyncio.run(scenario())


def test_a_stop_that_outlasts_its_timeout_or_fails_still_counts_as_unloaded(tmp_path):
    async def scenario() -> None:
        file = presets(tmp_path, f"[{TINY}]\nstop-timeout = 0.3\n")
        async with tiny_cluster(tmp_path, 1, names=(TINY, B), models_preset=file) as (leader, _):
            router = router_of(leader)
            await asyncio.wait_for(router.load(B), timeout=30)
            orchestrator = router.orchestrator
            asked: list[tuple[str, bool]] = []
            never = asyncio.Event()

            async def stuck_or_failing(name: str, *, keep_plan: bool = False) -> None:
                asked.append((name, keep_plan))
                if name == B:
                    raise ClusterError("the workers could not be reached")
                await never.wait()  # a worker that never answers

            orchestrator.unload = stuck_or_failing  # type: ignore[method-assign]
            started = time.monotonic()
            await asyncio.wait_for(router.unload(TINY), timeout=10)
            assert 0.3 <= time.monotonic() - started < 5  # the stop timeout, not the worker, ended it
            await asyncio.wait_for(router.unload(B), timeout=10)
            assert asked == [(TINY, False), (B, False)]
            assert state(leader, TINY) == state(leader, B) == "unloaded"
            [tiny_stop] = recorded(leader, "unload", TINY)
            assert tiny_stop.duration_s is not None and tiny_stop.duration_s >= 0.3
            assert len(recorded(leader, "unload", B)) == 1
            never.set()

    asyncio.run(scenario())


def test_a_router_that_stopped_takes_no_more_work(tmp_path):
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 1) as (leader, _):
            scheduler = router_of(leader).scheduler
        work = asyncio.sleep(0)
        with pytest.raises(ClusterError, match="the model router is not running"):
            scheduler.spawn(work, "late work")
        assert inspect.getcoroutinestate(work) == inspect.CORO_CLOSED  # closed, never left pending

    asyncio.run(scenario())
