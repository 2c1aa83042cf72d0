"""The orchestrator's decisions about its deployments (agent.core.deployments), fed plain data."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.deployments import (
    TINY_ALIAS,
    AdoptAndRecover,
    NodeFault,
    Recover,
    Redeploy,
    Replan,
    WaitToReplan,
    adoption_actions,
    clear_faults,
    failovers,
    newest_orders,
    replan_decision,
    resolve_fallback,
    weight_sources,
)
from agent.core.errors import ClusterError
from agent.core.node_report import WorkerReport
from agent.core.orders import RoutingOrder
from agent.core.plan import LayerRange
from agent.core.routing import Hop, Route

NODES = st.sampled_from([f"n{i}" for i in range(6)])


def order(name: str, version: int, nodes: list[str], *, epoch: int = 1) -> RoutingOrder:
    route = Route(tuple(Hop(node, LayerRange(i, i)) for i, node in enumerate(nodes)))
    return RoutingOrder(epoch=epoch, orchestrator=nodes[0], plan_version=version, model=name, total_layers=len(nodes),
                        route=route, addresses={n: f"https://{n}:1" for n in nodes})


@given(st.dictionaries(st.sampled_from(["a", "b", "c"]), st.lists(NODES, min_size=1, max_size=4)),
       st.frozensets(NODES))
def test_exactly_the_models_that_lost_a_node_of_their_route_fail_over_from_those_nodes(routes, members):
    actions = failovers(members, routes)
    assert [a.name for a in actions] == sorted(n for n, nodes in routes.items() if set(nodes) - members)
    for action in actions:
        assert action == Recover(action.name, frozenset(routes[action.name]) - members)


def test_a_replan_follows_a_join_or_a_changed_faulty_node_no_sooner_than_the_interval():
    base = dict(deployed_members=frozenset({"a"}), deployed=True, replan_pending=False, last_replan_s=100.0,
                replan_min_interval_s=30.0)
    assert replan_decision(members=frozenset({"a"}), now_s=200.0, **base) is None
    assert replan_decision(members=frozenset({"a", "b"}), now_s=200.0, **base) == Replan("a node joined")
    assert replan_decision(members=frozenset({"a", "b"}), now_s=110.0, **base) == WaitToReplan(20.0)
    pending = {**base, "replan_pending": True}
    assert replan_decision(members=frozenset({"a"}), now_s=200.0, **pending) == Replan(
        "a node that could not stage a plan changed")
    assert replan_decision(members=frozenset({"a", "b"}), now_s=200.0, **{**base, "deployed": False}) is None


@given(st.frozensets(NODES), st.frozensets(NODES), st.booleans(), st.floats(0, 1000), st.floats(0, 1000),
       st.floats(0, 100))
def test_a_replan_waits_exactly_the_rest_of_the_interval(members, deployed_members, pending, last, now, interval):
    decision = replan_decision(members=members, deployed_members=deployed_members, deployed=True,
                               replan_pending=pending, last_replan_s=last, now_s=now, replan_min_interval_s=interval)
    due = bool(members - deployed_members) or pending
    if not due:
        assert decision is None
    elif now < last + interval:
        assert isinstance(decision, WaitToReplan) and decision.wait_s == pytest.approx(last + interval - now)
    else:
        assert isinstance(decision, Replan)


def test_faults_are_kept_until_the_node_changes_leaves_or_withdraws_what_it_reported():
    faults = {"same": NodeFault("disk_full", "", "fp"), "changed": NodeFault("disk_full", "", "fp"),
              "gone": NodeFault("out_of_memory", "", "fp"), "withdrew": NodeFault("disk_full", "", "fp", reported=True),
              "now_reported": NodeFault("disk_full", "", "fp")}
    kept, cleared = clear_faults(faults, members={"same", "changed", "withdrew", "now_reported"},
                                 fingerprints={"same": "fp", "changed": "fp2", "withdrew": "fp", "now_reported": "fp"},
                                 reported={"same", "now_reported"})
    assert kept == {"same": NodeFault("disk_full", "", "fp", reported=True),
                    "now_reported": NodeFault("disk_full", "", "fp", reported=True)}
    assert cleared == ["changed", "withdrew"]  # "gone" left: nothing to plan again


@given(st.dictionaries(NODES, st.tuples(st.booleans(), st.booleans())), st.frozensets(NODES), st.frozensets(NODES))
def test_a_fault_is_kept_or_cleared_never_both_and_only_for_live_nodes(faults, members, changed):
    faults = {n: NodeFault("disk_full", "", "fp", reported=was) for n, (was, _) in faults.items()}
    reported = {n for n, f in faults.items() if n in members}
    kept, cleared = clear_faults(faults, members=members, fingerprints={n: "x" if n in changed else "fp" for n in faults},
                                 reported=reported)
    assert not set(kept) & set(cleared)
    assert set(kept) | set(cleared) == set(faults) & members
    assert set(cleared) == set(faults) & members & changed


def test_the_newest_valid_order_per_model_is_adopted_and_dead_routes_fail_over():
    reports = [WorkerReport.from_json(report) for report in [
        {"orders": [order("a", 3, ["n0", "n1"]).to_json(), {"not": "an order"}]},
        {"orders": [order("a", 5, ["n1", "n2"]).to_json(), order("b", 2, ["n0"]).to_json()]},
        {"orders": "garbage"},
        {},
    ]]
    assert {n: o.plan_version for n, o in newest_orders(reports).items()} == {"a": 5, "b": 2}
    actions = adoption_actions(reports, alive={"n0", "n1"})
    assert actions == [AdoptAndRecover(order("a", 5, ["n1", "n2"]), frozenset({"n2"})), Redeploy(order("b", 2, ["n0"]))]


def test_the_fallback_is_the_configured_model_or_the_smallest_held_whole():
    holdings = {"n0": {"big": 900, "small": 100}, "n1": {"mid": 400}}
    assert resolve_fallback("big", holdings) == "big"
    assert resolve_fallback(TINY_ALIAS, holdings) == "small"
    assert resolve_fallback(TINY_ALIAS, {**holdings, "n2": {TINY_ALIAS: 10**9}}) == TINY_ALIAS
    with pytest.raises(ClusterError):
        resolve_fallback(TINY_ALIAS, {"n0": {}})


def test_weights_come_from_whole_holders_this_node_first_then_the_others():
    holdings = {"n2": {"m": 1}, "n0": {}, "me": {"m": 1}, "n1": {"m": 1}}
    assert weight_sources("m", holdings, "me") == ["me", "n1", "n2", "n0"]


def test_orphaned_orders_are_what_nodes_hold_and_no_deployment_names():
    from agent.core.deployments import DropOrphans, orphaned_orders

    reports = {node: WorkerReport.from_json(report) for node, report in {
        "a": {"models": {"main": {}, "old": {}}, "staged": {}},
        "b": {"models": {"main": {}}, "staged": {"loading": {}, "gone": {}}},
        "c": {"models": "garbage", "staged": None},  # a peer's report is not trusted to be well formed
        "d": {},
    }.items()}
    assert orphaned_orders(reports, deployed={"main"}, busy={"loading"}) == [
        DropOrphans("a", ("old",)), DropOrphans("b", ("gone",))]
    assert orphaned_orders(reports, deployed={"main", "old", "gone"}, busy={"loading"}) == []
