"""Where whole copies of a model go, and which one a request runs on (design §11).

``placement = auto`` places whole copies on the nodes with room for one beside what they hold
now, and splits the model (the seed's plan) only when no node has that room.

A model placed as whole copies serves each request on one node alone: of the copies running
fewer requests than their memory holds KV caches for (each as many as its own room takes, so
a node with more room runs more), the one with the fewest requests running from this
orchestrator, and among those the one whose prompt cache keeps the longest beginning of the
request's prompt (the next turn of a conversation goes back to where its last turn is kept),
then the first in serving order (the orchestrator's own copy, whose requests cross no network
at each token, then the route's head).
Pure: the token loop counts the requests and asks the prompt cache's books.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence


def copy_holders(members: Collection[str], short: Mapping[str, int]) -> frozenset[str]:
    """The ``members`` that hold a whole copy under ``placement = auto``: those a plan of a
    copy on every member leaves ``short`` of nothing (empty: none has room; split it)."""
    return frozenset(members) - set(short)


def pick_copy(nodes: Sequence[str], running: Mapping[str, int], reuse: Mapping[str, int],
              sessions: Mapping[str, int] | None = None) -> str:
    """The node of ``nodes`` (in serving order) a request runs on: among those running fewer
    than the ``sessions`` their memory holds (a node not named, or none when all are full,
    holds any number), the fewest ``running``, then the most prompt tokens its prompt cache
    keeps (``reuse``), then the first."""
    if not nodes:
        raise ValueError("a request needs at least one node to run on")
    sessions = sessions or {}
    free = [n for n in nodes if n not in sessions or running.get(n, 0) < sessions[n]] or nodes
    return min(free, key=lambda n: (running.get(n, 0), -reuse.get(n, 0), nodes.index(n)))


__all__ = ["copy_holders", "pick_copy"]
