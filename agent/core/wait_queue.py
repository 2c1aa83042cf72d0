"""The model router's wait queue (design §10). Pure.

Requests waiting for the same model share one :class:`QueueEntry`; only the entry at the head
of the queue may load, and only one loader runs per model (the entry is *claimed*). What a
model's state does when its entry leaves is the registry's (:mod:`agent.core.model_registry`).
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.core.errors import RouterError


@dataclass
class QueueEntry:
    """Every request waiting for one model. ``outcome`` is set when the entry leaves the queue."""

    model: str
    waiters: int = 0
    claimed: bool = False
    outcome: RouterError | None = None
    done: bool = False


class WaitQueue(list[QueueEntry]):
    """The entries in the order their first request came (the head loads first)."""

    def find(self, name: str) -> QueueEntry | None:
        return next((q for q in self if q.model == name), None)

    def join(self, name: str) -> QueueEntry:
        """A request waits for ``name``; requests for one model share one entry."""
        queued = self.find(name)
        if queued is None:
            queued = QueueEntry(name)
            self.append(queued)
        queued.waiters += 1
        return queued

    def take_out(self, ticket: QueueEntry, outcome: RouterError | None) -> None:
        """``ticket`` leaves the queue, done, with ``outcome`` for its waiters (None: served)."""
        if ticket in self:
            self.remove(ticket)
        ticket.done, ticket.claimed, ticket.outcome = True, False, outcome

    def waited_for(self) -> set[str]:
        return {q.model for q in self}
