"""Where whole copies of a model go, and which one a request runs on (design §11).

``placement = auto`` places whole copies on the nodes with room for one beside what they hold
now, and splits the model (the seed's plan) only when no node has that room.

A model placed as whole copies serves each request on one node alone: the copy with the
fewest requests running from this orchestrator, and among those the one whose prompt cache
keeps the longest beginning of the request's prompt (the next turn of a conversation goes
back to where its last turn is kept), then the first in serving order (the orchestrator's own
copy, whose requests cross no network at each token, then the route's head).
Pure: the token loop counts the requests and asks the prompt cache's books.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence


def copy_holders(members: Collection[str], short: Mapping[str, int]) -> frozenset[str]:
    """The ``members`` that hold a whole copy under ``placement = auto``: those a plan of a
    copy on every member leaves ``short`` of nothing (empty: none has room; split it)."""
    return frozenset(members) - set(short)


def pick_copy(nodes: Sequence[str], running: Mapping[str, int], reuse: Mapping[str, int]) -> str:
    """The node of ``nodes`` (in serving order) a request runs on: the fewest ``running``,
    then the most prompt tokens its prompt cache keeps (``reuse``), then the first."""
    if not nodes:
        raise ValueError("a request needs at least one node to run on")
    return min(nodes, key=lambda n: (running.get(n, 0), -reuse.get(n, 0), nodes.index(n)))


__all__ = ["copy_holders", "pick_copy"]
