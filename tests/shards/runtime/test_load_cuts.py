"""Where a layer range is cut to open in parts (shards/runtime/load_cuts.py): properties of the
pure cut; the cost of the last range is in test_chain.py, on a real store."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shards.errors import RunnerError
from shards.runtime.load_cuts import balanced_cuts


@given(costs=st.lists(st.integers(1, 1000), min_size=1, max_size=64), parts=st.integers(1, 70))
def test_balanced_cuts_tile_the_layers_each_within_a_layer_of_an_equal_share(costs: list[int], parts: int) -> None:
    cuts = balanced_cuts(costs, parts, first_layer=7)
    assert len(cuts) == min(parts, len(costs))
    assert cuts[0][0] == 7 and cuts[-1][1] == 7 + len(costs) - 1
    assert all(b + 1 == a for (_, b), (a, _) in zip(cuts, cuts[1:]))
    assert all(a <= b for a, b in cuts)
    share = sum(costs) / len(cuts)
    assert all(sum(costs[a - 7:b - 6]) <= share + max(costs) for a, b in cuts)


@given(n_layers=st.integers(1, 64), parts=st.integers(1, 70))
def test_equal_costs_cut_in_ranges_that_differ_by_one_layer_at_most(n_layers: int, parts: int) -> None:
    sizes = [b - a + 1 for a, b in balanced_cuts([5] * n_layers, parts)]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("n_layers,parts", [(0, 1), (4, 0)])
def test_balanced_cuts_refuse_nothing_to_cut(n_layers: int, parts: int) -> None:
    with pytest.raises(RunnerError):
        balanced_cuts([1] * n_layers, parts)
