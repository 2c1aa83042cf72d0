"""A model opened on one machine: its layers cut in ranges that open side by side, the
tokenizer loading meanwhile, and the same text whatever the cut; a range served as a chain
of such runners (what an agent opens on the CPU) gives what one runner gives."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from shards.errors import CorruptWeightsError, RunnerError
from shards.importers.importer import import_model
from shards.runtime.chain import RunnerChain, open_chain, open_range
from shards.runtime.generate import LocalModel, prompt_ids_for
from shards.runtime.load_cuts import layer_load_costs, load_cuts
from shards.runtime.sampling import SamplingParams
from shards.store.model_store import ModelStore
from tests.shards.fragment_helpers import write_tiny_checkpoint

LAYERS = 5


def test_the_last_range_holds_fewer_layers_as_it_opens_the_output_layer_too(tmp_path: Path) -> None:
    m = tiny_store(tmp_path).manifest("tiny")
    costs = layer_load_costs(m)
    assert costs[-1] == costs[0] + m.vocab_size * m.hidden_size
    shape = dict(n_layers=16, hidden_size=2048, intermediate_size=8192, n_heads=32, n_kv_heads=8, head_dim=64,
                 vocab_size=49152)  # the 1B bench shape: its output layer weighs 1.7 layers
    assert load_cuts(SimpleNamespace(**shape), 0, 15, 2) == [(0, 8), (9, 15)]  # type: ignore[arg-type]


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
            assert [(r.first_layer, r.last_layer) for r in model.runners] == load_cuts(model.manifest, 0, LAYERS - 1, parts)
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


def test_a_range_opened_in_parts_runs_as_one_runner(tmp_path: Path) -> None:
    store = tiny_store(tmp_path)
    model_dir = store.model_dir("tiny")
    whole = open_range(model_dir, 1, 4, 1, threads=1)
    chain = open_range(model_dir, 1, 4, 3, threads=1)
    assert isinstance(chain, RunnerChain) and not isinstance(whole, RunnerChain)
    assert [(p.first_layer, p.last_layer) for p in chain.parts] == [(1, 1), (2, 3), (4, 4)]  # 4 opens the output too
    assert (chain.first_layer, chain.last_layer, chain.is_head, chain.is_tail) == (1, 4, False, True)
    rng = np.random.default_rng(2)
    prompts = {sid: rng.standard_normal((1, 3 + i, 64)).astype(np.float32) for i, sid in enumerate("abc")}
    for sid, x in prompts.items():
        for runner in (whole, chain):
            runner.open_session(sid)
        np.testing.assert_allclose(chain.forward(sid, x, last_only=True), whole.forward(sid, x, last_only=True),
                                   atol=1e-5, rtol=0)
    step = rng.standard_normal((3, 1, 64)).astype(np.float32)
    np.testing.assert_allclose(chain.forward_batch(list("abc"), step), whole.forward_batch(list("abc"), step),
                               atol=1e-5, rtol=0)
    assert sorted(chain.sessions()) == ["a", "b", "c"] and chain.session_length("c") == 5 + 1
    assert chain.memory_bytes() == sum(p.memory_bytes() for p in chain.parts)
    chain.close_session("a")
    assert all("a" not in p.sessions() for p in chain.parts)
    with pytest.raises(RunnerError):
        chain.close_session("a")


def test_a_step_that_fails_past_the_first_part_closes_its_session_in_every_part(tmp_path: Path) -> None:
    store = tiny_store(tmp_path)
    chain = open_range(store.model_dir("tiny"), 0, 4, 2, threads=1)
    chain.open_session("s")
    chain.forward("s", np.array([[5, 6, 7]]))
    chain.parts[1].close()  # the second part can no longer run: the first has run the step already
    with pytest.raises(RunnerError, match="closed"):
        chain.forward("s", np.array([[8]]))
    assert "s" not in chain.parts[0].sessions()  # its cache is not left one position ahead
    with pytest.raises(RunnerError):
        chain.forward("s", np.array([[8]]))


def test_prompts_of_empty_sessions_read_together_give_what_each_gives_alone(tmp_path: Path) -> None:
    """One call for prompts of different lengths (padded to the longest), in one runner and in
    a chain of parts; each session then holds its own prompt and steps on from its end. A
    session that holds positions between their rows keeps them apart (one by one instead)."""
    model_dir = tiny_store(tmp_path).model_dir("tiny")
    whole = open_range(model_dir, 0, 4, 1, threads=1)
    chain = open_range(model_dir, 0, 4, 2, threads=1)
    alone = open_range(model_dir, 0, 4, 1, threads=1)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 90, size=(1, n)) for n in (9, 4, 12)]
    lengths = [p.shape[1] for p in prompts]
    x = np.zeros((3, 12), np.int64)
    for i, prompt in enumerate(prompts):
        x[i, :lengths[i]] = prompt[0]
    sids = ["a", "b", "c"]
    expected, following = [], []
    for sid, prompt in zip(sids, prompts):
        alone.open_session(sid)
        expected.append(alone.forward(sid, prompt, last_only=True))
        following.append(alone.forward(sid, np.array([[7]]), last_only=True))
    for runner in (whole, chain):
        for sid in sids:
            runner.open_session(sid)
        assert runner.reads_prompts_together(sids)
        out = runner.forward_prompts(sids, x, lengths)
        np.testing.assert_allclose(out, np.concatenate(expected), atol=1e-5, rtol=0)
        assert [runner.session_length(sid) for sid in sids] == lengths
        np.testing.assert_allclose(runner.forward_batch(sids, np.full((3, 1), 7)), np.concatenate(following),
                                   atol=1e-5, rtol=0)
    for sid in ("d", "busy", "e"):
        whole.open_session(sid)
    whole.forward("busy", prompts[0])
    assert not whole.reads_prompts_together(["d", "e"]) and not whole.reads_prompts_together(["a", "d"])
    with pytest.raises(RunnerError, match="cannot be read together"):
        whole.forward_prompts(["d", "e"], x[:2, :9], [9, 4])
    assert whole.session_length("d") == whole.session_length("e") == 0
    for sid in ("f", "g"):
        whole.open_session(sid)
    assert whole.reads_prompts_together(["f", "g"])
    with pytest.raises(RunnerError, match="one row and one length"):
        whole.forward_prompts(["f", "g"], x[:2, :9], [9, 10])
    assert whole.session_length("f") == whole.session_length("g") == 0
