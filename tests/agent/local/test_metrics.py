"""agent.local.metrics, its own objects (``/metrics`` over HTTP is tests/agent/http/
test_metrics_endpoint.py): what each kind of cluster event counts, how a generation is timed
and counted while its events pass through unchanged (the clock is a parameter: the tests move
it by hand), the throughput window, the gauges read from the live state at each scrape (the
models' only on the orchestrator) and the seconds each model was served degraded. Each Metrics
has a registry of its own, in Prometheus' text format."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.local.events import KINDS, ClusterEvent, EventLog
from agent.local.metrics import THROUGHPUT_WINDOW_S, ClusterStateCollector, Metrics
from agent.orchestration.token_loop import Completion

MODEL = "smollm2-135m"
QUARTERS = st.integers(0, 40).map(lambda n: n / 4)  # exact in binary: sums of clock steps stay exact


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def samples(metrics_or_registry: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the registry as Prometheus scrapes it (the text format, parsed)."""
    registry = getattr(metrics_or_registry, "registry", metrics_or_registry)
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def moved(before: dict, after: dict) -> dict:
    """The samples whose value changed (new ones included), by how much."""
    return {key: value - before.get(key, 0.0) for key, value in after.items() if value != before.get(key, 0.0)}


# what one event of each kind moves, besides ncm_cluster_events_total{kind}
EXPECTED_COUNTS: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {
    "join": {}, "death": {}, "election": {}, "corrupt": {},
    "failover": {("ncm_failovers_total", (("model", "m"),)): 1.0,
                 ("ncm_failover_seconds_count", (("model", "m"),)): 1.0,
                 ("ncm_failover_seconds_sum", (("model", "m"),)): 2.5},
    "degraded": {("ncm_failovers_total", (("model", "m"),)): 1.0,
                 ("ncm_failover_seconds_count", (("model", "m"),)): 1.0,
                 ("ncm_failover_seconds_sum", (("model", "m"),)): 2.5},
    "replan": {("ncm_replans_total", (("model", "m"),)): 1.0},
    "recovered": {("ncm_replans_total", (("model", "m"),)): 1.0},
    "load": {("ncm_model_loads_total", (("model", "m"), ("outcome", "loaded"))): 1.0,
             ("ncm_model_load_seconds_count", (("model", "m"),)): 1.0,
             ("ncm_model_load_seconds_sum", (("model", "m"),)): 2.5},
    "load_failed": {("ncm_model_loads_total", (("model", "m"), ("outcome", "failed"))): 1.0},
    **{how: {("ncm_model_stops_total", (("how", how), ("model", "m"))): 1.0,
             ("ncm_model_stop_seconds_count", (("how", how),)): 1.0,
             ("ncm_model_stop_seconds_sum", (("how", how),)): 2.5} for how in ("unload", "sleep", "evict")},
}


def test_every_event_kind_has_its_expected_counts() -> None:
    assert set(EXPECTED_COUNTS) == set(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_an_event_moves_its_kinds_counter_and_the_counts_of_its_kind_only(kind: str) -> None:
    metrics = Metrics(clock=Clock())
    before = samples(metrics)
    metrics.count_event(ClusterEvent(kind, "what happened", 1.0, node="n", model="m", duration_s=2.5))
    changes = moved(before, samples(metrics))
    changes = {key: value for key, value in changes.items() if not key[0].endswith("_bucket")
               and not key[0].endswith("_created")}
    assert changes == {("ncm_cluster_events_total", (("kind", kind),)): 1.0, **EXPECTED_COUNTS[kind]}


@pytest.mark.parametrize("kind", ["failover", "load", "sleep"])
def test_an_event_without_a_duration_is_counted_but_not_timed(kind: str) -> None:
    metrics = Metrics(clock=Clock())
    metrics.count_event(ClusterEvent(kind, "no duration measured", 1.0, model="m"))
    after = samples(metrics)
    assert all(value == 0.0 for (name, _), value in after.items() if name.endswith("_seconds_count"))
    assert after[("ncm_cluster_events_total", (("kind", kind),))] == 1.0


def test_an_event_about_no_model_is_counted_under_an_empty_model_label() -> None:
    metrics = Metrics(clock=Clock())
    metrics.count_event(ClusterEvent("replan", "re-planned", 1.0))
    assert metrics.registry.get_sample_value("ncm_replans_total", {"model": ""}) == 1.0


def test_an_event_log_listener_counts_what_is_recorded() -> None:
    metrics = Metrics(clock=Clock())
    events = EventLog(clock=Clock())
    events.listen(metrics.count_event)
    for kind in ("join", "join", "death", "load"):
        events.record(kind, kind, model="m")
    get = metrics.registry.get_sample_value
    assert [get("ncm_cluster_events_total", {"kind": k}) for k in ("join", "death", "load")] == [2.0, 1.0, 1.0]


def test_child_looks_a_labelled_metric_up_once_and_counts_into_it() -> None:
    metrics = Metrics(clock=Clock())
    first = metrics.child(metrics.generated_tokens, "a")
    assert metrics.child(metrics.generated_tokens, "a") is first
    assert metrics.child(metrics.generated_tokens, "b") is not first
    assert metrics.child(metrics.prompt_tokens, "a") is not first  # another metric, same labels
    first.inc(3)
    metrics.child(metrics.generated_tokens, "a").inc(2)
    assert metrics.registry.get_sample_value("ncm_generated_tokens_total", {"model": "a"}) == 5.0
    assert metrics.registry.get_sample_value("ncm_generated_tokens_total", {"model": "b"}) == 0.0


def test_agents_in_one_process_keep_their_figures_apart() -> None:
    one, other = Metrics(clock=Clock()), Metrics(clock=Clock())
    one.requests.labels("/v1/completions", MODEL, "200").inc()
    one.count_event(ClusterEvent("death", "b died", 1.0, node="b"))
    assert samples(other).get(("ncm_requests_total", (("endpoint", "/v1/completions"), ("model", MODEL),
                                                      ("status", "200")))) is None
    assert other.registry.get_sample_value("ncm_cluster_events_total", {"kind": "death"}) is None
    assert one.registry.get_sample_value("ncm_cluster_events_total", {"kind": "death"}) == 1.0


async def timed_source(clock: Clock, script: list[tuple[float, Completion]], closed: list[str]) -> AsyncIterator[Any]:
    """A generation's events, each at its time on ``clock``; notes in ``closed`` that it was closed."""
    try:
        for at, event in script:
            clock.now = at
            yield event
    finally:
        closed.append("closed")


def run_generation(metrics: Metrics, clock: Clock, script: list[tuple[float, Completion]]) -> list[Any]:
    async def scenario() -> list[Any]:
        closed: list[str] = []
        passed = [event async for event in metrics.observe_generation(MODEL, timed_source(clock, script, closed))]
        assert closed == ["closed"]
        return passed

    return asyncio.run(scenario())


def test_a_generation_is_timed_and_counted_and_its_events_pass_unchanged() -> None:
    clock = Clock(100.0)
    script = [
        (100.5, Completion("", MODEL)),  # the role event: no token yet
        (101.0, Completion("Hel", MODEL, tokens=(11,))),  # the first token, 1 s after the start
        (101.5, Completion("lo", MODEL, tokens=(12,))),  # 0.5 s
        (102.5, Completion(" wor", MODEL, tokens=(13, 14))),  # two tokens in 1 s: 0.5 s each
        (102.75, Completion("ld", MODEL)),  # text without its ids: one token, 0.25 s
        (103.0, Completion("", MODEL, finish_reason="stop", prompt_tokens=7, completion_tokens=5)),
    ]
    metrics = Metrics(clock=clock)
    passed = run_generation(metrics, clock, script)
    assert passed == [event for _, event in script] and all(a is b for a, (_, b) in zip(passed, script))
    get = metrics.registry.get_sample_value
    labels = {"model": MODEL}
    assert get("ncm_time_to_first_token_seconds_count", labels) == 1.0
    assert get("ncm_time_to_first_token_seconds_sum", labels) == 1.0
    assert get("ncm_token_latency_seconds_count", labels) == 4.0
    assert get("ncm_token_latency_seconds_sum", labels) == 1.75
    assert get("ncm_token_latency_seconds_bucket", {**labels, "le": "0.25"}) == 1.0
    assert get("ncm_token_latency_seconds_bucket", {**labels, "le": "0.5"}) == 4.0
    assert get("ncm_generated_tokens_total", labels) == 5.0
    assert get("ncm_prompt_tokens_total", labels) == 7.0


def test_throughput_counts_the_tokens_of_the_last_ten_seconds() -> None:
    clock = Clock(100.0)
    metrics = Metrics(clock=clock)
    assert metrics.tokens_per_s() == 0.0
    run_generation(metrics, clock, [(101.0, Completion("a", MODEL, tokens=(1,))),
                                    (101.5, Completion("b", MODEL, tokens=(2, 3))),
                                    (103.0, Completion("c", MODEL, tokens=(4, 5, 6, 7)))])
    assert metrics.tokens_per_s() == 7 / THROUGHPUT_WINDOW_S
    clock.now = 101.0 + THROUGHPUT_WINDOW_S  # the first event is exactly at the window's edge: still in
    assert metrics.tokens_per_s() == 7 / THROUGHPUT_WINDOW_S
    clock.now = 111.25
    assert metrics.tokens_per_s() == 6 / THROUGHPUT_WINDOW_S
    clock.now = 113.0
    assert metrics.tokens_per_s() == 4 / THROUGHPUT_WINDOW_S
    clock.now = 113.25
    assert metrics.tokens_per_s() == 0.0


def test_a_generation_left_early_closes_its_source_and_counts_what_was_seen() -> None:
    async def scenario() -> tuple[list[str], Metrics]:
        clock = Clock(100.0)
        metrics = Metrics(clock=clock)
        closed: list[str] = []
        script = [(100.5 + n, Completion(f"t{n}", MODEL, tokens=(n,))) for n in range(10)]
        observed = metrics.observe_generation(MODEL, timed_source(clock, script, closed))
        seen = []
        async for event in observed:
            seen.append(event.text)
            if len(seen) == 3:
                break  # the client went away
        await observed.aclose()
        assert seen == ["t0", "t1", "t2"]
        return closed, metrics

    closed, metrics = asyncio.run(scenario())
    assert closed == ["closed"]
    assert metrics.registry.get_sample_value("ncm_generated_tokens_total", {"model": MODEL}) == 3.0
    assert metrics.registry.get_sample_value("ncm_prompt_tokens_total", {"model": MODEL}) is None  # no finish seen


def test_a_generation_that_fails_passes_its_error_on_and_closes_its_source() -> None:
    async def scenario() -> tuple[list[str], list[str]]:
        clock = Clock(100.0)
        closed: list[str] = []

        async def failing() -> AsyncIterator[Any]:
            try:
                clock.now = 101.0
                yield Completion("a", MODEL, tokens=(1,))
                raise RuntimeError("a stage was lost")
            finally:
                closed.append("closed")

        seen: list[str] = []
        with pytest.raises(RuntimeError, match="a stage was lost"):
            async for event in Metrics(clock=clock).observe_generation(MODEL, failing()):
                seen.append(event.text)
        return seen, closed

    assert asyncio.run(scenario()) == (["a"], ["closed"])


token_events = st.lists(st.tuples(QUARTERS, st.integers(0, 4), st.booleans()), min_size=1, max_size=15)


@given(token_events)
def test_every_token_is_counted_once_and_the_gaps_between_events_add_up(steps: list[tuple[float, int, bool]]) -> None:
    """Whatever the events: the tokens generated are all counted, the first is timed from the
    start, and the times of the tokens after it add up to the time from the first to the last
    (tokens that came with the first, a speculative step's, count no time: not the prefill's)."""
    clock = Clock(0.0)
    script: list[tuple[float, Completion]] = []
    now = 0.0
    for index, (step, count, text) in enumerate(steps):
        now += step
        script.append((now, Completion("x" if text else "", MODEL, tokens=tuple(range(count)),
                                       finish_reason="stop" if index == len(steps) - 1 else None)))
    metrics = Metrics(clock=clock)
    run_generation(metrics, clock, script)

    with_tokens = [(at, len(e.tokens) or (1 if e.text else 0)) for at, e in script if e.tokens or e.text]
    total = sum(count for _, count in with_tokens)
    get = metrics.registry.get_sample_value
    labels = {"model": MODEL}
    assert get("ncm_generated_tokens_total", labels) == total
    assert get("ncm_time_to_first_token_seconds_count", labels) == (1.0 if total else 0.0)
    assert get("ncm_token_latency_seconds_count", labels) == max(0, total - 1)
    if with_tokens:
        assert get("ncm_time_to_first_token_seconds_sum", labels) == with_tokens[0][0]
        assert get("ncm_token_latency_seconds_sum", labels) == pytest.approx(with_tokens[-1][0] - with_tokens[0][0])


class LiveState:
    """What the collector reads at each scrape, changed by the tests between scrapes."""

    def __init__(self) -> None:
        self.models: list[dict[str, Any]] = []
        self.degraded: set[str] = set()
        self.worker: dict[str, Any] = {}
        self.memory: dict[str, int] = {}
        self.alive = 1
        self.orchestrator = False

    def collector(self, clock: Clock) -> ClusterStateCollector:
        return ClusterStateCollector(
            models=lambda: self.models, degraded=lambda: set(self.degraded), worker_status=lambda: self.worker,
            device_memory=lambda: self.memory, alive_nodes=lambda: self.alive,
            is_orchestrator=lambda: self.orchestrator, clock=clock)


def test_a_worker_shows_its_own_gauges_and_no_models_state() -> None:
    state = LiveState()
    state.alive, state.memory = 3, {"total": 8 << 30, "free": 5 << 30}
    state.worker = {"models": {"b": {"memory_bytes": 300}, "a": {"memory_bytes": 1200}, "c": {}}}
    state.models = [{"id": "a", "state": "ready"}]  # known to the orchestrator only: not shown here
    metrics = Metrics(clock=Clock())
    metrics.registry.register(state.collector(Clock()))
    shown = samples(metrics)
    gauges = {key: value for key, value in shown.items() if key[0].startswith(("ncm_is_", "ncm_nodes", "ncm_device",
                                                                                 "ncm_fragment", "ncm_model_state"))}
    assert gauges == {
        ("ncm_is_orchestrator", ()): 0.0, ("ncm_nodes_alive", ()): 3.0,
        ("ncm_device_memory_bytes", (("kind", "free"),)): float(5 << 30),
        ("ncm_device_memory_bytes", (("kind", "total"),)): float(8 << 30),
        ("ncm_fragment_memory_bytes", (("model", "a"),)): 1200.0,
        ("ncm_fragment_memory_bytes", (("model", "b"),)): 300.0,
        ("ncm_fragment_memory_bytes", (("model", "c"),)): 0.0,
    }


def test_the_orchestrator_shows_each_models_state_memory_and_queues() -> None:
    state = LiveState()
    state.orchestrator = True
    state.degraded = {"big"}
    state.models = [
        {"id": "big", "state": "ready", "memory": {"effective_bytes": {"node-b": 700, "node-a": 900}},
         "queued_requests": 2, "requests_in_flight": 4, "waiters": 0},
        {"id": "small", "state": "loading", "memory": None, "waiters": 3},  # what is missing is 0
    ]
    clock = Clock()
    collector = state.collector(clock)
    collector.account()  # the degraded model as the last cluster event left it
    registry = Metrics(clock=clock).registry
    registry.register(collector)
    get = registry.get_sample_value
    assert get("ncm_is_orchestrator") == 1.0
    assert get("ncm_model_state", {"model": "big", "state": "ready"}) == 1.0
    assert get("ncm_model_state", {"model": "small", "state": "loading"}) == 1.0
    assert get("ncm_model_state", {"model": "small", "state": "ready"}) is None
    assert get("ncm_model_memory_bytes", {"model": "big", "node": "node-a"}) == 900.0
    assert get("ncm_model_memory_bytes", {"model": "big", "node": "node-b"}) == 700.0
    assert [get("ncm_queued_requests", {"model": m}) for m in ("big", "small")] == [2.0, 0.0]
    assert [get("ncm_requests_in_flight", {"model": m}) for m in ("big", "small")] == [4.0, 0.0]
    assert [get("ncm_model_waiters", {"model": m}) for m in ("big", "small")] == [0.0, 3.0]
    assert [get("ncm_model_degraded", {"model": m}) for m in ("big", "small")] == [1.0, 0.0]


def test_the_gauges_follow_the_live_state_from_one_scrape_to_the_next() -> None:
    state = LiveState()
    state.orchestrator = True
    state.models = [{"id": "m", "state": "loading"}]
    registry = Metrics(clock=Clock()).registry
    registry.register(state.collector(Clock()))
    assert registry.get_sample_value("ncm_model_state", {"model": "m", "state": "loading"}) == 1.0
    state.models = [{"id": "m", "state": "ready", "queued_requests": 1}]
    state.alive = 4
    assert registry.get_sample_value("ncm_model_state", {"model": "m", "state": "loading"}) is None
    assert registry.get_sample_value("ncm_model_state", {"model": "m", "state": "ready"}) == 1.0
    assert registry.get_sample_value("ncm_queued_requests", {"model": "m"}) == 1.0
    assert registry.get_sample_value("ncm_nodes_alive") == 4.0
    state.orchestrator = False  # another agent was elected: this one shows no models' states
    assert registry.get_sample_value("ncm_model_state", {"model": "m", "state": "ready"}) is None
    assert registry.get_sample_value("ncm_is_orchestrator") == 0.0


@given(st.lists(st.tuples(QUARTERS, st.sets(st.sampled_from(["a", "b", "c"])), st.booleans()), max_size=20))
def test_degraded_seconds_add_up_the_time_each_model_spent_degraded(
        changes: list[tuple[float, set[str], bool]]) -> None:
    """Each step: time passes, then the degraded models change and a cluster event accounts
    for it, or (unchanged) a scrape does. Each model's seconds are the time it spent degraded."""
    clock = Clock(0.0)
    state = LiveState()
    collector = state.collector(clock)
    registry = Metrics(clock=clock).registry
    registry.register(collector)
    expected = {"a": 0.0, "b": 0.0, "c": 0.0}
    for step, degraded, scrape in changes:
        clock.now += step
        for model in state.degraded:
            expected[model] += step
        if scrape:
            registry.get_sample_value("ncm_degraded_seconds_total", {"model": "a"})
        else:
            state.degraded = degraded
            collector.account(ClusterEvent("degraded" if degraded else "recovered", "change", clock.now))
    clock.now += 1.0
    for model in state.degraded:
        expected[model] += 1.0
    shown = samples(registry)
    for model, seconds in expected.items():
        assert shown.get(("ncm_degraded_seconds_total", (("model", model),)), 0.0) == seconds
