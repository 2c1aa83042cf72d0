"""The router's capacity ledgers (agent/core/memory_ledger.py): what each device has for models,
what a need lacks, which idle models to evict for it, and a refusal that says why."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.errors import CapacityError, RouterError
from agent.core.memory_ledger import MIB, DeviceMemory, MemoryLedger


@dataclass
class Model:
    name: str
    held: dict[str, int] = field(default_factory=dict)
    loaded: bool = True

    def held_bytes(self) -> dict[str, int]:
        return self.held if self.loaded else {}

    def counted(self) -> bool:
        return self.loaded


def ledger_of(*models: Model, models_max: int = 0, margin: int = 0, **totals: int) -> MemoryLedger:
    ledger = MemoryLedger({m.name: m for m in models}, models_max, margin)
    ledger.devices = {node: DeviceMemory(total) for node, total in totals.items()}
    return ledger


def test_bad_figures_are_refused():
    with pytest.raises(RouterError, match="must be >= 0"):
        MemoryLedger({}, models_max=-1)
    with pytest.raises(RouterError, match="total_bytes must be an integer"):
        DeviceMemory(True)
    with pytest.raises(RouterError, match="external_bytes"):
        DeviceMemory(10, -1)


def test_the_budget_is_total_less_external_less_margin_and_unknown_nodes_have_no_limit():
    ledger = ledger_of(margin=5)
    ledger.devices = {"n1": DeviceMemory(100, 20)}
    assert ledger.budget_bytes("n1") == 75 and ledger.budget_bytes("n2") is None
    assert ledger.shortfall({"n2": 10**12}) == {}


@given(st.lists(st.integers(0, 50), min_size=1, max_size=6), st.integers(0, 200), st.integers(0, 200))
def test_a_need_fits_exactly_when_no_node_lacks_bytes(helds, total, need):
    models = [Model(f"m{i}", {"n1": held}) for i, held in enumerate(helds)]
    ledger = ledger_of(*models, n1=total)
    free = total - sum(helds)
    assert ledger.shortfall({"n1": need}) == ({} if need <= free else {"n1": need - free})
    assert ledger.fits({"n1": need}, []) == (need <= free)
    everyone = [m.name for m in models]
    assert ledger.fits({"n1": need}, everyone) == (need <= total)


def test_models_max_counts_loaded_models_only():
    ledger = ledger_of(Model("a"), Model("b", loaded=False), models_max=2)
    assert ledger.loaded_count() == 1 and not ledger.over_count()
    ledger.models["c"] = Model("c")
    assert ledger.over_count() and not ledger.over_count(["c"])


def test_victims_are_the_fewest_least_recently_used_models_that_make_room():
    old, middle, new = Model("old", {"n1": 30}), Model("middle", {"n2": 50}), Model("new", {"n1": 40})
    ledger = ledger_of(old, middle, new, n1=100, n2=100)
    # n1 has 30 free; 60 needs 30 more: the oldest holder on n1 is enough, the one on n2 is no help.
    assert ledger.victims({"n1": 60}, [old, middle, new]) == ["old"]
    assert ledger.victims({"n1": 95}, [old, middle, new]) == ["old", "new"]
    assert ledger.victims({"n1": 101}, [old, middle, new]) == []


def test_a_refusal_names_the_device_the_idle_models_and_why_the_rest_is_kept():
    idle, busy = Model("idle", {"n1": 20 * MIB}), Model("busy", {"n1": 60 * MIB})
    ledger = ledger_of(idle, busy, n1=100 * MIB)
    error = ledger.refusal("new", {"n1": 50 * MIB}, ["idle"], lambda m: "serving 1 request")
    assert isinstance(error, CapacityError) and error.retry_after_s == 10.0
    text = str(error)
    assert "it needs 50 MiB on node n1, which has 20 MiB free" in text
    assert "evicting the idle model idle would free only 20 MiB more" in text
    assert "the rest is held by busy (60 MiB, serving 1 request)" in text


def test_a_need_larger_than_the_device_is_refused_for_good():
    ledger = ledger_of(n1=100 * MIB)
    error = ledger.refusal("huge", {"n1": 200 * MIB}, [], lambda m: "")
    assert error.retry_after_s is None and "even with nothing else loaded" in str(error)


def test_the_requests_of_a_model_that_fit_follow_the_room_every_node_has_left():
    """One request is counted in what a model holds; the others take what is left on every
    node of its route, at most ``most``; a node without a reported limit limits nothing."""
    ledger = ledger_of(Model("m", {"a": 400, "b": 100}), a=1000, b=10_000)
    assert ledger.sessions_fitting({"a": 100, "b": 1000}, 16) == 1 + 600 // 100  # a: 6 more; b: 9 more
    assert ledger.sessions_fitting({"a": 100, "b": 1000}, 4) == 4
    assert ledger.sessions_fitting({"a": 700}, 8) == 1  # no room for a second: still one
    assert ledger.sessions_fitting({"unreported": 10**12, "a": 0}, 8) == 8
    over = ledger_of(Model("m", {"a": 1200}), a=1000)
    assert over.sessions_fitting({"a": 1}, 8) == 1


def test_the_requests_of_whole_copies_are_one_node_each_as_many_on_each_as_its_own_room_takes():
    """A model placed as whole copies holds a request's cache on one node alone: each copy
    takes as many as its own room holds (at most ``most``), the model all of them together."""
    ledger = ledger_of(Model("m", {"a": 400, "b": 100, "c": 100}), a=1000, b=10_000, c=350)
    sessions = {"a": 100, "b": 100, "c": 100}
    assert ledger.sessions_per_node(sessions, 16) == {"a": 1 + 600 // 100, "b": 16, "c": 1 + 250 // 100}
    assert ledger.sessions_fitting(sessions, 16, one_node_each=True) == 7 + 16 + 3
    assert ledger.sessions_fitting(sessions, 4, one_node_each=True) == 4 + 4 + 3  # at most ``most`` per copy
    assert ledger.sessions_fitting(sessions, 16) == 3  # split: every request on every node
    assert ledger.sessions_fitting({"a": 700}, 8, one_node_each=True) == 1
    assert ledger.sessions_fitting({}, 8, one_node_each=True) == 8


@given(st.dictionaries(st.sampled_from("abc"), st.integers(0, 10**6), min_size=1),
       st.dictionaries(st.sampled_from("abc"), st.integers(0, 10**4)), st.integers(1, 32), st.booleans())
def test_the_requests_that_fit_are_within_one_and_most_and_their_caches_fit(totals, session, most, copies):
    ledger = ledger_of(Model("m", {n: t // 3 for n, t in totals.items()}), **totals)
    count = ledger.sessions_fitting(session, most, one_node_each=copies)
    per_node = ledger.sessions_per_node(session, most) if copies else {node: count for node in session}
    if copies and session:
        assert sum(per_node.values()) == count
    else:
        assert 1 <= count <= most
    for node, per_session in session.items():
        assert 1 <= per_node[node] <= most
        if node in totals and per_node[node] > 1:
            assert (per_node[node] - 1) * per_session <= totals[node] - totals[node] // 3
