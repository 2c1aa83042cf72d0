"""What the orchestrator decides about the deployments it runs (design §6–§8), as data.

The orchestrator's I/O (:mod:`agent.orchestration.orchestrator`, :mod:`agent.orchestration.deployer`) gathers what it
knows (live members, the nodes each deployed route uses, faults and fingerprints, the orders
workers report, the time) and carries out what these functions return, the way
:meth:`agent.core.model_registry.ModelRegistry.next_action` drives the model router:

- :func:`failovers` and :func:`replan_decision`: after the members change, which deployments
  fail over (a node of their route left) and whether every model is planned again (a node
  joined, or a node left out of plans changed), now or after the minimum interval between
  re-plans;
- :func:`adoption_actions`: a new orchestrator takes over the newest order of each model the
  workers report, redeploying it as it is or failing over from its dead nodes;
- :func:`clear_faults`: which nodes that could not stage a plan may be planned again;
- :func:`orphaned_orders`: the orders a node holds that no deployment names (it missed an
  unload while it was frozen or away), to be dropped when it is seen again;
- :func:`resolve_fallback` and :func:`weight_sources`: which model to fall back to, and where
  to fetch a model's files from.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from agent.core.errors import ClusterError
from agent.core.node_report import WorkerReport
from agent.core.orders import RoutingOrder
from agent.core.state_enum import StateEnum

TINY_ALIAS = "ncm-tiny"  # the fallback setting that means "the smallest model a live node holds whole"


class ClusterState(StateEnum):
    """What the orchestrator reports about the cluster (its value is what the views show)::

        starting --another node is elected--> follower <--another node is elected-- (any)
        starting --elected: the workers' orders adopted--> ok | degraded | idle
        ok, idle --a model loads--> loading --done--> ok | idle
        ok --a node of a route died, replicas took over--> ok
        ok --layers lost: a fallback serves--> degraded --re-planned on every layer--> ok
        ok, degraded --no failover possible--> failed --a model loads again--> loading
    """

    STARTING = "starting"
    FOLLOWER = "follower"
    IDLE = "idle"
    LOADING = "loading"
    OK = "ok"
    DEGRADED = "degraded"
    FAILED = "failed"


@dataclass(frozen=True)
class NodeFault:
    """Why a node could not stage a plan; it is left out of plans while ``fingerprint`` (what
    it advertises and holds) is unchanged and it has not withdrawn the fault itself."""

    cause: str
    message: str
    fingerprint: str
    reported: bool = False  # the node itself has reported the fault (so withdrawing it means something)


@dataclass(frozen=True)
class Recover:
    """Fail model ``name`` over from ``lost``, nodes of its route that left."""

    name: str
    lost: frozenset[str]


@dataclass(frozen=True)
class Replan:
    """Plan every deployed model again over the live members (§8)."""

    reason: str


@dataclass(frozen=True)
class WaitToReplan:
    """A re-plan is due but the last one was less than the minimum interval ago: look again
    after ``wait_s``."""

    wait_s: float


@dataclass(frozen=True)
class Redeploy:
    """A new orchestrator sends ``order`` again as it is (every node of its route is alive)."""

    order: RoutingOrder


@dataclass(frozen=True)
class AdoptAndRecover:
    """A new orchestrator takes ``order`` over and fails over from its ``dead`` nodes."""

    order: RoutingOrder
    dead: frozenset[str]


AdoptionAction = Redeploy | AdoptAndRecover


def failovers(members: frozenset[str], routes: Mapping[str, Iterable[str]]) -> list[Recover]:
    """The deployments to fail over after the live members changed to ``members``: those
    whose route (``routes``: per model, the nodes of its route) lost a node, in model order."""
    lost = {name: frozenset(nodes) - members for name, nodes in routes.items()}
    return [Recover(name, lost[name]) for name in sorted(lost) if lost[name]]


def replan_decision(*, members: frozenset[str], deployed_members: frozenset[str], deployed: bool,
                    replan_pending: bool, last_replan_s: float, now_s: float,
                    replan_min_interval_s: float) -> Replan | WaitToReplan | None:
    """Whether every deployed model is planned again (§8): when some model is ``deployed`` and
    a node joined since the last plan (``members`` beyond ``deployed_members``) or a node left
    out of plans changed (``replan_pending``); no sooner than ``replan_min_interval_s`` after
    the last re-plan."""
    joined = bool(members - deployed_members)
    if not deployed or not (joined or replan_pending):
        return None
    wait_s = last_replan_s + replan_min_interval_s - now_s
    if wait_s > 0:
        return WaitToReplan(wait_s)
    return Replan("a node joined" if joined else "a node that could not stage a plan changed")


def newest_orders(reports: Iterable[WorkerReport]) -> dict[str, RoutingOrder]:
    """Per model, the newest order the workers' ``reports`` name."""
    newest: dict[str, RoutingOrder] = {}
    for report in reports:
        for order in report.orders:
            if order.name not in newest or order.plan_version > newest[order.name].plan_version:
                newest[order.name] = order
    return newest


def adoption_actions(reports: Iterable[WorkerReport], alive: Iterable[str]) -> list[AdoptionAction]:
    """What a new orchestrator does with the newest order of each model the workers report."""
    alive = set(alive)
    actions: list[AdoptionAction] = []
    for _, order in sorted(newest_orders(reports).items()):
        dead = frozenset(order.route.nodes) - alive
        actions.append(AdoptAndRecover(order, dead) if dead else Redeploy(order))
    return actions


@dataclass(frozen=True)
class DropOrphans:
    """Node ``node`` holds orders (served or staged) of ``models``, which no deployment names."""

    node: str
    models: tuple[str, ...]


def orphaned_orders(reports: Mapping[str, WorkerReport], deployed: Iterable[str],
                    busy: Iterable[str]) -> list[DropOrphans]:
    """What each node must drop: the models its worker report holds (served or staged) that
    are not ``deployed``, leaving alone the ``busy`` ones (a load or re-plan of them is under
    way: their orders are being staged)."""
    keep = set(deployed) | set(busy)
    actions = []
    for node, report in sorted(reports.items()):
        orphans = tuple(sorted(report.held - keep))
        if orphans:
            actions.append(DropOrphans(node, orphans))
    return actions


def clear_faults(faults: Mapping[str, NodeFault], *, members: Iterable[str], fingerprints: Mapping[str, str],
                 reported: Iterable[str]) -> tuple[dict[str, NodeFault], list[str]]:
    """Forget the faults of nodes that left, changed (their ``fingerprints`` differ), or
    withdrew a fault they had reported (not in ``reported`` any more). Returns the faults kept
    and the live nodes that may be planned again."""
    members, reported = set(members), set(reported)
    kept: dict[str, NodeFault] = {}
    cleared: list[str] = []
    for node_id, fault in sorted(faults.items()):
        if node_id not in members:
            continue
        if fingerprints.get(node_id) != fault.fingerprint or (fault.reported and node_id not in reported):
            cleared.append(node_id)
        else:
            kept[node_id] = replace(fault, reported=True) if node_id in reported else fault
    return kept, cleared


def resolve_fallback(configured: str, holdings: Mapping[str, Mapping[str, int]]) -> str:
    """The fallback model: ``configured``, or with :data:`TINY_ALIAS` the model of that name
    if a live node holds it, else the smallest model some live node holds whole."""
    if configured != TINY_ALIAS:
        return configured
    sizes: dict[str, int] = {}
    for models in holdings.values():
        sizes.update(models)
    if TINY_ALIAS in sizes:
        return TINY_ALIAS
    if not sizes:
        raise ClusterError("no live node holds a whole model to fall back to")
    return min(sizes, key=lambda name: (sizes[name], name))


def weight_sources(model: str, holdings: Mapping[str, Mapping[str, int]], self_id: str) -> list[str]:
    """Nodes to fetch ``model``'s files from: live nodes holding it whole (``self_id`` first),
    then every other live node, which may hold some of its layers."""
    return sorted(holdings, key=lambda n: (model not in holdings[n], n != self_id, n))
