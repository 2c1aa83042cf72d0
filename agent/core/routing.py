"""Routes through the pipeline, failover and degraded mode (design §6–§7).

A route is the ordered list of hops a request takes: each hop is one node running a
contiguous range of layers. Routes are chosen by cost; when a node dies, its hops are
replaced in place by the cheapest live holders of the same layers, or, when some layer has
no live holder, the decision is to degrade onto a fallback model planned over the survivors.

Costs are exact: latencies and scores count as exact rationals (a float as its shortest
decimal form, see :func:`agent.core.capacity.exact`), so routes of mathematically equal cost
really tie. Among them the route with fewer hops wins, then the earlier candidate (the
primary owner first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Iterable, Mapping

from agent.core.capacity import Number, exact, is_number
from agent.core.errors import ClusterError, RoutingFailure, ShardingError
from agent.core.plan import LayerRange, ShardingPlan, make_plan

DEFAULT_LATENCY_MS = 5.0
DEFAULT_CAPACITY_SCORE = 1.0
DEFAULT_FALLBACK_MODEL = "ncm-tiny"


def _finite(value: object) -> bool:
    return is_number(value) and not (isinstance(value, float) and not math.isfinite(value))


@dataclass(frozen=True)
class Telemetry:
    """What the orchestrator measured of a node: round-trip latency and current score.

    Either may be an int, a float or an exact Fraction (the score from
    :func:`agent.core.capacity.score` is one); costs use their exact values.
    """

    latency_ms: Number = DEFAULT_LATENCY_MS
    capacity_score: Number = DEFAULT_CAPACITY_SCORE

    def __post_init__(self) -> None:
        if not (_finite(self.latency_ms) and self.latency_ms >= 0):
            raise ValueError(f"latency_ms must be finite and >= 0, got {self.latency_ms!r}")
        if not (_finite(self.capacity_score) and self.capacity_score > 0):
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


def node_cost(node_id: str, layer_count: int, telemetry: Mapping[str, Telemetry]) -> Fraction:
    """Cost of one hop, exact: entering the node (latency/100, as in the score) plus
    layer_count/score for its layers."""
    cost = _HopCost.of(_telemetry(telemetry, node_id))
    return cost.enter + layer_count * cost.per_layer


def route_cost(route: Route, telemetry: Mapping[str, Telemetry] | None = None) -> Fraction:
    """Total cost of a route, exact; nodes without telemetry use DEFAULT_LATENCY_MS /
    DEFAULT_CAPACITY_SCORE."""
    telemetry = telemetry or {}
    return sum((node_cost(hop.node_id, hop.layers.size, telemetry) for hop in route.hops), Fraction(0))


def live_holders(plan: ShardingPlan, layer: int, alive: Iterable[str]) -> tuple[str, ...]:
    """The holders of ``layer`` that are alive, primary first (dead holders dropped)."""
    alive_set = set(alive)
    return tuple(node_id for node_id in plan.holders(layer) if node_id in alive_set)


def _approx(value: Fraction) -> float:
    """The nearest float of ``value``; infinity when it is beyond the float range."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


@dataclass(frozen=True)
class _HopCost:
    """A node's costs, exact and as the nearest floats: entering it, and each of its layers."""

    enter: Fraction
    per_layer: Fraction
    enter_approx: float
    per_layer_approx: float

    @classmethod
    def of(cls, measured: Telemetry) -> _HopCost:
        enter = exact(measured.latency_ms) / 100
        per_layer = 1 / exact(measured.capacity_score)
        return cls(enter, per_layer, _approx(enter), _approx(per_layer))


# Float costs only filter: two costs whose floats differ by more than their worst rounding
# error are ordered by their floats (which is then their exact order); closer ones are compared
# exactly. Over n layers a float path cost sums at most 2n terms, each term and each sum rounded
# once, so it is within (2n + 2)·2^-53 of its exact value, relatively; telling two costs apart
# needs twice that of the larger one, and the slack below is twice that again.
_FLOAT_EPSILON = 2.0**-52
_UNDERFLOW_SLACK = 1e-290  # absolute errors of subnormal floats


class _Path:
    """The best way found through the layers so far that ends on ``node_id``: the float of its
    cost, its exact cost (computed on demand), its hop count and the path it extends."""

    __slots__ = ("node_id", "cost", "approx", "hops", "previous", "entered", "_exact")

    def __init__(self, node_id: str, cost: _HopCost, approx: float, hops: int, previous: _Path | None,
                 entered: bool) -> None:
        self.node_id = node_id
        self.cost = cost
        self.approx = approx
        self.hops = hops
        self.previous = previous
        self.entered = entered  # a new hop begins here (the node was entered at this layer)
        self._exact: Fraction | None = None

    def exact_cost(self) -> Fraction:
        chain: list[_Path] = []
        path: _Path | None = self
        while path is not None and path._exact is None:
            chain.append(path)
            path = path.previous
        total = Fraction(0) if path is None else path._exact
        for step in reversed(chain):
            total = total + step.cost.per_layer + (step.cost.enter if step.entered else 0)
            step._exact = total
        return total  # type: ignore[return-value]


def _compare(a: _Path, b: _Path, slack: float) -> int:
    """-1, 0 or 1 as ``a`` is better, as good as or worse than ``b``: exact cost, then fewer hops."""
    difference = a.approx - b.approx
    bound = slack * max(a.approx, b.approx) + _UNDERFLOW_SLACK
    if difference < -bound:
        return -1
    if difference > bound:
        return 1
    exact_a, exact_b = a.exact_cost(), b.exact_cost()
    if exact_a != exact_b:
        return -1 if exact_a < exact_b else 1
    return (a.hops > b.hops) - (a.hops < b.hops)


def _best(paths: list[_Path], slack: float) -> _Path:
    """The best of ``paths`` (exact cost, then fewer hops); ties go to the earlier one."""
    lowest = min(path.approx for path in paths)
    # Paths whose float is clearly above the lowest cannot be the best; compare the rest.
    near = [path for path in paths if not path.approx - lowest > slack * path.approx + _UNDERFLOW_SLACK]
    best = near[0]
    for path in near[1:]:
        if _compare(path, best, slack) < 0:
            best = path
    return best


def _cheapest_segment(
    candidates: list[tuple[str, ...]], first_layer: int, telemetry: Mapping[str, Telemetry]
) -> list[Hop]:
    """Cheapest way through consecutive layers given each layer's candidate holders.

    Dynamic programme over layers: staying on a node adds 1/score per layer, switching to a
    node (or starting on it) adds its latency/100 too (one more network hop). Costs are
    compared exactly. Among ways of equal cost the one with fewer hops wins (staying on a node
    beats switching to an equally cheap one); then the earlier candidate (the primary owner
    first), so the result is deterministic.
    """
    slack = 4 * (len(candidates) + 2) * _FLOAT_EPSILON
    costs: dict[str, _HopCost] = {}
    previous: dict[str, _Path] = {}
    for holders in candidates:
        best = _best(list(previous.values()), slack) if previous else None
        current: dict[str, _Path] = {}
        for node_id in holders:
            cost = costs.get(node_id)
            if cost is None:
                cost = costs[node_id] = _HopCost.of(_telemetry(telemetry, node_id))
            enter_approx = (best.approx if best is not None else 0.0) + cost.enter_approx + cost.per_layer_approx
            enter_hops = best.hops + 1 if best is not None else 1
            stay_from = previous.get(node_id)
            if stay_from is None:
                current[node_id] = _Path(node_id, cost, enter_approx, enter_hops, best, True)
                continue
            stay_approx = stay_from.approx + cost.per_layer_approx
            difference = stay_approx - enter_approx
            bound = slack * (enter_approx if difference < 0 else stay_approx) + _UNDERFLOW_SLACK
            if difference < -bound:  # staying is clearly cheaper
                current[node_id] = _Path(node_id, cost, stay_approx, stay_from.hops, stay_from, False)
            elif difference > bound:  # switching is clearly cheaper
                current[node_id] = _Path(node_id, cost, enter_approx, enter_hops, best, True)
            else:
                stay = _Path(node_id, cost, stay_approx, stay_from.hops, stay_from, False)
                enter = _Path(node_id, cost, enter_approx, enter_hops, best, True)
                current[node_id] = stay if _compare(stay, enter, slack) <= 0 else enter
        previous = current

    owners: list[str] = []
    path: _Path | None = _best(list(previous.values()), slack)
    while path is not None:
        owners.append(path.node_id)
        path = path.previous
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


def copy_nodes(plan: ShardingPlan, route: Route, alive: Iterable[str]) -> tuple[str, ...]:
    """The live nodes besides ``route``'s that serve whole requests on their own (design §11):
    where the route is one hop over every layer, each node the plan gives every layer (its
    copies of the model); none on a route of several hops."""
    if len(route.hops) != 1:
        return ()
    whole = (LayerRange(0, plan.total_layers - 1),)
    alive_set = set(alive)
    return tuple(n for n in plan.all_nodes() if n in alive_set and n not in route.nodes and plan.fragments(n) == whole)


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
    plan: ShardingPlan, scores: Mapping[str, Number], total_layers: int | None = None
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
    survivor_scores: Mapping[str, Number] | None = None,
) -> FailoverDecision:
    """Decide how to go on after ``dead`` nodes failed on ``route`` (§6, §7).

    1. If every layer the dead nodes served on this route has a live holder, each dead hop is
       replaced, in its position, by the cheapest live holders of its layers (of equally cheap
       ways, the one with fewer hops), and consecutive duplicates are merged (a node reappearing later keeps that hop): not degraded.
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
