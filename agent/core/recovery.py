"""What a model does when nodes of its route fail (design §6, §7): one pure decision, which the
orchestrator carries out, whoever noticed the failure (a request's failed step, or the
membership losing a node).

- :class:`Failover`: every lost layer has a live holder (a replica): the route is spliced on
  the same plan, and the model stays what it was.
- :class:`Degrade`: some lost layer has no live holder and a fallback is allowed: the fallback
  model is laid over the survivors (the orchestrator fetches its manifest first, then lays it
  out with :func:`agent.core.routing.failover`).
- :class:`Fail`: neither: the model is lost, for the reason given.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from agent.core.errors import RoutingFailure
from agent.core.plan import ShardingPlan
from agent.core.routing import Route, Telemetry, failover


@dataclass(frozen=True)
class Failover:
    """Go on on ``route``, the same plan's route without the dead nodes."""

    route: Route
    lost_layers: tuple[int, ...]


@dataclass(frozen=True)
class Degrade:
    """Serve the fallback model over the surviving nodes: ``reason`` says which layers were lost."""

    reason: str


@dataclass(frozen=True)
class Fail:
    """The model cannot be served any more, for ``reason``."""

    reason: str


Recovery = Failover | Degrade | Fail


def recovery_decision(route: Route, dead: Iterable[str], plan: ShardingPlan, alive: Iterable[str],
                      telemetry: Mapping[str, Telemetry], *, allow_fallback: bool) -> Recovery:
    """What to do after ``dead`` nodes failed on ``route`` of ``plan``, ``alive`` the nodes still up."""
    try:
        decision = failover(route, dead, plan, alive, telemetry, allow_fallback=False)
    except RoutingFailure as failure:
        return Degrade(str(failure)) if allow_fallback else Fail(str(failure))
    return Failover(decision.route, decision.lost_layers)
