"""§2–§5 of docs/design.md: split, contiguous blocks, head replication, redundancy map."""

import json
import math
from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from agent.core.capacity import NodeCapacity, score
from agent.core.errors import ShardingError
from agent.core.plan import (
    LayerRange,
    ShardingPlan,
    assign_layers,
    head_size,
    make_copies_plan,
    make_plan,
    merge_ranges,
    plan_from_dict,
)
from tests.agent.core.strategies import cluster_scores, integer_clusters
from tests.examples import examples

LAYERS = st.integers(1, 200)
RATIOS = st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.75, 1.0]) | st.floats(0, 1)


def written(value):
    """A figure as written (its shortest decimal form), exactly."""
    return Fraction(str(value))


@st.composite
def plannable(draw):
    scores = draw(cluster_scores())
    layers = draw(st.integers(len(scores), 200))
    minimum = draw(st.integers(0, layers // len(scores)))
    return scores, layers, minimum


# --- §2 ---------------------------------------------------------------------------------------
@given(plannable())
def test_split_sums_to_total_and_meets_minimum(case):
    scores, layers, minimum = case
    counts = assign_layers(scores, layers, minimum)
    assert set(counts) == set(scores)
    assert sum(counts.values()) == layers
    assert all(count >= minimum for count in counts.values())


@given(cluster_scores(), LAYERS)
def test_without_minimum_each_share_is_within_one_of_its_quota(scores, layers):
    counts = assign_layers(scores, layers, 0)
    exact = {node_id: written(s) if isinstance(s, float) else Fraction(s) for node_id, s in scores.items()}
    total = sum(exact.values())
    for node_id, count in counts.items():
        quota = layers * exact[node_id] / total
        assert math.floor(quota) <= count <= math.floor(quota) + 1


@given(plannable())
def test_more_score_never_gets_fewer_layers(case):
    scores, layers, minimum = case
    counts = assign_layers(scores, layers, minimum)
    for a in scores:
        for b in scores:
            if scores[a] > scores[b]:
                assert counts[a] >= counts[b], (a, b)


@given(plannable(), st.randoms(use_true_random=False))
def test_plan_is_deterministic_whatever_the_input_order(case, rng):
    scores, layers, minimum = case
    shuffled = list(scores.items())
    rng.shuffle(shuffled)
    assert make_plan(dict(shuffled), layers, min_layers_per_node=minimum) == make_plan(scores, layers, min_layers_per_node=minimum)


def test_remainder_goes_to_largest_fraction_then_score_then_id():
    # quotas 10 * (1/3) each: 3.33 -> three layers each, one left over; equal fractions and
    # scores, so the lowest node id wins it.
    assert assign_layers({"b": 1.0, "a": 1.0, "c": 1.0}, 10) == {"a": 4, "b": 3, "c": 3}
    # quotas 1.5 / 1.5 / 1.0 for x, w (equal scores and fractions): lower id wins the remainder.
    assert assign_layers({"x": 3.0, "w": 3.0, "v": 2.0}, 4) == {"w": 2, "x": 1, "v": 1}
    counts = assign_layers({"big": 3.0, "small": 1.0}, 3)  # 2.25 / 0.75 -> small has the larger fraction
    assert counts == {"big": 2, "small": 1}


def test_minimum_takes_from_the_node_holding_most_layers():
    # quotas 9.80 / 0.098 / 0.098 -> a 10, b 0, c 0; b and c each take two layers from a.
    counts = assign_layers({"a": 100.0, "b": 1.0, "c": 1.0}, 10, min_layers_per_node=2)
    assert counts == {"a": 6, "b": 2, "c": 2}
    counts = assign_layers({"a": 100.0, "b": 90.0, "c": 0.001}, 10, min_layers_per_node=3)
    assert counts["c"] == 3 and sum(counts.values()) == 10 and counts["a"] >= counts["b"]


def test_too_many_nodes_for_the_minimum_says_what_is_missing():
    with pytest.raises(ShardingError, match="3 nodes with min_layers_per_node=2 need at least 6 layers, but the model has 5"):
        assign_layers({"a": 1.0, "b": 1.0, "c": 1.0}, 5, min_layers_per_node=2)


@pytest.mark.parametrize("bad", [{"a": 0.0}, {"a": -1.0}, {"a": float("nan")}, {}, {"": 1.0}])
def test_bad_scores_are_rejected(bad):
    with pytest.raises((ShardingError, ValueError)):
        assign_layers(bad, 4)


@pytest.mark.parametrize("layers", [0, -3, 2.5, True])
def test_bad_layer_counts_are_rejected(layers):
    with pytest.raises(ShardingError, match="total_layers must be an integer >= 1"):
        assign_layers({"a": 1.0}, layers)


# --- §3 ---------------------------------------------------------------------------------------
@given(plannable())
def test_blocks_are_contiguous_in_descending_score(case):
    scores, layers, minimum = case
    plan = make_plan(scores, layers, min_layers_per_node=minimum)
    order = plan.nodes()
    assert [scores[n] for n in order] == sorted((scores[n] for n in order), reverse=True)
    expected = 0
    for node_id in order:
        block = plan.primary_range(node_id)
        assert block.first == expected
        expected = block.last + 1
    assert expected == layers
    for here, there in zip(order, order[1:] + [None]):
        assert plan.next_hop(here) == there


def test_seed_pipeline_example_shape():
    plan = make_plan({"A": 7.0, "B": 3.0, "C": 2.0}, 12, replica_count=0)
    assert [(n, str(r)) for n, r in plan.primaries] == [("A", "0-6"), ("B", "7-9"), ("C", "10-11")]
    assert plan.nodes() == ["A", "B", "C"] and plan.next_hop("A") == "B" and plan.next_hop("C") is None


# --- §4 ---------------------------------------------------------------------------------------
def test_seed_replication_example():
    """The §4 example: 3 nodes, 24 layers, rho 0.25 -> H = 6, replica 0-5 on C.

    (The seed prints blocks A 0-11, B 12-18, C 19-23, which do not follow from §2; §2 is the rule.)
    """
    plan = make_plan({"A": 28.0, "B": 13.0, "C": 9.0}, 24)
    assert head_size(24, 0.25) == 6
    assert plan.replicas == (("C", LayerRange(0, 5)),)
    assert plan.redundancy_map[0] == ("A", "C")
    assert plan.redundancy_map[6] == ("A",)
    assert plan.coverage() == {layer: 2 if layer <= 5 else 1 for layer in range(24)}
    assert plan.layer_count("C") == 6 + plan.primary_range("C").size


def test_replica_merges_with_a_contiguous_primary():
    assert merge_ranges([LayerRange(3, 5), LayerRange(0, 2)]) == (LayerRange(0, 5),)
    assert merge_ranges([LayerRange(0, 2), LayerRange(4, 5)]) == (LayerRange(0, 2), LayerRange(4, 5))
    assert merge_ranges([LayerRange(0, 4), LayerRange(2, 3), LayerRange(5, 9)]) == (LayerRange(0, 9),)
    # A node whose primary block starts right after the head gets one fragment.
    plan = make_plan({"A": 10.0, "B": 9.0, "C": 1.0}, 8, replica_count=2, replicate_head_ratio=0.5)
    head_owner_free = [n for n, _ in plan.replicas]
    assert "A" not in head_owner_free
    for node_id in head_owner_free:
        fragments = plan.fragments(node_id)
        assert fragments == merge_ranges(fragments)


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 10)), max_size=12))
def test_merge_ranges_covers_the_same_layers_with_disjoint_gapped_ranges(pairs):
    ranges = [LayerRange(a, a + n) for a, n in pairs]
    merged = merge_ranges(ranges)
    covered = {layer for r in ranges for layer in range(r.first, r.last + 1)}
    assert {layer for r in merged for layer in range(r.first, r.last + 1)} == covered
    assert all(b.first > a.last + 1 for a, b in zip(merged, merged[1:]))


@given(LAYERS, RATIOS)
def test_head_size_rule(layers, ratio):
    size = head_size(layers, ratio)
    if layers == 1:
        assert size == 0
    else:
        assert 1 <= size <= layers - 1
        assert size == min(max(1, math.floor(layers * written(ratio) + Fraction(1, 2))), layers - 1)


@given(plannable(), RATIOS, st.none() | st.integers(0, 70))
def test_replicas_go_to_the_lightest_non_owners_of_the_head(case, ratio, replica_count):
    scores, layers, minimum = case
    plan = make_plan(scores, layers, replicate_head_ratio=ratio, replica_count=replica_count, min_layers_per_node=minimum)
    head = head_size(layers, ratio)
    head_owners = {plan.owner_of(layer) for layer in range(head)}
    candidates = sorted((n for n in scores if n not in head_owners), key=lambda n: (scores[n], n))
    wanted = replica_count if replica_count is not None else max(1, len(scores) // 3)
    expected = candidates[:wanted] if head else []
    assert [n for n, _ in plan.replicas] == expected
    assert all(r == LayerRange(0, head - 1) for _, r in plan.replicas)


# --- §5 ---------------------------------------------------------------------------------------
@given(plannable(), RATIOS, st.none() | st.integers(0, 8))
@settings(max_examples=examples(150))
def test_redundancy_map_invariants(case, ratio, replica_count):
    scores, layers, minimum = case
    plan = make_plan(scores, layers, replicate_head_ratio=ratio, replica_count=replica_count, min_layers_per_node=minimum)
    replicated = {layer for _, r in plan.replicas for layer in range(r.first, r.last + 1)}
    for layer, holders in enumerate(plan.redundancy_map):
        assert holders[0] == plan.owner_of(layer)
        assert len(set(holders)) == len(holders)
        if plan.coverage()[layer] > 1:
            assert layer in replicated
    assert plan.uncovered_layers() == []
    for node_id in scores:
        runnable = {layer for layer in range(layers) if node_id in plan.holders(layer)}
        assert plan.layer_count(node_id) == len(runnable)


def test_plan_rejects_gaps_and_unknown_nodes():
    with pytest.raises(ShardingError, match="contiguous"):
        ShardingPlan(4, (("a", LayerRange(0, 1)), ("b", LayerRange(3, 3))), (), (("a", 1.0), ("b", 1.0)))
    with pytest.raises(ShardingError, match="cover layers 0-1"):
        ShardingPlan(4, (("a", LayerRange(0, 1)),), (), (("a", 1.0),))
    with pytest.raises(ShardingError, match="not a planned node"):
        ShardingPlan(2, (("a", LayerRange(0, 1)),), (("z", LayerRange(0, 0)),), (("a", 1.0),))


def test_out_of_range_layer_lookups_raise():
    plan = make_plan({"a": 1.0}, 3)
    with pytest.raises(IndexError):
        plan.owner_of(3)
    with pytest.raises(KeyError):
        plan.next_hop("nobody")


def test_nodes_without_layers_can_hold_replicas():
    plan = make_plan({"big": 100.0, "tiny": 0.001}, 4, min_layers_per_node=0, replicate_head_ratio=0.5)
    assert plan.nodes() == ["big"]
    assert plan.replicas == (("tiny", LayerRange(0, 1)),)
    assert plan.holders(0) == ("big", "tiny")
    assert plan.layer_count("tiny") == 2


# --- exact ties (§1–§2 with integer inputs) -----------------------------------------------------
def reference_score(node):
    """§1 with exact arithmetic, written out independently of agent.core.capacity."""
    raw = (
        2 * written(node.vram_gib) + Fraction(1, 2) * written(node.ram_gib) + Fraction(3, 2) * written(node.npu_tops)
        - Fraction(1, 4) * written(node.latency_ms) / 100
    ) / Fraction(17, 4)
    return max(Fraction(1, 1000), raw * (1 - written(node.load) / 2))


def reference_split(scores, layers, minimum):
    """§2 as the design states it, one rule at a time."""
    total = sum(scores.values())
    quotas = {n: layers * s / total for n, s in scores.items()}
    counts = {n: math.floor(q) for n, q in quotas.items()}
    left = layers - sum(counts.values())
    # Larger fractional part, then higher score, then lower node id.
    for n in sorted(scores, key=lambda n: (-(quotas[n] - counts[n]), -scores[n], n))[:left]:
        counts[n] += 1
    missing = sum(max(0, minimum - c) for c in counts.values())
    counts = {n: max(c, minimum) for n, c in counts.items()}
    for _ in range(missing):
        # The node holding most layers that can still give one; ties: lower score, then higher id.
        donor = max((n for n in counts if counts[n] > minimum), key=lambda n: (counts[n], -scores[n], n))
        counts[donor] -= 1
    return counts


def test_ram_1_and_3_gib_quotas_tie_and_the_higher_score_gets_both_layers():
    """Quotas 0.5 / 1.5: equal fractional parts, so the higher score takes the remainder layer."""
    nodes = [NodeCapacity("a", ram_gib=1), NodeCapacity("b", ram_gib=3)]
    scores = {node.node_id: score(node) for node in nodes}
    assert scores["b"] == 3 * scores["a"]
    assert assign_layers(scores, 2, 0) == {"a": 0, "b": 2}
    plan = make_plan(scores, 2, min_layers_per_node=0)
    assert plan.primaries == (("b", LayerRange(0, 1)),)


def test_float_scores_count_as_written():
    # 0.1 and 0.3 are 1:3 as written (not as binary floats): quotas 0.5 / 1.5 tie.
    assert assign_layers({"a": 0.1, "b": 0.3}, 2, 0) == {"a": 0, "b": 2}
    assert assign_layers({"a": Fraction(1, 10), "b": Fraction(3, 10)}, 2, 0) == {"a": 0, "b": 2}


def test_head_size_rounds_the_exact_product_half_up():
    assert head_size(90, 0.35) == 32  # 31.5 layers, not the binary 31.499…
    assert head_size(45, 0.7) == 32


@st.composite
def integer_case(draw):
    nodes = draw(integer_clusters())
    layers = draw(st.integers(len(nodes), 40))
    minimum = draw(st.integers(0, layers // len(nodes)))
    return nodes, layers, minimum


@given(integer_case())
@example(([NodeCapacity("a", ram_gib=1), NodeCapacity("b", ram_gib=3)], 2, 0))  # the RAM 1 / 3 GiB tie
@settings(max_examples=examples(300))
def test_integer_clusters_follow_the_tie_rules_exactly(case):
    nodes, layers, minimum = case
    scores = {node.node_id: score(node) for node in nodes}
    expected_scores = {node.node_id: reference_score(node) for node in nodes}
    expected = reference_split(expected_scores, layers, minimum)
    assert assign_layers(scores, layers, minimum) == expected
    plan = make_plan(scores, layers, min_layers_per_node=minimum)
    order = sorted((n for n in expected if expected[n]), key=lambda n: (-expected_scores[n], n))
    assert plan.nodes() == order
    assert {n: plan.primary_range(n).size for n in order} == {n: expected[n] for n in order}


def test_exact_scores_go_to_json_as_floats_and_come_back():
    scores = {"a": Fraction(2, 17), "b": Fraction(6, 17), "c": 1, "d": 0.25}
    plan = make_plan(scores, 8, replica_count=1)
    assert plan.score_of("a") == Fraction(2, 17)
    data = plan.to_dict()
    assert all(type(node["score"]) is float for node in data["nodes"])
    assert json.loads(json.dumps(data)) == data
    again = plan_from_dict(data)
    assert again.to_dict() == data
    assert (again.primaries, again.replicas) == (plan.primaries, plan.replicas)
    floats = make_plan({n: float(s) for n, s in scores.items()}, 8, replica_count=1)
    assert plan_from_dict(floats.to_dict()) == floats


def test_exact_scores_a_float_cannot_tell_apart_are_listed_alike_once_read_back():
    """Two exact scores closer than a float can tell apart tie once read back (by id): the plan
    lists its nodes as the JSON will order them, so it reads back to the same ``to_dict``."""
    scores = {"00": Fraction(2, 17) + Fraction(1, 10**40), "0": Fraction(2, 17)}
    for plan in (make_plan(scores, 2), make_copies_plan(scores, 1)):
        assert plan.all_nodes()[0] == "00"  # exactly the better one
        data = plan.to_dict()
        assert [node["id"] for node in data["nodes"]] == ["0", "00"]
        assert plan_from_dict(json.loads(json.dumps(data))).to_dict() == data


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), "1", True, None])
def test_a_plan_with_an_unusable_score_is_rejected(bad):
    with pytest.raises(ShardingError, match="scores must be finite and > 0"):
        ShardingPlan(2, (("a", LayerRange(0, 1)),), (), (("a", bad),))


@given(cluster_scores(max_nodes=8), st.integers(1, 40))
def test_a_copies_plan_gives_every_node_every_layer_the_best_as_primary(scores, layers):
    plan = make_copies_plan(scores, layers)
    assert plan.nodes() == [plan.all_nodes()[0]]  # the best score holds the primaries
    assert all(plan.fragments(n) == (LayerRange(0, layers - 1),) for n in scores)
    assert all(len(holders) == len(scores) for holders in plan.redundancy_map)
    assert plan_from_dict(json.loads(json.dumps(plan.to_dict()))).to_dict() == plan.to_dict()
