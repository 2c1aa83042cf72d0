"""What an agent measures, in Prometheus' format (`GET /metrics`, made by ``prometheus_client``).

Counters and histograms are updated where things happen: the API counts requests, the
generation of every answer is timed through :meth:`Metrics.observe_generation`, the worker
times its compute and its hops, and the cluster's events (failovers, re-plans, loads,
evictions) are counted as :mod:`agent.local.events` records them. Gauges of state (memory per model
and device, models' states, queues, degraded models) are read from the live objects when
Prometheus scrapes (:class:`ClusterStateCollector`). Each agent has a registry of its own, so
several agents in one process (the tests) do not mix their figures.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.local.events import ClusterEvent

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DURATION_BUCKETS_S = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
THROUGHPUT_WINDOW_S = 10.0


class Metrics:
    """The counters and histograms of one agent, in a registry of its own."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ncm_requests", "HTTP requests answered, by endpoint (route), model and status",
                                ["endpoint", "model", "status"], registry=r)
        self.time_to_first_token = Histogram(
            "ncm_time_to_first_token_seconds", "From the start of a generation to its first token (prefill included)",
            ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.token_latency = Histogram(
            "ncm_token_latency_seconds", "Time per generated token after the first", ["model"],
            buckets=LATENCY_BUCKETS_S, registry=r)
        self.generated_tokens = Counter("ncm_generated_tokens", "Tokens generated", ["model"], registry=r)
        self.prompt_tokens = Counter("ncm_prompt_tokens", "Prompt tokens of finished generations", ["model"], registry=r)
        self.step_latency = Histogram(
            "ncm_step_seconds", "A step through the whole route, from the orchestrator handing it to the head to "
            "the tail's result (subtract the stages' ncm_stage_compute_seconds for the network)", ["model"],
            buckets=LATENCY_BUCKETS_S, registry=r)
        self.draft_tokens = Counter(
            "ncm_draft_tokens", "Tokens drafted for speculative steps (by a draft model or prompt lookup), by "
            "outcome (drafted; kept: the model chose them too; ahead: a draft model's, written while the step before "
            "was verified)", ["model", "outcome"], registry=r)
        self.stage_compute = Histogram(
            "ncm_stage_compute_seconds", "Compute of one step on this node's fragment", ["model"],
            buckets=LATENCY_BUCKETS_S, registry=r)
        self.cluster_events = Counter("ncm_cluster_events", "Cluster events this agent recorded, by kind",
                                      ["kind"], registry=r)
        self.failovers = Counter("ncm_failovers", "Failovers of a model after a stage was lost (to replicas or to the "
                                 "fallback model)", ["model"], registry=r)
        self.failover_duration = Histogram("ncm_failover_seconds", "From a stage's loss to the new route's deployment",
                                           ["model"], buckets=DURATION_BUCKETS_S, registry=r)
        self.replans = Counter("ncm_replans", "Re-plans of a loaded model (a node joined, or came back)", ["model"],
                               registry=r)
        self.model_loads = Counter("ncm_model_loads", "Model loads, by outcome (loaded or failed)", ["model", "outcome"],
                                   registry=r)
        self.model_load_duration = Histogram("ncm_model_load_seconds", "Duration of successful model loads", ["model"],
                                             buckets=DURATION_BUCKETS_S, registry=r)
        self.model_stops = Counter("ncm_model_stops", "Models stopped, by how (unload, sleep, evict)", ["model", "how"],
                                   registry=r)
        self.model_stop_duration = Histogram("ncm_model_stop_seconds", "Duration of model stops (unload, sleep, evict)",
                                             ["how"], buckets=DURATION_BUCKETS_S, registry=r)
        self._tokens_at: deque[tuple[float, int]] = deque()  # (time, tokens) of the last THROUGHPUT_WINDOW_S
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once: the per-step paths call this."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    # --- events ------------------------------------------------------------------------------
    def count_event(self, event: ClusterEvent) -> None:
        """Count a cluster event (an :class:`~agent.local.events.EventLog` listener)."""
        self.cluster_events.labels(event.kind).inc()
        model = event.model or ""
        if event.kind in ("failover", "degraded"):
            self.failovers.labels(model).inc()
            if event.duration_s is not None:
                self.failover_duration.labels(model).observe(event.duration_s)
        elif event.kind in ("replan", "recovered"):
            self.replans.labels(model).inc()
        elif event.kind == "load":
            self.model_loads.labels(model, "loaded").inc()
            if event.duration_s is not None:
                self.model_load_duration.labels(model).observe(event.duration_s)
        elif event.kind == "load_failed":
            self.model_loads.labels(model, "failed").inc()
        elif event.kind in ("unload", "sleep", "evict"):
            self.model_stops.labels(model, event.kind).inc()
            if event.duration_s is not None:
                self.model_stop_duration.labels(event.kind).observe(event.duration_s)

    # --- generation --------------------------------------------------------------------------
    async def observe_generation(self, model: str, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """Pass on a generation's events (:class:`~agent.orchestration.orchestrator.Completion`), timing its
        first token and the tokens after it, and counting them."""
        first_token, per_token = self.child(self.time_to_first_token, model), self.child(self.token_latency, model)
        generated = self.child(self.generated_tokens, model)
        started = previous = self._clock()
        first = True
        try:
            async for event in events:
                now = self._clock()
                tokens = len(event.tokens) or (1 if event.text else 0)
                if tokens:
                    if first:  # tokens that came with the first (a speculative step's) took no time of their own
                        first_token.observe(now - started)
                        for _ in range(tokens - 1):
                            per_token.observe(0.0)
                        first = False
                    else:  # the time since the previous event, shared by the tokens it brought
                        for _ in range(tokens):
                            per_token.observe((now - previous) / tokens)
                    generated.inc(tokens)
                    self._tokens_at.append((now, tokens))
                    self._forget_tokens_before(now - THROUGHPUT_WINDOW_S)
                    previous = now
                if event.finish_reason is not None:
                    self.child(self.prompt_tokens, model).inc(event.prompt_tokens)
                yield event
        finally:
            await events.aclose()

    def _forget_tokens_before(self, cutoff: float) -> None:
        while self._tokens_at and self._tokens_at[0][0] < cutoff:
            self._tokens_at.popleft()

    def tokens_per_s(self) -> float:
        """Tokens generated per second over the last :data:`THROUGHPUT_WINDOW_S`."""
        self._forget_tokens_before(self._clock() - THROUGHPUT_WINDOW_S)
        return sum(count for _, count in self._tokens_at) / THROUGHPUT_WINDOW_S


class ClusterStateCollector(Collector):
    """Gauges read from the agent's live state at each scrape, and the seconds each model has
    been served degraded (accounted at every cluster event and scrape, when it can change)."""

    def __init__(self, *, models: Callable[[], list[dict[str, Any]]], degraded: Callable[[], set[str]],
                 worker_status: Callable[[], dict[str, Any]], device_memory: Callable[[], dict[str, int]],
                 alive_nodes: Callable[[], int], is_orchestrator: Callable[[], bool],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._models, self._degraded_now = models, degraded
        self._worker_status, self._device_memory = worker_status, device_memory
        self._alive_nodes, self._is_orchestrator = alive_nodes, is_orchestrator
        self._clock = clock
        self._degraded: set[str] = set()
        self._degraded_s: dict[str, float] = {}
        self._accounted_at = clock()

    def account(self, _event: ClusterEvent | None = None) -> None:
        """Add the time since the last accounting to the models that were degraded then."""
        now = self._clock()
        for model in self._degraded:
            self._degraded_s[model] = self._degraded_s.get(model, 0.0) + now - self._accounted_at
        self._accounted_at, self._degraded = now, self._degraded_now()

    def describe(self) -> Iterable[Metric]:
        return []  # the families depend on the state: not checked at registration

    def collect(self) -> Iterator[Metric]:
        self.account()
        orchestrator = self._is_orchestrator()
        yield _gauge("ncm_is_orchestrator", "1 on the agent that is the cluster's orchestrator", value=float(orchestrator))
        yield _gauge("ncm_nodes_alive", "Nodes this agent sees alive, itself included", value=self._alive_nodes())
        memory = self._device_memory()
        device = GaugeMetricFamily("ncm_device_memory_bytes", "This device's memory for fragments", labels=["kind"])
        for kind, value in sorted(memory.items()):
            device.add_metric([kind], value)
        yield device
        held = GaugeMetricFamily("ncm_fragment_memory_bytes", "Memory held by this node's fragments, per model",
                                 labels=["model"])
        for name, info in sorted((self._worker_status().get("models") or {}).items()):
            held.add_metric([name], info.get("memory_bytes", 0))
        yield held
        degraded_s = CounterMetricFamily("ncm_degraded_seconds", "Seconds each model was served degraded (by its "
                                         "fallback model)", labels=["model"])
        for model, seconds in sorted(self._degraded_s.items()):
            degraded_s.add_metric([model], seconds)
        yield degraded_s
        if not orchestrator:
            return  # the models' states and queues live on the orchestrator
        state = GaugeMetricFamily("ncm_model_state", "1 for each model's current state", labels=["model", "state"])
        memory_per_node = GaugeMetricFamily("ncm_model_memory_bytes", "Memory a model holds on each device",
                                            labels=["model", "node"])
        queued = GaugeMetricFamily("ncm_queued_requests", "Requests waiting for a slot of a model", labels=["model"])
        in_flight = GaugeMetricFamily("ncm_requests_in_flight", "Requests a model is serving", labels=["model"])
        waiters = GaugeMetricFamily("ncm_model_waiters", "Requests waiting for a model to load", labels=["model"])
        degraded = GaugeMetricFamily("ncm_model_degraded", "1 while a model is served by its fallback", labels=["model"])
        degraded_now = self._degraded
        for info in self._models():
            name = info["id"]
            state.add_metric([name, info["state"]], 1.0)
            held_bytes = (info.get("memory") or {}).get("effective_bytes") or {}
            for node, value in sorted(held_bytes.items()):
                memory_per_node.add_metric([name, node], value)
            queued.add_metric([name], info.get("queued_requests", 0))
            in_flight.add_metric([name], info.get("requests_in_flight", 0))
            waiters.add_metric([name], info.get("waiters", 0))
            degraded.add_metric([name], float(name in degraded_now))
        yield from (state, memory_per_node, queued, in_flight, waiters, degraded)


def _gauge(name: str, documentation: str, *, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
