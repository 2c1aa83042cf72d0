"""The model router's wait queue (agent/core/wait_queue.py): one entry per model, in the order
the first request for it came, and an entry that leaves is done with its outcome."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agent.core.errors import CapacityError
from agent.core.wait_queue import WaitQueue


@given(st.lists(st.sampled_from("abcd"), max_size=30))
def test_requests_for_one_model_share_its_entry_in_first_come_order(names):
    queue = WaitQueue()
    tickets = [queue.join(name) for name in names]
    assert [q.model for q in queue] == list(dict.fromkeys(names))
    for name in set(names):
        entry = queue.find(name)
        assert entry is not None and entry.waiters == names.count(name)
        assert all(t is entry for t, n in zip(tickets, names) if n == name)
    assert queue.waited_for() == set(names)


def test_an_entry_taken_out_is_done_with_its_outcome_and_unclaimed():
    queue = WaitQueue()
    ticket = queue.join("a")
    queue.join("b")
    ticket.claimed = True
    refusal = CapacityError("no room", 10.0)
    queue.take_out(ticket, refusal)
    assert ticket.done and not ticket.claimed and ticket.outcome is refusal
    assert queue.find("a") is None and [q.model for q in queue] == ["b"]
    queue.take_out(ticket, None)  # already out: only its outcome changes
    assert [q.model for q in queue] == ["b"] and ticket.outcome is None


def test_a_model_joined_again_after_leaving_gets_a_new_entry_at_the_end():
    queue = WaitQueue()
    first = queue.join("a")
    queue.join("b")
    queue.take_out(first, None)
    again = queue.join("a")
    assert again is not first and again.waiters == 1 and not again.done
    assert [q.model for q in queue] == ["b", "a"]
