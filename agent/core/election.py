"""Orchestrator election as a pure function of the membership.

The rule is static: the current orchestrator keeps the role while it is alive, even when a
stronger node joins (no flapping). A node configured as orchestrator wins whenever it is a
member. Otherwise the strongest member (highest score, then lowest node id) is chosen. Every
change of orchestrator raises the epoch, so any node can tell orders of an old orchestrator
(lower epoch) from the current one. There is no consensus protocol: two claims are resolved
by :func:`newer`, the same way on every node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from agent.core.capacity import validate_node_id
from agent.core.errors import ElectionError


@dataclass(frozen=True)
class Election:
    """Who the orchestrator is, and the epoch that orchestrator was chosen in."""

    orchestrator: str
    epoch: int

    def __post_init__(self) -> None:
        validate_node_id(self.orchestrator)
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 1:
            raise ValueError(f"epoch must be an integer >= 1, got {self.epoch!r}")


def newer(a: Election, b: Election) -> Election:
    """The claim that wins between two: the higher epoch, then the lower orchestrator id."""
    if a.epoch != b.epoch:
        return a if a.epoch > b.epoch else b
    return a if a.orchestrator <= b.orchestrator else b


def newest(claims: Iterable[Election]) -> Election | None:
    """The winning claim among many (None when there are none)."""
    winner: Election | None = None
    for claim in claims:
        winner = claim if winner is None else newer(winner, claim)
    return winner


def elect(
    members: Mapping[str, float],
    current: Election | None = None,
    configured_orchestrator: str | None = None,
) -> Election:
    """Choose the orchestrator among ``members`` (node id -> score).

    Keeps ``current`` while its orchestrator is a member, unless a configured orchestrator
    is a member and is someone else.
    """
    if not members:
        raise ElectionError("cannot elect an orchestrator: no member is alive")
    epoch = current.epoch if current is not None else 0
    if configured_orchestrator is not None and configured_orchestrator in members:
        if current is not None and current.orchestrator == configured_orchestrator:
            return current
        return Election(configured_orchestrator, epoch + 1)
    if current is not None and current.orchestrator in members:
        return current
    strongest = min(members, key=lambda node_id: (-members[node_id], node_id))
    return Election(strongest, epoch + 1)
