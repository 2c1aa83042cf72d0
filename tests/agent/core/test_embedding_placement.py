"""Where an embedding model runs: cases, and properties over random clusters."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.embedding_placement import place_embedding_model
from agent.core.errors import CapacityError
from agent.core.memory_ledger import MIB

FREE = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.one_of(st.none(), st.integers(-500, 500)),
                       min_size=1)


def test_the_orchestrator_first_then_the_node_with_most_room():
    free = {"orch": 50 * MIB, "b": 400 * MIB, "c": 300 * MIB}
    assert place_embedding_model("m", 40 * MIB, free, orchestrator="orch") == "orch"
    assert place_embedding_model("m", 90 * MIB, free, orchestrator="orch") == "b"
    assert place_embedding_model("m", 90 * MIB, {**free, "c": None}, orchestrator="orch") == "c"  # no limit set


def test_an_open_model_stays_where_it_is():
    free = {"orch": 500 * MIB, "b": 0}
    assert place_embedding_model("m", 90 * MIB, free, orchestrator="orch", open_on={"b"}) == "b"
    assert place_embedding_model("m", 90 * MIB, free, orchestrator="orch", open_on={"gone"}) == "orch"


def test_no_room_anywhere_is_refused_with_the_most_there_is():
    with pytest.raises(CapacityError, match=r"'m' \(90 MiB\): the most free is 60 MiB on b") as caught:
        place_embedding_model("m", 90 * MIB, {"orch": 10 * MIB, "b": 60 * MIB}, orchestrator="orch")
    assert caught.value.retry_after_s and caught.value.answer().status == 503
    with pytest.raises(CapacityError, match="no node is live"):
        place_embedding_model("m", 1, {}, orchestrator="orch")


@given(FREE, st.integers(0, 400), st.sampled_from(["a", "b", "e"]), st.sets(st.sampled_from(["a", "c", "e"])))
def test_the_chosen_node_is_live_and_has_room_unless_the_model_is_open_there(free, need, orchestrator, open_on):
    try:
        node = place_embedding_model("m", need, free, orchestrator=orchestrator, open_on=open_on)
    except CapacityError:
        assert all(room is not None and room < need for room in free.values())
        assert not open_on & free.keys()
        return
    assert node in free
    if node not in open_on:
        assert free[node] is None or free[node] >= need
        room = {n: float("inf") if r is None else r for n, r in free.items()}
        assert node == orchestrator or room[node] == max(room.values())
