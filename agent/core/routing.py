"""Routes through the pipeline, failover and degraded mode (redundancy design §6–§7).

A route is the ordered list of hops a request takes: each hop is one node running a
contiguous range of layers. Routes are chosen by cost; when a node dies, its hops are
replaced in place by the cheapest live holders of the same layers, or, when some layer has
no live holder, the decision is to degrade onto a fallback model planned over the survivors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

from agent.core.errors import ClusterError, RoutingFailure, ShardingError
from agent.core.plan import LayerRange, ShardingPlan, make_plan

DEFAULT_LATENCY_MS = 5.0
DEFAULT_CAPACITY_SCORE = 1.0
DEFAULT_FALLBACK_MODEL = "ncm-tiny"


@dataclass(frozen=True)
class Telemetry:
    """What the orchestrator measured of a node: round-trip latency and current score."""

    latency_ms: float = DEFAULT_LATENCY_MS
    capacity_score: float = DEFAULT_CAPACITY_SCORE

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_ms) and self.latency_ms >= 0):
            raise ValueError(f"latency_ms must be finite and >= 0, got {self.latency_ms!r}")
        if not (math.isfinite(self.capacity_score) and self.capacity_score > 0):
            raise ValueError(f"capacity_score must be finite and > 0, got {self.capacity_score!r}")


DEFAULT_TELEMETRY = Telemetry()


@dataclass(frozen=True)
class Hop:
    node_id: str
    layers: LayerRange


@dataclass(frozen=True)
class Route:
    """Hops covering layers 0..L−1 in order. A node may appear in two non-adjacent hops."""

    hops: tuple[Hop, ...]

    def __post_init__(self) -> None:
        if not self.hops:
            raise ValueError("a route needs at least one hop")
        expected = 0
        for hop in self.hops:
            if hop.layers.first != expected:
                raise ValueError(f"route hops must be contiguous: {hop.node_id!r} starts at {hop.layers.first}, expected {expected}")
            expected = hop.layers.last + 1

    @property
    def total_layers(self) -> int:
        return self.hops[-1].layers.last + 1

    @property
    def nodes(self) -> tuple[str, ...]:
        """Distinct nodes of the route, in order of first appearance."""
        return tuple(dict.fromkeys(hop.node_id for hop in self.hops))

    def node_for_layer(self, layer: int) -> str:
        for hop in self.hops:
            if layer in hop.layers:
                return hop.node_id
        raise IndexError(f"layer {layer} is not on this route")

    def to_list(self) -> list[dict[str, object]]:
        return [{"node": hop.node_id, "layers": hop.layers.to_list()} for hop in self.hops]


def _telemetry(telemetry: Mapping[str, Telemetry], node_id: str) -> Telemetry:
    return telemetry.get(node_id, DEFAULT_TELEMETRY)


def node_cost(node_id: str, layer_count: int, telemetry: Mapping[str, Telemetry]) -> float:
    """Cost of one hop: entering the node (latency/100, as in the score) plus its layers."""
    measured = _telemetry(telemetry, node_id)
    return measured.latency_ms / 100.0 + layer_count / measured.capacity_score


def route_cost(route: Route, telemetry: Mapping[str, Telemetry] | None = None) -> float:
    """Total cost of a route; nodes without telemetry use DEFAULT_LATENCY_MS / DEFAULT_CAPACITY_SCORE."""
    telemetry = telemetry or {}
    return sum(node_cost(hop.node_id, hop.layers.size, telemetry) for hop in route.hops)


def live_holders(plan: ShardingPlan, layer: int, alive: Iterable[str]) -> tuple[str, ...]:
    """The holders of ``layer`` that are alive, primary first (dead holders dropped)."""
    alive_set = set(alive)
    return tuple(node_id for node_id in plan.holders(layer) if node_id in alive_set)


def _cheapest_segment(
    candidates: list[tuple[str, ...]], first_layer: int, telemetry: Mapping[str, Telemetry]
) -> list[Hop]:
    """Cheapest way through consecutive layers given each layer's candidate holders.

    Dynamic programme over layers: staying on a node adds 1/score per layer, switching to a
    node adds its latency/100 too (one more network hop). Ties go to the earlier candidate
    (the primary owner first), so the result is deterministic.
    """
    per_layer: list[dict[str, tuple[float, str | None]]] = []
    previous: dict[str, tuple[float, str | None]] = {}
    for holders in candidates:
        best_prev_node = min(previous, key=lambda n: previous[n][0], default=None)
        best_prev_cost = previous[best_prev_node][0] if best_prev_node is not None else 0.0
        current: dict[str, tuple[float, str | None]] = {}
        for node_id in holders:
            measured = _telemetry(telemetry, node_id)
            layer_cost = 1.0 / measured.capacity_score
            enter = best_prev_cost + measured.latency_ms / 100.0 + layer_cost
            choice: tuple[float, str | None] = (enter, best_prev_node)
            if node_id in previous and previous[node_id][0] + layer_cost <= enter:
                choice = (previous[node_id][0] + layer_cost, node_id)
            current[node_id] = choice
        per_layer.append(current)
        previous = current

    node = min(previous, key=lambda n: previous[n][0])
    owners: list[str] = []
    for table in reversed(per_layer):
        owners.append(node)
        node = table[node][1]  # type: ignore[assignment]
    owners.reverse()

    hops: list[Hop] = []
    for offset, node_id in enumerate(owners):
        layer = first_layer + offset
        if hops and hops[-1].node_id == node_id:
            hops[-1] = Hop(node_id, LayerRange(hops[-1].layers.first, layer))
        else:
            hops.append(Hop(node_id, LayerRange(layer, layer)))
    return hops


def _dedup_consecutive(hops: Iterable[Hop]) -> tuple[Hop, ...]:
    """Merge adjacent hops of the same node; a node that reappears later keeps its later hop."""
    merged: list[Hop] = []
    for hop in hops:
        if merged and merged[-1].node_id == hop.node_id:
            merged[-1] = Hop(hop.node_id, LayerRange(merged[-1].layers.first, hop.layers.last))
        else:
            merged.append(hop)
    return tuple(merged)


def _missing(plan: ShardingPlan, layers: Iterable[int], alive: set[str]) -> list[int]:
    return [layer for layer in layers if not live_holders(plan, layer, alive)]


def describe_layers(layers: list[int]) -> str:
    """'3-5, 9' for [3, 4, 5, 9]."""
    parts: list[str] = []
    for layer in layers:
        if parts and parts[-1][1] == layer - 1:
            parts[-1] = (parts[-1][0], layer)
        else:
            parts.append((layer, layer))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def choose_route(
    plan: ShardingPlan, alive: Iterable[str], telemetry: Mapping[str, Telemetry] | None = None
) -> Route:
    """The cheapest route over live holders; RoutingFailure when some layer has none."""
    alive_set = set(alive)
    candidates = [live_holders(plan, layer, alive_set) for layer in range(plan.total_layers)]
    missing = [layer for layer, holders in enumerate(candidates) if not holders]
    if missing:
        raise RoutingFailure(f"layers {describe_layers(missing)} have no live holder")
    return Route(_dedup_consecutive(_cheapest_segment(candidates, 0, telemetry or {})))


def forwarding_table(route: Route) -> dict[int, str | None]:
    """After the fragment that ends at layer L, which node serves L+1 (None after the last)."""
    table: dict[int, str | None] = {}
    for index, hop in enumerate(route.hops):
        table[hop.layers.last] = route.hops[index + 1].node_id if index + 1 < len(route.hops) else None
    return table


@dataclass(frozen=True)
class FailoverDecision:
    """What to do after nodes died on a route.

    ``degraded`` False: ``route`` is the spliced route on the same plan. ``degraded`` True:
    ``plan`` is the fallback model's plan over ``survivors`` and ``route`` its route.
    """

    route: Route
    degraded: bool
    lost_layers: tuple[int, ...] = ()
    plan: ShardingPlan | None = None
    model: str | None = None
    survivors: tuple[str, ...] = ()


def rebalance(
    plan: ShardingPlan, scores: Mapping[str, float], total_layers: int | None = None
) -> ShardingPlan:
    """Re-plan over ``scores``' nodes keeping the plan's layer count (or ``total_layers``),
    head ratio, replica count and minimum (§7, §8). A plan that does not fit is a ClusterError."""
    try:
        return make_plan(
            scores,
            plan.total_layers if total_layers is None else total_layers,
            replicate_head_ratio=plan.replicate_head_ratio,
            replica_count=plan.replica_count,
            min_layers_per_node=plan.min_layers_per_node,
        )
    except ShardingError as error:
        raise ClusterError(f"cannot re-plan over {len(scores)} node(s): {error}") from error


def failover(
    route: Route,
    dead: Iterable[str],
    plan: ShardingPlan,
    alive: Iterable[str],
    telemetry: Mapping[str, Telemetry] | None = None,
    *,
    allow_fallback: bool = True,
    fallback_model: str = DEFAULT_FALLBACK_MODEL,
    fallback_layers: int | None = None,
    survivor_scores: Mapping[str, float] | None = None,
) -> FailoverDecision:
    """Decide how to go on after ``dead`` nodes failed on ``route`` (§6, §7).

    1. If every layer the dead nodes served on this route has a live holder, each dead hop is
       replaced, in its position, by the cheapest live holders of its layers, and consecutive
       duplicates are merged (a node reappearing later keeps that hop): not degraded.
    2. Otherwise, with a fallback allowed, the live nodes of the route are the survivors and
       the fallback model (``fallback_layers`` layers, default the plan's) is rebalanced over
       them: degraded. No survivor: ClusterError.
    3. Otherwise RoutingFailure naming the uncovered layers.
    """
    telemetry = telemetry or {}
    dead_set = set(dead)
    alive_set = set(alive) - dead_set
    if route.total_layers != plan.total_layers:
        raise ValueError(f"route covers {route.total_layers} layers but the plan has {plan.total_layers}")
    lost = [layer for hop in route.hops if hop.node_id in dead_set for layer in range(hop.layers.first, hop.layers.last + 1)]
    if not lost:
        return FailoverDecision(route=route, degraded=False)

    missing = _missing(plan, lost, alive_set)
    if not missing:
        hops: list[Hop] = []
        for hop in route.hops:
            if hop.node_id not in dead_set:
                hops.append(hop)
                continue
            layers = range(hop.layers.first, hop.layers.last + 1)
            candidates = [live_holders(plan, layer, alive_set) for layer in layers]
            hops.extend(_cheapest_segment(candidates, hop.layers.first, telemetry))
        return FailoverDecision(route=Route(_dedup_consecutive(hops)), degraded=False, lost_layers=tuple(lost))

    if not allow_fallback:
        raise RoutingFailure(
            f"layers {describe_layers(missing)} have no live holder after losing "
            f"{', '.join(sorted(dead_set))} and no fallback model is allowed"
        )
    survivors = tuple(node_id for node_id in route.nodes if node_id in alive_set)
    if not survivors:
        raise ClusterError(f"no surviving node after losing {', '.join(sorted(dead_set))}")
    all_scores = dict(plan.scores) | dict(survivor_scores or {})
    fallback_plan = rebalance(plan, {n: all_scores[n] for n in survivors}, fallback_layers)
    return FailoverDecision(
        route=choose_route(fallback_plan, survivors, telemetry),
        degraded=True,
        lost_layers=tuple(lost),
        plan=fallback_plan,
        model=fallback_model,
        survivors=survivors,
    )


def standby_hops(
    plan: ShardingPlan, route: Route, alive: Iterable[str], telemetry: Mapping[str, Telemetry] | None = None
) -> dict[str, set[LayerRange]]:
    """Layer ranges each node would serve if any single node of ``route`` died.

    Workers build these fragments ahead of time, so that a failover needs no fragment build:
    only the replay of the request's tokens. Failures that would degrade add nothing.
    """
    alive_set = set(alive)
    standby: dict[str, set[LayerRange]] = {}
    for victim in route.nodes:
        try:
            decision = failover(route, [victim], plan, alive_set - {victim}, telemetry, allow_fallback=False)
        except RoutingFailure:
            continue
        for hop in decision.route.hops:
            standby.setdefault(hop.node_id, set()).add(hop.layers)
    return standby
