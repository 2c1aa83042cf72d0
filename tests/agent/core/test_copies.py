"""Where whole copies go under placement = auto (the nodes with room), and which copy a
request runs on: the least busy, then the one keeping its prompt."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.copies import copy_holders, pick_copy

NODES = st.lists(st.sampled_from("abcdef"), min_size=1, max_size=6, unique=True)


@given(NODES, st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 9)),
       st.dictionaries(st.sampled_from("abcdef"), st.integers(32, 2000)))
def test_the_pick_is_among_the_least_busy_and_keeps_the_longest_prompt_there(nodes, running, reuse):
    chosen = pick_copy(nodes, running, reuse)
    least = min(running.get(n, 0) for n in nodes)
    assert chosen in nodes and running.get(chosen, 0) == least
    assert reuse.get(chosen, 0) == max(reuse.get(n, 0) for n in nodes if running.get(n, 0) == least)


def test_ties_go_to_the_first_in_serving_order():
    assert pick_copy(["b", "a", "c"], {}, {}) == "b"
    assert pick_copy(["b", "a", "c"], {"b": 1}, {}) == "a"
    assert pick_copy(["b", "a", "c"], {"b": 1}, {"c": 100}) == "c"  # the next turn goes where it is kept
    assert pick_copy(["b", "a", "c"], {"c": 1}, {"c": 100}) == "b"  # but not to a busier copy


@given(NODES, st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 9)),
       st.dictionaries(st.sampled_from("abcdef"), st.integers(1, 9)))
def test_the_pick_goes_to_a_copy_with_room_for_one_more_while_one_has(nodes, running, sessions):
    chosen = pick_copy(nodes, running, {}, sessions)
    free = [n for n in nodes if n not in sessions or running.get(n, 0) < sessions[n]]
    assert chosen in (free or nodes)
    assert running.get(chosen, 0) == min(running.get(n, 0) for n in (free or nodes))


def test_a_copy_with_more_room_takes_more_requests():
    sessions = {"a": 1, "b": 3}
    running: dict[str, int] = {}
    for _ in range(4):  # four requests arrive, none ends
        node = pick_copy(["a", "b"], running, {}, sessions)
        running[node] = running.get(node, 0) + 1
    assert running == {"a": 1, "b": 3}
    assert pick_copy(["a", "b"], running, {}, sessions) == "a"  # all full (admission lets none in): the fewest


def test_no_node_is_refused():
    with pytest.raises(ValueError):
        pick_copy([], {}, {})


def test_auto_places_copies_where_nothing_is_short_and_splits_when_no_node_has_room():
    assert copy_holders({"a", "b", "c"}, {}) == {"a", "b", "c"}
    assert copy_holders({"a", "b", "c"}, {"b": 1}) == {"a", "c"}
    assert copy_holders({"a", "b"}, {"a": 5, "b": 1}) == frozenset()
