"""§6–§7 of docs/design.md: routes, failover, forwarding tables, degraded mode."""

from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from agent.core.capacity import NodeCapacity, score
from agent.core.errors import ClusterError, RoutingFailure
from agent.core.plan import LayerRange, make_copies_plan, make_plan
from agent.core.routing import (
    DEFAULT_CAPACITY_SCORE,
    DEFAULT_LATENCY_MS,
    Hop,
    Route,
    Telemetry,
    choose_route,
    copy_nodes,
    failover,
    forwarding_table,
    live_holders,
    rebalance,
    route_cost,
)
from tests.agent.core.strategies import cluster_scores, integer_clusters
from tests.examples import examples


def route_of(*hops):
    return Route(tuple(Hop(node, LayerRange(a, b)) for node, a, b in hops))


@pytest.fixture
def four():
    """A 0-11, B 12-19, C 20-25, D 26-29 (30 layers); replicas of 0-7 on D and C."""
    plan = make_plan({"A": 40.0, "B": 27.0, "C": 20.0, "D": 13.0}, 30, replica_count=2)
    assert [(n, str(r)) for n, r in plan.primaries] == [("A", "0-11"), ("B", "12-19"), ("C", "20-25"), ("D", "26-29")]
    assert [n for n, _ in plan.replicas] == ["D", "C"] and plan.replicas[0][1] == LayerRange(0, 7)
    return plan


def test_route_cost_uses_defaults_for_nodes_without_telemetry():
    route = route_of(("A", 0, 3), ("B", 4, 5))
    expected = 2 * DEFAULT_LATENCY_MS / 100 + 4 / DEFAULT_CAPACITY_SCORE + 2 / DEFAULT_CAPACITY_SCORE
    assert route_cost(route) == pytest.approx(expected)
    measured = {"A": Telemetry(latency_ms=100.0, capacity_score=4.0)}
    assert route_cost(route, measured) == pytest.approx(1.0 + 4 / 4.0 + DEFAULT_LATENCY_MS / 100 + 2.0)


def test_costs_are_exact():
    route = route_of(("A", 0, 2), ("B", 3, 3))
    measured = {"A": Telemetry(latency_ms=0.1, capacity_score=Fraction(2, 17)), "B": Telemetry(latency_ms=3, capacity_score=0.3)}
    assert route_cost(route, measured) == Fraction(1, 1000) + 3 * Fraction(17, 2) + Fraction(3, 100) + Fraction(10, 3)


@pytest.mark.parametrize("fields", [{"latency_ms": -1}, {"latency_ms": float("inf")}, {"capacity_score": 0},
                                    {"capacity_score": Fraction(-1, 3)}, {"capacity_score": "1"}, {"latency_ms": True}])
def test_bad_telemetry_is_rejected(fields):
    with pytest.raises(ValueError):
        Telemetry(**fields)


def test_choose_route_is_the_primary_pipeline_when_all_is_well(four):
    route = choose_route(four, "ABCD")
    assert route.to_list() == [{"node": n, "layers": list(r.to_list())} for n, r in four.primaries]


def test_choose_route_avoids_a_slow_node_by_cost():
    plan = make_plan({"A": 40.0, "B": 27.0, "C": 20.0, "D": 13.0}, 30, replica_count=2, replicate_head_ratio=0.4)
    slow = {"A": Telemetry(latency_ms=5000.0)}
    route = choose_route(plan, "ABCD", slow)
    assert "A" not in route.nodes
    assert route.hops[0] == Hop("D", LayerRange(0, 11))
    assert route_cost(route, slow) < route_cost(choose_route(plan, "ABCD"), slow)


# --- §6 rule 1: only the dead node's layers are replaced, in its position ------------------------
def test_failover_splices_replica_in_place_of_the_dead_head(four):
    route = choose_route(four, "ABCD")
    # Replicas hold only 0-7, so A's 8-11 are lost: not recoverable without a fallback.
    with pytest.raises(RoutingFailure, match="layers 8-11 have no live holder"):
        failover(route, ["A"], four, "ABCD", allow_fallback=False)
    plan = make_plan({"A": 40.0, "B": 27.0, "C": 20.0, "D": 13.0}, 30, replica_count=2, replicate_head_ratio=0.4)
    route = choose_route(plan, "ABCD")
    decision = failover(route, ["A"], plan, "ABCD")
    assert not decision.degraded
    assert decision.route.hops[0] == Hop("D", LayerRange(0, 11))  # first replica in plan order wins the tie
    assert decision.route.hops[1:] == route.hops[1:]
    assert decision.lost_layers == tuple(range(12))


def test_failover_dedups_only_consecutive_duplicates():
    # Replica holder D also owns the tail: it appears twice, not merged.
    plan = make_plan({"A": 40.0, "B": 27.0, "C": 20.0, "D": 13.0}, 30, replica_count=1, replicate_head_ratio=0.4)
    route = choose_route(plan, "ABCD")
    decision = failover(route, ["A"], plan, "ABCD")
    assert [h.node_id for h in decision.route.hops] == ["D", "B", "C", "D"]
    # When the substitute is the next node, the two hops merge into one.
    plan = make_plan({"A": 40.0, "B": 27.0, "C": 20.0, "D": 13.0}, 30, replica_count=3, replicate_head_ratio=0.4)
    fast_b = {"B": Telemetry(latency_ms=0.0, capacity_score=10.0)}
    decision = failover(choose_route(plan, "ABCD"), ["A"], plan, "ABCD", fast_b)
    assert decision.route.hops[0] == Hop("B", LayerRange(0, 19))
    assert [h.node_id for h in decision.route.hops] == ["B", "C", "D"]


def test_forwarding_table_after_failover():
    plan = make_plan({"A": 40.0, "B": 27.0, "C": 20.0, "D": 13.0}, 30, replica_count=1, replicate_head_ratio=0.4)
    decision = failover(choose_route(plan, "ABCD"), ["A"], plan, "ABCD")
    table = forwarding_table(decision.route)
    assert table == {11: "B", 19: "C", 25: "D", 29: None}


def test_dead_holders_are_dropped():
    plan = make_plan({"A": 40.0, "B": 27.0, "C": 20.0, "D": 13.0}, 30, replica_count=2, replicate_head_ratio=0.4)
    assert live_holders(plan, 0, "ABCD") == ("A", "D", "C")
    assert live_holders(plan, 0, "BC") == ("C",)
    decision = failover(choose_route(plan, "ABCD"), ["A"], plan, alive="ABC")  # D is dead too (alive says so)
    assert "D" not in [h.node_id for h in decision.route.hops[:1]]
    assert decision.route.hops[0] == Hop("C", LayerRange(0, 11))


def test_failover_of_a_node_not_on_the_route_changes_nothing(four):
    route = route_of(("A", 0, 11), ("B", 12, 19), ("C", 20, 25), ("D", 26, 29))
    decision = failover(route, ["Z"], four, "ABCD")
    assert decision.route == route and not decision.degraded


def test_failover_of_the_tail_without_replica_degrades(four):
    route = choose_route(four, "ABCD")
    decision = failover(route, ["D"], four, "ABCD", fallback_layers=24)
    assert decision.degraded and decision.model == "ncm-tiny"
    assert decision.survivors == ("A", "B", "C")
    assert decision.plan.total_layers == 24
    assert set(decision.plan.nodes()) <= {"A", "B", "C"}


# --- §7 ----------------------------------------------------------------------------------------
def test_degraded_rebalance_keeps_layer_count_and_head_ratio():
    plan = make_plan({"A": 50.0, "B": 30.0, "C": 20.0}, 30)
    route = choose_route(plan, "ABC")
    decision = failover(route, ["A"], plan, "ABC")  # head replica 0-7 on C, A held 0-14
    assert decision.degraded
    assert decision.survivors == ("B", "C")
    assert decision.plan.total_layers == plan.total_layers
    assert decision.plan.replicate_head_ratio == plan.replicate_head_ratio
    assert "A" not in decision.route.nodes
    assert decision.plan == rebalance(plan, {"B": 30.0, "C": 20.0})


def test_no_survivor_is_a_cluster_error():
    plan = make_plan({"A": 1.0}, 4)
    with pytest.raises(ClusterError, match="no surviving node"):
        failover(choose_route(plan, "A"), ["A"], plan, "A")


def test_rebalance_that_cannot_fit_is_a_cluster_error():
    plan = make_plan({"A": 1.0, "B": 1.0}, 4, min_layers_per_node=2)
    with pytest.raises(ClusterError, match="cannot re-plan"):
        rebalance(plan, {"A": 1.0, "B": 1.0, "C": 1.0})


def test_choose_route_without_holder_fails():
    plan = make_plan({"A": 2.0, "B": 1.0}, 4, replica_count=0)
    with pytest.raises(RoutingFailure, match="layers 0-2 have no live holder"):
        choose_route(plan, "B")


def test_route_validation():
    with pytest.raises(ValueError, match="contiguous"):
        route_of(("A", 0, 3), ("B", 5, 6))
    with pytest.raises(ValueError):
        Route(())


# --- properties ---------------------------------------------------------------------------------
@st.composite
def failure_case(draw):
    scores = draw(cluster_scores(min_nodes=2, max_nodes=12))
    layers = draw(st.integers(len(scores), 80))
    ratio = draw(st.sampled_from([0.1, 0.25, 0.5, 0.9]))
    replicas = draw(st.none() | st.integers(0, len(scores)))
    plan = make_plan(scores, layers, replicate_head_ratio=ratio, replica_count=replicas)
    dead = draw(st.sets(st.sampled_from(sorted(scores)), min_size=1, max_size=len(scores) - 1))
    telemetry = draw(
        st.dictionaries(
            st.sampled_from(sorted(scores)),
            st.builds(Telemetry, latency_ms=st.floats(0, 1000), capacity_score=st.floats(0.01, 100)),
        )
    )
    return plan, dead, telemetry


def recoverable(plan, route, dead, alive) -> bool:
    """Whether every layer the ``dead`` nodes served on ``route`` has a live holder."""
    lost = [layer for hop in route.hops if hop.node_id in dead for layer in range(hop.layers.first, hop.layers.last + 1)]
    return all(live_holders(plan, layer, alive) for layer in lost)


@given(failure_case())
@settings(max_examples=examples(200))
def test_failover_never_routes_through_a_dead_node_while_a_live_holder_exists(case):
    plan, dead, telemetry = case
    alive = set(dict(plan.scores)) - dead
    route = choose_route(plan, dict(plan.scores), telemetry)
    can_recover = recoverable(plan, route, dead, alive)
    try:
        decision = failover(route, dead, plan, alive, telemetry, allow_fallback=False)
    except RoutingFailure:
        assert not can_recover
        return
    assert can_recover and not decision.degraded
    assert not set(decision.route.nodes) & dead
    assert decision.route.total_layers == plan.total_layers
    for hop in decision.route.hops:
        for layer in range(hop.layers.first, hop.layers.last + 1):
            assert hop.node_id in plan.holders(layer)
    # Hops that did not touch a dead node stay exactly where they were.
    kept = [hop for hop in route.hops if hop.node_id not in dead]
    for hop in kept:
        assert any(h.node_id == hop.node_id and h.layers.first <= hop.layers.first and hop.layers.last <= h.layers.last for h in decision.route.hops)
    # No two consecutive hops on the same node.
    assert all(a.node_id != b.node_id for a, b in zip(decision.route.hops, decision.route.hops[1:]))


@given(failure_case())
@settings(max_examples=examples(100))
def test_degraded_decision_uses_only_survivors_of_the_route(case):
    plan, dead, telemetry = case
    alive = set(dict(plan.scores)) - dead
    route = choose_route(plan, dict(plan.scores), telemetry)
    try:
        decision = failover(route, dead, plan, alive, telemetry)
    except ClusterError:
        assert not set(route.nodes) - dead
        return
    assert not set(decision.route.nodes) & dead
    if decision.degraded:
        assert set(decision.survivors) == set(route.nodes) - dead
        assert decision.plan.total_layers == plan.total_layers
        assert set(decision.route.nodes) <= set(decision.survivors)


@given(failure_case())
def test_forwarding_table_links_every_hop_to_the_next_layer(case):
    plan, _, telemetry = case
    route = choose_route(plan, dict(plan.scores), telemetry)
    table = forwarding_table(route)
    for last, next_node in table.items():
        if next_node is None:
            assert last == plan.total_layers - 1
        else:
            assert route.node_for_layer(last + 1) == next_node


def test_standby_hops_are_the_hops_of_every_single_failover():
    from agent.core.routing import standby_hops

    plan = make_plan({"A": 40.0, "B": 27.0, "C": 20.0, "D": 13.0}, 30, replica_count=1, replicate_head_ratio=0.4)
    route = choose_route(plan, "ABCD")
    standby = standby_hops(plan, route, "ABCD")
    assert LayerRange(0, 11) in standby["D"]  # D takes the head if A dies
    # B, C and D have no replica: their death degrades, so nothing is prepared for it.
    for node_id, ranges in standby.items():
        for layers in ranges:
            assert all(node_id in plan.holders(layer) for layer in range(layers.first, layers.last + 1))


# --- exact ties: equal-cost ways prefer fewer hops ----------------------------------------------
def test_failover_with_zero_latency_hands_a_dead_hop_to_one_substitute():
    """b, d and e score exactly alike (8·3 = 8·2 + 2·1 + 6·1 = 8·1 + 2·8): with latency 0 any mix
    of them costs the same for layers 0-2, so the dead head goes whole to the first replica."""
    figures = {"a": (3, 5, 1), "b": (3, 0, 0), "c": (4, 6, 1), "d": (2, 1, 1), "e": (1, 8, 0)}
    nodes = [NodeCapacity(n, vram_gib=v, ram_gib=r, npu_tops=t) for n, (v, r, t) in figures.items()]
    scores = {node.node_id: score(node) for node in nodes}
    assert scores["b"] == scores["d"] == scores["e"]
    plan = make_plan(scores, 12, replica_count=3)
    assert [n for n, _ in plan.primaries] == ["c", "a", "b", "d", "e"]  # equal scores: by node id
    assert [n for n, _ in plan.replicas] == ["b", "d", "e"]
    telemetry = {n: Telemetry(latency_ms=0, capacity_score=s) for n, s in scores.items()}
    route = choose_route(plan, scores, telemetry)
    assert route.hops[0] == Hop("c", LayerRange(0, 2))
    decision = failover(route, ["c"], plan, set(scores) - {"c"}, telemetry)
    assert not decision.degraded
    assert decision.route.hops[0] == Hop("b", LayerRange(0, 2))
    assert decision.route.hops[1:] == route.hops[1:]


def whole_figure_score(node):
    """§1 for whole GiB / TOPS, no latency and no load, written out independently."""
    return max(Fraction(1, 1000), Fraction(8 * int(node.vram_gib) + 2 * int(node.ram_gib) + 6 * int(node.npu_tops), 17))


def reference_cheapest(candidates, costs):
    """(cost, hops) of the cheapest way through the layers, fewest hops among equally cheap ones."""
    best = {}
    for holders in candidates:
        low = min(best.values(), default=(Fraction(0), 0))
        best = {
            n: min([(low[0] + costs[n][0] + costs[n][1], low[1] + 1)]
                   + ([(best[n][0] + costs[n][1], best[n][1])] if n in best else []))
            for n in holders
        }
    return min(best.values())


def cost_and_hops(route, layers, costs):
    """(cost, hops) of the part of ``route`` that runs ``layers``, counted from its first layer."""
    owners = [route.node_for_layer(layer) for layer in layers]
    cost, hops = Fraction(0), 0
    for index, node in enumerate(owners):
        if index == 0 or owners[index - 1] != node:
            cost += costs[node][0]
            hops += 1
        cost += costs[node][1]
    return cost, hops


@st.composite
def tie_case(draw):
    nodes = draw(integer_clusters(min_nodes=2, max_nodes=8, loads=False))
    layers = draw(st.integers(len(nodes), 30))
    plan = make_plan(
        {node.node_id: score(node) for node in nodes}, layers,
        replicate_head_ratio=draw(st.sampled_from([0.25, 0.5, 0.9])),
        replica_count=draw(st.none() | st.integers(0, len(nodes))),
        min_layers_per_node=draw(st.integers(0, 1)),
    )
    latency = {node.node_id: draw(st.sampled_from([0, 0, 0, 5, 100])) for node in nodes}
    dead = draw(st.sets(st.sampled_from(sorted(latency)), min_size=1, max_size=len(nodes) - 1))
    return nodes, plan, latency, dead


_EXAMPLE_NODES = [NodeCapacity(n, vram_gib=v, ram_gib=r, npu_tops=t)
                  for n, (v, r, t) in {"a": (3, 5, 1), "b": (3, 0, 0), "c": (4, 6, 1), "d": (2, 1, 1), "e": (1, 8, 0)}.items()]


@given(tie_case())
@example((_EXAMPLE_NODES, make_plan({node.node_id: score(node) for node in _EXAMPLE_NODES}, 12, replica_count=3),
          dict.fromkeys("abcde", 0), {"c"}))
@settings(max_examples=examples(300))
def test_routes_are_cheapest_then_fewest_hops_with_exact_ties(case):
    nodes, plan, latency, dead = case
    scores = {node.node_id: score(node) for node in nodes}
    telemetry = {n: Telemetry(latency_ms=latency[n], capacity_score=scores[n]) for n in scores}
    costs = {node.node_id: (Fraction(latency[node.node_id], 100), 1 / whole_figure_score(node)) for node in nodes}
    everything = range(plan.total_layers)

    route = choose_route(plan, scores, telemetry)
    candidates = [live_holders(plan, layer, scores) for layer in everything]
    assert cost_and_hops(route, everything, costs) == reference_cheapest(candidates, costs)
    assert route_cost(route, telemetry) == cost_and_hops(route, everything, costs)[0]

    alive = set(scores) - dead
    try:
        decision = failover(route, dead, plan, alive, telemetry, allow_fallback=False)
    except RoutingFailure:
        return
    for hop in route.hops:
        if hop.node_id in dead:
            layers = range(hop.layers.first, hop.layers.last + 1)
            candidates = [live_holders(plan, layer, alive) for layer in layers]
            assert cost_and_hops(decision.route, layers, costs) == reference_cheapest(candidates, costs), hop


def test_whole_copies_serve_beside_a_route_of_one_hop_and_take_over_from_it():
    plan = make_copies_plan({"a": 3, "b": 2, "c": 1}, 6)
    route = choose_route(plan, "abc")
    assert route == Route((Hop("a", LayerRange(0, 5)),))
    assert copy_nodes(plan, route, "abc") == ("b", "c")
    assert copy_nodes(plan, route, "ac") == ("c",)  # b is not alive
    moved = failover(route, ["a"], plan, "bc", allow_fallback=False)
    assert len(moved.route.hops) == 1 and moved.route.nodes[0] in "bc" and not moved.degraded
    assert copy_nodes(plan, moved.route, "bc") == tuple(n for n in "bc" if n not in moved.route.nodes)
    split = make_plan({"a": 3, "b": 2, "c": 1}, 6)
    assert copy_nodes(split, choose_route(split, "abc"), "abc") == ()  # a split model has no copies
