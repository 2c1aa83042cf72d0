"""Layer split, contiguous blocks and head replication (design §2–§5).

Everything here is a pure function of its arguments: the same scores give the same plan on
every agent. Scores come from :func:`agent.core.capacity.score` (exact fractions); tests feed
them directly. Scores may be ints, floats or Fractions; every comparison and every quota is
made on their exact values (a float counts as its shortest decimal form, see
:func:`agent.core.capacity.exact`), so mathematically equal scores and quotas always tie and
the design's tie rules decide, never floating-point rounding.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property
from typing import Any, Iterable, Mapping

from agent.core.capacity import Number, exact, is_number, validate_node_id
from agent.core.errors import ShardingError

DEFAULT_REPLICATE_HEAD_RATIO = 0.25
DEFAULT_MIN_LAYERS_PER_NODE = 1


@dataclass(frozen=True, order=True)
class LayerRange:
    """Layers ``first``..``last``, both included."""

    first: int
    last: int

    def __post_init__(self) -> None:
        if not (isinstance(self.first, int) and isinstance(self.last, int)):
            raise ValueError(f"layer range bounds must be integers, got {self.first!r}..{self.last!r}")
        if self.first < 0 or self.last < self.first:
            raise ValueError(f"invalid layer range {self.first}..{self.last}")

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.first <= layer <= self.last

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"

    def to_list(self) -> list[int]:
        return [self.first, self.last]


def merge_ranges(ranges: Iterable[LayerRange]) -> tuple[LayerRange, ...]:
    """Sort and merge overlapping or adjacent ranges (0-2 and 3-5 become 0-5)."""
    merged: list[LayerRange] = []
    for current in sorted(ranges):
        if merged and current.first <= merged[-1].last + 1:
            last = merged[-1]
            merged[-1] = LayerRange(last.first, max(last.last, current.last))
        else:
            merged.append(current)
    return tuple(merged)


def _exact_scores(scores: Mapping[str, Number]) -> dict[str, Fraction]:
    """Check ``scores`` and return them as exact fractions (ShardingError if unusable)."""
    if not scores:
        raise ShardingError("no nodes to plan over: at least one node is needed")
    result: dict[str, Fraction] = {}
    for node_id, value in scores.items():
        validate_node_id(node_id)
        if not is_number(value) or (isinstance(value, float) and not math.isfinite(value)) or value <= 0:
            raise ShardingError(f"node {node_id!r} has score {value!r}; scores must be finite and > 0")
        result[node_id] = exact(value)
    return result


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ShardingError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _by_priority(scores: Mapping[str, Fraction]) -> list[str]:
    """Node ids by descending (exact) score, ties by ascending node id (the pipeline order of §3)."""
    return sorted(scores, key=lambda node_id: (-scores[node_id], node_id))


def assign_layers(
    scores: Mapping[str, Number],
    total_layers: int,
    min_layers_per_node: int = DEFAULT_MIN_LAYERS_PER_NODE,
) -> dict[str, int]:
    """How many primary layers each node gets (§2), by largest remainder.

    Scores and quotas are exact rationals (a float score counts as its shortest decimal
    form), so the result never depends on floating-point rounding: equal quotas and equal
    fractional parts really tie, and the rules below decide. Remainder layers go one by one
    to the largest fractional parts, ties to the higher score, then to the lower node id. A
    node below ``min_layers_per_node`` takes layers, one at a time, from the node holding the
    most layers that can still give one (ties: the lower score gives, then the higher node id).
    """
    return _assign_exact(_exact_scores(scores), total_layers, min_layers_per_node)


def _assign_exact(exact_scores: Mapping[str, Fraction], total_layers: int, min_layers_per_node: int) -> dict[str, int]:
    _check_count("total_layers", total_layers, 1)
    _check_count("min_layers_per_node", min_layers_per_node, 0)
    node_count = len(exact_scores)
    if node_count * min_layers_per_node > total_layers:
        raise ShardingError(
            f"{node_count} nodes with min_layers_per_node={min_layers_per_node} need at least "
            f"{node_count * min_layers_per_node} layers, but the model has {total_layers}: "
            f"use fewer nodes or a lower minimum"
        )
    total_score = sum(exact_scores.values())
    quotas = {node_id: total_layers * value / total_score for node_id, value in exact_scores.items()}
    counts = {node_id: math.floor(quota) for node_id, quota in quotas.items()}
    remainder = total_layers - sum(counts.values())
    by_fraction = sorted(exact_scores, key=lambda n: (-(quotas[n] - counts[n]), -exact_scores[n], n))
    for node_id in by_fraction[:remainder]:
        counts[node_id] += 1

    deficit = sum(max(0, min_layers_per_node - c) for c in counts.values())
    if deficit:
        for node_id in counts:
            counts[node_id] = max(counts[node_id], min_layers_per_node)
        # Donors: most layers first; ties, the lower score gives first, then the higher id.
        donors = [(-c, exact_scores[n], _Reversed(n)) for n, c in counts.items() if c > min_layers_per_node]
        heapq.heapify(donors)
        for _ in range(deficit):
            if not donors:  # pragma: no cover - excluded by the node_count * minimum check
                raise ShardingError("no node can give a layer to meet min_layers_per_node")
            negative_count, donor_score, donor = heapq.heappop(donors)
            counts[donor.value] -= 1
            if -negative_count - 1 > min_layers_per_node:
                heapq.heappush(donors, (negative_count + 1, donor_score, donor))
    return counts


@dataclass(frozen=True)
class _Reversed:
    """Orders strings in reverse, for 'higher node id first' inside a min-heap."""

    value: str

    def __lt__(self, other: _Reversed) -> bool:
        return self.value > other.value


def head_size(total_layers: int, replicate_head_ratio: Number) -> int:
    """H = max(1, round(L·ρ)) with H <= L − 1 (§4); 0 when the model has a single layer.

    ``round`` is half-up on the exact product (ρ as written: 0.1 is 1/10), so 2.5 layers
    round to 3 on every platform.
    """
    return min(max(1, math.floor(total_layers * exact(replicate_head_ratio) + Fraction(1, 2))), total_layers - 1)


@dataclass(frozen=True)
class ShardingPlan:
    """Which node holds which layers: primaries in pipeline order, plus head replicas.

    ``primaries`` lists (node, range) in pipeline order; ``replicas`` lists (node, range) in the
    order replicas were chosen (ascending score). ``scores`` holds every planned node, also
    those left without layers, each score as it was given (int, float or exact Fraction);
    orderings use their exact values. Validated on construction (§5 invariants).
    """

    total_layers: int
    primaries: tuple[tuple[str, LayerRange], ...]
    replicas: tuple[tuple[str, LayerRange], ...]
    scores: tuple[tuple[str, Number], ...]
    replicate_head_ratio: float = DEFAULT_REPLICATE_HEAD_RATIO
    replica_count: int | None = None
    min_layers_per_node: int = DEFAULT_MIN_LAYERS_PER_NODE
    _starts: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _exact_by_node: dict[str, Fraction] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_count("total_layers", self.total_layers, 1)
        exact_scores = _exact_scores(dict(self.scores))
        if len(exact_scores) != len(self.scores):
            raise ShardingError("a node appears twice in the plan's scores")
        object.__setattr__(self, "_exact_by_node", exact_scores)
        expected_first = 0
        seen: set[str] = set()
        for node_id, layers in self.primaries:
            if node_id in seen:
                raise ShardingError(f"node {node_id!r} holds two primary blocks; blocks must be contiguous")
            seen.add(node_id)
            if layers.first != expected_first:
                raise ShardingError(f"primary blocks must be contiguous: {node_id!r} starts at {layers.first}, expected {expected_first}")
            expected_first = layers.last + 1
        if expected_first != self.total_layers:
            raise ShardingError(f"primary blocks cover layers 0-{expected_first - 1}, the model has {self.total_layers}")
        known = dict(self.scores)
        for node_id, layers in self.replicas:
            if node_id not in known:
                raise ShardingError(f"replica holder {node_id!r} is not a planned node")
            if layers.last >= self.total_layers:
                raise ShardingError(f"replica {layers} on {node_id!r} is beyond the last layer")
        for node_id, _ in self.primaries:
            if node_id not in known:
                raise ShardingError(f"primary owner {node_id!r} is not a planned node")
        object.__setattr__(self, "_starts", tuple(layers.first for _, layers in self.primaries))

    # --- pipeline (§3) -------------------------------------------------------------------
    def nodes(self) -> list[str]:
        """Nodes holding primary layers, in pipeline order (by first primary layer)."""
        return [node_id for node_id, _ in self.primaries]

    def next_hop(self, node_id: str) -> str | None:
        """The node after ``node_id`` in the pipeline; None for the tail."""
        order = self.nodes()
        if node_id not in order:
            raise KeyError(f"node {node_id!r} holds no primary layers in this plan")
        index = order.index(node_id)
        return order[index + 1] if index + 1 < len(order) else None

    def primary_range(self, node_id: str) -> LayerRange | None:
        return dict(self.primaries).get(node_id)

    def all_nodes(self) -> list[str]:
        """Every planned node, by descending score (ties by ascending node id)."""
        return _by_priority(self._exact_by_node)

    # --- redundancy map (§5) -------------------------------------------------------------
    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or not 0 <= layer < self.total_layers:
            raise IndexError(f"layer {layer!r} is outside 0-{self.total_layers - 1}")

    def owner_of(self, layer: int) -> str:
        self._check_layer(layer)
        return self.primaries[bisect.bisect_right(self._starts, layer) - 1][0]

    def holders(self, layer: int) -> tuple[str, ...]:
        """Nodes able to serve ``layer``: the primary owner first, then replicas in plan order."""
        self._check_layer(layer)
        return self.redundancy_map[layer]

    @cached_property
    def redundancy_map(self) -> tuple[tuple[str, ...], ...]:
        """layer -> holders, primary owner first (computed once per plan)."""
        replica_holders: list[list[str]] = [[] for _ in range(self.total_layers)]
        for node_id, layers in self.replicas:
            for layer in range(layers.first, layers.last + 1):
                replica_holders[layer].append(node_id)
        result: list[tuple[str, ...]] = []
        previous: tuple[str, ...] | None = None
        for layer, extra in enumerate(replica_holders):
            owner = self.owner_of(layer)
            holders = (owner, *dict.fromkeys(n for n in extra if n != owner))
            previous = previous if previous == holders else holders  # share equal tuples
            result.append(previous)
        return tuple(result)

    def coverage(self) -> dict[int, int]:
        return {layer: len(holders) for layer, holders in enumerate(self.redundancy_map)}

    def uncovered_layers(self) -> list[int]:
        return [layer for layer, count in self.coverage().items() if count == 0]

    def fragments(self, node_id: str) -> tuple[LayerRange, ...]:
        """The merged ranges a node runs: its primary block plus its replicas."""
        ranges = [layers for owner, layers in self.primaries if owner == node_id]
        ranges += [layers for holder, layers in self.replicas if holder == node_id]
        return merge_ranges(ranges)

    def layer_count(self, node_id: str) -> int:
        """Layers a node can actually run: primaries and replicas."""
        return sum(layers.size for layers in self.fragments(node_id))

    def score_of(self, node_id: str) -> Number:
        """The node's score as given to the plan."""
        return dict(self.scores)[node_id]

    def to_dict(self) -> dict[str, Any]:
        scores = dict(self.scores)
        primaries = dict(self.primaries)
        return {
            "total_layers": self.total_layers,
            "replicate_head_ratio": self.replicate_head_ratio,
            "replica_count": self.replica_count,
            "min_layers_per_node": self.min_layers_per_node,
            "pipeline": self.nodes(),
            "replicas": [[node_id, layers.to_list()] for node_id, layers in self.replicas],
            "nodes": [
                {
                    "id": node_id,
                    "score": float(scores[node_id]),  # JSON: the nearest float
                    "primary": primaries[node_id].to_list() if node_id in primaries else None,
                    "replicas": [r.to_list() for holder, r in self.replicas if holder == node_id],
                    "fragments": [r.to_list() for r in self.fragments(node_id)],
                    "layer_count": self.layer_count(node_id),
                }
                # by the floats the JSON keeps (ties by id): the order a plan read back lists them in,
                # where exact scores closer than a float can tell apart would list them otherwise
                for node_id in sorted(self.all_nodes(), key=lambda node_id: (-float(scores[node_id]), node_id))
            ],
        }


def plan_from_dict(data: Any) -> ShardingPlan:
    """Rebuild a plan from :meth:`ShardingPlan.to_dict` (what workers report); ShardingError if unusable.

    Layers, replicas and settings come back as they were; scores come back as the floats of
    the JSON (an exact Fraction score becomes its nearest float), so a plan made from float
    scores round-trips to an equal plan, and any plan to the same ``to_dict``.
    """
    try:
        nodes = data["nodes"]
        primaries = sorted(
            ((n["id"], LayerRange(*n["primary"])) for n in nodes if n["primary"]), key=lambda item: item[1].first
        )
        return ShardingPlan(
            total_layers=int(data["total_layers"]),
            primaries=tuple(primaries),
            replicas=tuple((node_id, LayerRange(*layers)) for node_id, layers in data["replicas"]),
            scores=tuple((n["id"], float(n["score"])) for n in nodes),
            replicate_head_ratio=float(data["replicate_head_ratio"]),
            replica_count=data["replica_count"],
            min_layers_per_node=int(data["min_layers_per_node"]),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ShardingError(f"malformed plan: {error}") from None


def make_plan(
    scores: Mapping[str, Number],
    total_layers: int,
    *,
    replicate_head_ratio: float = DEFAULT_REPLICATE_HEAD_RATIO,
    replica_count: int | None = None,
    min_layers_per_node: int = DEFAULT_MIN_LAYERS_PER_NODE,
) -> ShardingPlan:
    """Plan ``total_layers`` over the nodes of ``scores`` (§2–§4)."""
    if not is_number(replicate_head_ratio) or not 0 <= replicate_head_ratio <= 1:
        raise ShardingError(f"replicate_head_ratio must be in [0, 1], got {replicate_head_ratio!r}")
    if replica_count is not None:
        _check_count("replica_count", replica_count, 0)
    exact_scores = _exact_scores(scores)
    counts = _assign_exact(exact_scores, total_layers, min_layers_per_node)
    order = _by_priority(exact_scores)

    primaries: list[tuple[str, LayerRange]] = []
    next_layer = 0
    for node_id in order:
        if counts[node_id]:
            primaries.append((node_id, LayerRange(next_layer, next_layer + counts[node_id] - 1)))
            next_layer += counts[node_id]

    replicas: list[tuple[str, LayerRange]] = []
    head = head_size(total_layers, replicate_head_ratio)
    if head > 0:
        head_owners = {node_id for node_id, layers in primaries if layers.first < head}
        candidates = sorted((n for n in exact_scores if n not in head_owners), key=lambda n: (exact_scores[n], n))
        wanted = replica_count if replica_count is not None else max(1, len(scores) // 3)
        replicas = [(node_id, LayerRange(0, head - 1)) for node_id in candidates[:wanted]]

    return ShardingPlan(
        total_layers=total_layers,
        primaries=tuple(primaries),
        replicas=tuple(replicas),
        scores=tuple((node_id, scores[node_id]) for node_id in order),
        replicate_head_ratio=float(replicate_head_ratio),
        replica_count=replica_count,
        min_layers_per_node=min_layers_per_node,
    )


def make_copies_plan(scores: Mapping[str, Number], total_layers: int) -> ShardingPlan:
    """A whole copy of the model on every node of ``scores`` (design §11): the node with the
    best score holds every layer as primary, each other node every layer as a replica (in
    ascending score, as §4 chooses replicas). The redundancy map gives each layer every node."""
    _check_count("total_layers", total_layers, 1)
    order = _by_priority(_exact_scores(scores))
    whole = LayerRange(0, total_layers - 1)
    return ShardingPlan(
        total_layers=total_layers,
        primaries=((order[0], whole),),
        replicas=tuple((node_id, whole) for node_id in reversed(order[1:])),
        scores=tuple((node_id, scores[node_id]) for node_id in order),
        replicate_head_ratio=1.0,
        replica_count=len(order) - 1,
        min_layers_per_node=0,
    )
