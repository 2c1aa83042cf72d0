"""Where an embedding model runs (pure): on one node, whole, chosen as a chat model's nodes are,
from the memory the router's ledger says each node has free.

An embedding model stays where it is open (its memory is already counted there). Else the
orchestrator takes it when it has room: every API request reaches the orchestrator, so the
vectors need no further hop. Else the node with the most free memory that has room; when no
node has room, the model is refused (503, ``model_capacity``) rather than squeezed in.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from agent.core.errors import CapacityError
from agent.core.memory_ledger import MIB

RETRY_AFTER_S = 10.0  # room comes back as chat models go idle and sleep


def place_embedding_model(name: str, weight_bytes: int, free_bytes: Mapping[str, int | None], *,
                          orchestrator: str, open_on: Collection[str] = ()) -> str:
    """The node of ``free_bytes`` (the live ones; None: it set no memory limit) that runs
    embedding model ``name`` of ``weight_bytes``; ``open_on``: the nodes where it is open now."""
    if weight_bytes < 0:
        raise ValueError(f"weight_bytes must be >= 0, got {weight_bytes}")
    still_open = sorted(node for node in open_on if node in free_bytes)
    if still_open:
        return orchestrator if orchestrator in still_open else still_open[0]

    def room(node: str) -> float:
        free = free_bytes[node]
        return float("inf") if free is None else free

    if orchestrator in free_bytes and room(orchestrator) >= weight_bytes:
        return orchestrator
    fitting = [node for node in free_bytes if room(node) >= weight_bytes]
    if fitting:
        return max(sorted(fitting), key=room)
    most = max(sorted(free_bytes), key=room, default=None)
    where = f"the most free is {max(room(most), 0) / MIB:.0f} MiB on {most}" if most is not None else "no node is live"
    raise CapacityError(f"no node has room for embedding model {name!r} ({weight_bytes / MIB:.0f} MiB): {where}",
                        RETRY_AFTER_S)


__all__ = ["place_embedding_model"]
