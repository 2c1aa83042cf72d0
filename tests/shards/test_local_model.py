"""A model opened on one machine: its layers cut in ranges that open side by side, the
tokenizer loading meanwhile, and the same text whatever the cut."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fragment_helpers import write_tiny_checkpoint
from shards.errors import CorruptWeightsError, RunnerError
from shards.generate import LocalModel, prompt_ids_for
from shards.importer import import_model
from shards.runner import even_cuts, open_chain
from shards.sampling import SamplingParams
from shards.store import ModelStore

LAYERS = 5


@given(n_layers=st.integers(1, 64), parts=st.integers(1, 70))
def test_even_cuts_tile_the_layers_in_ranges_that_differ_by_one_at_most(n_layers: int, parts: int) -> None:
    cuts = even_cuts(n_layers, parts)
    assert len(cuts) == min(parts, n_layers)
    assert cuts[0][0] == 0 and cuts[-1][1] == n_layers - 1
    assert all(b + 1 == a for (_, b), (a, _) in zip(cuts, cuts[1:]))
    sizes = [b - a + 1 for a, b in cuts]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("n_layers,parts", [(0, 1), (4, 0)])
def test_even_cuts_refuse_nothing_to_cut(n_layers: int, parts: int) -> None:
    with pytest.raises(RunnerError):
        even_cuts(n_layers, parts)


def tiny_store(tmp: Path) -> ModelStore:
    store = ModelStore(tmp / "home")
    import_model(write_tiny_checkpoint(tmp / "checkpoint", layers=LAYERS), name="tiny", store=store, progress=False)
    return store


def greedy_text(model: LocalModel) -> str:
    ids = prompt_ids_for(model.tokenizer, "hello world")
    return "".join(e.text for e in model.generate(ids, SamplingParams(temperature=0.0, max_tokens=12)))


def test_the_text_is_the_same_however_the_layers_are_cut(tmp_path: Path) -> None:
    store, texts = tiny_store(tmp_path), {}
    for parts in (1, 2, 3, LAYERS):
        with LocalModel.open("tiny", store, parts=parts, threads=1) as model:
            assert [(r.first_layer, r.last_layer) for r in model.runners] == even_cuts(LAYERS, parts)
            texts[parts] = greedy_text(model)
    assert texts[1] and len(set(texts.values())) == 1, texts


def test_a_range_that_cannot_open_fails_the_chain_with_its_own_error(tmp_path: Path) -> None:
    store = tiny_store(tmp_path)
    model_dir = store.model_dir("tiny")
    layer = model_dir / store.manifest("tiny").files["layer.3"].path
    data = bytearray(layer.read_bytes())
    data[len(data) // 2] ^= 0x40
    layer.unlink()
    layer.write_bytes(bytes(data))
    with pytest.raises(CorruptWeightsError):
        open_chain(model_dir, [(0, 1), (2, 3), (4, 4)], threads=1)
