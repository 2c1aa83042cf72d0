import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.election import Election, elect, newer, newest
from agent.core.errors import ElectionError
from tests.agent.core.strategies import cluster_scores


def test_strongest_member_is_elected_first_with_epoch_one():
    assert elect({"a": 1.0, "b": 5.0, "c": 5.0}) == Election("b", 1)


def test_election_is_static_when_a_stronger_node_joins():
    current = elect({"a": 1.0, "b": 2.0})
    assert elect({"a": 1.0, "b": 2.0, "giant": 1000.0}, current) == current


def test_losing_the_orchestrator_raises_the_epoch():
    current = Election("b", 3)
    assert elect({"a": 1.0, "c": 2.0}, current) == Election("c", 4)


def test_configured_orchestrator_wins_when_present():
    current = Election("b", 2)
    assert elect({"a": 1.0, "b": 9.0}, current, configured_orchestrator="a") == Election("a", 3)
    assert elect({"a": 1.0, "b": 9.0}, Election("a", 3), configured_orchestrator="a") == Election("a", 3)
    # Absent configured node: the normal rule applies.
    assert elect({"b": 9.0, "c": 1.0}, None, configured_orchestrator="a") == Election("b", 1)


def test_empty_membership_is_an_error():
    with pytest.raises(ElectionError):
        elect({})


def test_newer_claim_wins_by_epoch_then_lower_id():
    assert newer(Election("z", 2), Election("a", 1)) == Election("z", 2)
    assert newer(Election("z", 2), Election("a", 2)) == Election("a", 2)
    assert newest([Election("c", 1), Election("b", 4), Election("a", 4)]) == Election("a", 4)
    assert newest([]) is None


def test_bad_epoch_is_rejected():
    with pytest.raises(ValueError):
        Election("a", 0)


@given(cluster_scores(max_nodes=16), st.randoms(use_true_random=False))
def test_every_node_computes_the_same_orchestrator(scores, rng):
    items = list(scores.items())
    rng.shuffle(items)
    assert elect(dict(items)) == elect(scores)
    winner = elect(scores)
    assert winner.orchestrator in scores
    assert all(scores[winner.orchestrator] >= value for value in scores.values())


@given(cluster_scores(min_nodes=2, max_nodes=16), st.data())
def test_current_orchestrator_keeps_the_role_while_alive(scores, data):
    current = Election(data.draw(st.sampled_from(sorted(scores))), data.draw(st.integers(1, 50)))
    assert elect(scores, current) == current
    survivors = {n: s for n, s in scores.items() if n != current.orchestrator}
    successor = elect(survivors, current)
    assert successor.orchestrator in survivors and successor.epoch == current.epoch + 1
    assert newer(successor, current) == successor
