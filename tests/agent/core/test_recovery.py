"""The recovery decision (agent/core/recovery.py): a failover when every lost layer has a live
holder, else the fallback model when it is allowed, else the model is lost, with the reason."""

from __future__ import annotations

from hypothesis import given, settings

from agent.core.plan import make_plan
from agent.core.recovery import Degrade, Fail, Failover, recovery_decision
from agent.core.routing import choose_route
from tests.agent.core.test_routing import failure_case, recoverable, route_of
from tests.examples import examples


def test_a_lost_node_whose_layers_have_replicas_fails_over_on_the_same_plan():
    plan = make_plan({"A": 40.0, "B": 27.0, "C": 20.0, "D": 13.0}, 30, replica_count=2, replicate_head_ratio=0.4)
    route = choose_route(plan, dict(plan.scores))
    decision = recovery_decision(route, {"A"}, plan, {"B", "C", "D"}, {}, allow_fallback=False)
    assert isinstance(decision, Failover)
    assert "A" not in decision.route.nodes and decision.route.total_layers == 30
    assert decision.lost_layers == tuple(range(0, 12))


def test_a_lost_tail_without_replica_degrades_or_fails_as_the_fallback_is_allowed():
    plan = make_plan({"A": 40.0, "B": 27.0, "C": 20.0, "D": 13.0}, 30, replica_count=2)
    route = choose_route(plan, dict(plan.scores))
    degrade = recovery_decision(route, {"D"}, plan, {"A", "B", "C"}, {}, allow_fallback=True)
    fail = recovery_decision(route, {"D"}, plan, {"A", "B", "C"}, {}, allow_fallback=False)
    assert isinstance(degrade, Degrade) and isinstance(fail, Fail)
    assert "26-29" in fail.reason and "D" in fail.reason and degrade.reason == fail.reason


def test_a_node_off_the_route_changes_nothing():
    plan = make_plan({"A": 40.0, "B": 27.0}, 8, replica_count=1)
    route = route_of(("A", 0, 7))
    decision = recovery_decision(route, {"B"}, plan, {"A"}, {}, allow_fallback=False)
    assert decision == Failover(route, ())


@given(failure_case())
@settings(max_examples=examples(200))
def test_the_decision_is_a_failover_exactly_when_every_lost_layer_has_a_live_holder(case):
    plan, dead, telemetry = case
    alive = set(dict(plan.scores)) - dead
    route = choose_route(plan, dict(plan.scores), telemetry)
    for allow_fallback in (True, False):
        decision = recovery_decision(route, dead, plan, alive, telemetry, allow_fallback=allow_fallback)
        if recoverable(plan, route, dead, alive):
            assert isinstance(decision, Failover) and not set(decision.route.nodes) & dead
            assert decision.route.total_layers == plan.total_layers
        else:
            assert isinstance(decision, Degrade if allow_fallback else Fail)
