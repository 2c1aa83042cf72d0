"""GGUF / HF import: the real default model's manifest and files, and every failure path."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from shards.errors import ModelFormatError, TokenizerError, UnmappedTensorError, UnsupportedArchitectureError
from shards.importers.gguf import unpermute_rope_rows
from shards.importers.importer import convert_tensors, default_name, import_model
from shards.importers.quant import dequantize
from shards.runtime.chain import chain_forward, open_chain
from shards.store.model_store import ModelStore
from shards.store.tensorfile import read_tensors
from tests.shards.fragment_helpers import PROMPT_IDS, SMOLLM2, add_tensors, chain, write_tiny_checkpoint


def write_gguf(path: Path, arch: str) -> Path:
    """A small GGUF with model metadata and an embedding but no tokenizer."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("token_embd.weight", np.zeros((10, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_store_empty(store: ModelStore) -> None:
    assert not store.models_dir.exists() or list(store.models_dir.iterdir()) == []


# --- the real model -------------------------------------------------------------------------
def test_gguf_manifest_matches_the_model(smollm2_store) -> None:
    m = smollm2_store.manifest(SMOLLM2)
    assert (m.architecture, m.n_layers, m.hidden_size, m.intermediate_size) == ("llama", 30, 576, 1536)
    assert (m.n_heads, m.n_kv_heads, m.head_dim, m.vocab_size) == (9, 3, 64, 49152)
    assert m.rope_theta == 100000.0 and m.rms_norm_eps == pytest.approx(1e-5)
    assert m.tied_embeddings and not m.attention_bias and m.weight_format == "f32"
    assert m.context_length == 8192 and m.source.endswith(".gguf")


def test_weight_files_match_their_checksums(smollm2_store) -> None:
    m = smollm2_store.manifest(SMOLLM2)
    d = smollm2_store.model_dir(SMOLLM2)
    for key in ("embed", "layer.0", "layer.29", "head"):
        f = m.files[key]
        data = (d / f.path).read_bytes()
        assert len(data) == f.bytes and hashlib.sha256(data).hexdigest() == f.sha256
    layer = read_tensors(d / m.files["layer.3"].path)
    assert layer["q_proj"].shape == (576, 576) and layer["k_proj"].shape == (192, 576)
    assert layer["q_proj"].dtype == np.float32
    assert (d / "tokenizer.json").is_file()


def test_f16_import_halves_the_linear_weights(smollm2_gguf, smollm2_store, tmp_path) -> None:
    store = ModelStore(tmp_path)
    m = import_model(smollm2_gguf, name="smol-f16", weights="f16", store=store, progress=False)
    layer = read_tensors(store.model_dir("smol-f16") / m.files["layer.0"].path)
    assert layer["q_proj"].dtype == np.float16 and layer["input_norm"].dtype == np.float32
    assert m.weight_format == "f16"
    # fragments cast f16 weights to f32 when built: same predictions as the f32 import
    f16 = chain_forward(open_chain(store.model_dir("smol-f16"), [(0, 29)], threads=2), "s", PROMPT_IDS)[0]
    ref = chain(smollm2_store.model_dir(SMOLLM2), [(0, 29)], threads=2)
    f32 = chain_forward(ref, "f16cmp", PROMPT_IDS)[0]
    ref[0].close_session("f16cmp")
    assert (f16.argmax(-1) == f32.argmax(-1)).all()
    assert np.abs(f16 - f32).max() < 0.5


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4 * 8, 5)).astype(np.float32)  # 4 heads of dim 8
    # llama.cpp's converter: per head, rows (2, half) -> (half, 2)
    permuted = w.reshape(4, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, 4), w)


def test_default_name() -> None:
    assert default_name(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "smollm2-135m-instruct.q4_1"
    assert default_name(Path("my model!")) == "my-model"


# --- failures leave nothing behind ---------------------------------------------------------
@pytest.mark.parametrize("keep", [10, 5000, 0.5, -1000])
def test_truncated_gguf_is_a_format_error(smollm2_gguf, tmp_path, keep) -> None:
    size = smollm2_gguf.stat().st_size
    n = int(size * keep) if isinstance(keep, float) else (keep if keep > 0 else size + keep)
    bad = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as src:
        bad.write_bytes(src.read(n))
    store = ModelStore(tmp_path / "home")
    with pytest.raises(ModelFormatError):
        import_model(bad, store=store, progress=False)
    assert_store_empty(store)


def test_not_a_model_file(tmp_path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"hello world" * 10)
    with pytest.raises(ModelFormatError, match="GGUF"):
        import_model(bad, store=ModelStore(tmp_path / "home"), progress=False)
    with pytest.raises(ModelFormatError, match="no such"):
        import_model(tmp_path / "missing.gguf", store=ModelStore(tmp_path / "home"), progress=False)


def test_unsupported_gguf_architecture(tmp_path) -> None:
    store = ModelStore(tmp_path / "home")
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        import_model(write_gguf(tmp_path / "g.gguf", "gpt2"), store=store, progress=False)
    assert_store_empty(store)


def test_gguf_without_tokenizer(tmp_path) -> None:
    store = ModelStore(tmp_path / "home")
    with pytest.raises(TokenizerError):
        import_model(write_gguf(tmp_path / "l.gguf", "llama"), store=store, progress=False)
    assert_store_empty(store)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A tied llama checkpoint of 3 layers (numpy-made: no torch to import)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", layers=3)


def test_unsupported_hf_architecture(tiny_llama, tmp_path) -> None:
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"model_type": "gpt2"}))
    store = ModelStore(tmp_path / "home")
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        import_model(folder, store=store, progress=False)
    assert_store_empty(store)


def test_hf_without_tokenizer(tiny_llama, tmp_path) -> None:
    folder = tmp_path / "notok"
    shutil.copytree(tiny_llama, folder)
    (folder / "tokenizer.json").unlink()
    store = ModelStore(tmp_path / "home")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        import_model(folder, store=store, progress=False)
    assert_store_empty(store)


def test_hf_truncated_weights(tiny_llama, tmp_path) -> None:
    folder = tmp_path / "cut"
    shutil.copytree(tiny_llama, folder)
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-100])
    store = ModelStore(tmp_path / "home")
    with pytest.raises(ModelFormatError, match="truncated"):
        import_model(folder, store=store, progress=False)
    assert_store_empty(store)


def test_failure_midway_keeps_previous_model(tiny_llama, tmp_path) -> None:
    store = ModelStore(tmp_path / "home")
    first = import_model(tiny_llama, name="m", store=store, progress=False)
    folder = tmp_path / "broken"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 5}))  # layers 3, 4 missing
    with pytest.raises(ModelFormatError, match="layers.3"):
        import_model(folder, name="m", store=store, progress=False)
    assert store.manifest("m") == first
    assert [p.name for p in store.models_dir.iterdir()] == ["m"]


def test_unknown_weight_format(tiny_llama, tmp_path) -> None:
    with pytest.raises(ModelFormatError, match="q8"):
        import_model(tiny_llama, weights="q8", store=ModelStore(tmp_path), progress=False)


# --- every tensor is used or the import is refused ------------------------------------------
@pytest.mark.parametrize("extra", [
    "model.layers.1.self_attn.q_norm.weight",  # unknown to the importer
    "model.layers.0.self_attn.o_proj.bias",  # a bias the config (attention_bias: false) does not declare
    "model.layers.3.mlp.up_proj.weight",  # a layer past num_hidden_layers
    "lm_head.bias",
])
def test_hf_unmapped_tensor_is_refused(tiny_llama, tmp_path, extra) -> None:
    folder = tmp_path / "extra"
    shutil.copytree(tiny_llama, folder)
    add_tensors(folder, {extra: np.ones(64, np.float32)})
    store = ModelStore(tmp_path / "home")
    with pytest.raises(UnmappedTensorError, match=re.escape(extra)) as caught:
        import_model(folder, store=store, progress=False)
    assert caught.value.names == (extra,)
    assert_store_empty(store)


def test_many_unmapped_tensors_are_named_then_counted(tiny_llama, tmp_path) -> None:
    folder = tmp_path / "extras"
    shutil.copytree(tiny_llama, folder)
    extras = [f"model.layers.{i}.self_attn.{p}_norm.weight" for i in range(3) for p in ("q", "k", "k2")]
    add_tensors(folder, {name: np.ones(16, np.float32) for name in extras})
    with pytest.raises(UnmappedTensorError, match=r"9 tensors .* and 4 more") as caught:
        import_model(folder, store=ModelStore(tmp_path / "home"), progress=False)
    assert sorted(caught.value.names) == sorted(extras)


def test_documented_harmless_extras_are_ignored(tiny_llama, tmp_path) -> None:
    """Rotary inverse-frequency buffers (old checkpoints saved them) carry nothing the rope
    settings do not: they are on the importer's explicit ignore list."""
    folder = tmp_path / "inv_freq"
    shutil.copytree(tiny_llama, folder)
    add_tensors(folder, {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32) for i in range(3)})
    store = ModelStore(tmp_path / "home")
    plain = import_model(tiny_llama, name="plain", store=store, progress=False)
    m = import_model(folder, name="with-inv-freq", store=store, progress=False)
    assert m.files == plain.files


def test_tied_lm_head_copy_is_accepted_a_different_one_refused(tiny_llama, tmp_path) -> None:
    """A tied checkpoint may also store lm_head.weight: fine when it is the embedding, refused
    (named) when it differs, since the tied model would not use it."""
    emb = read_tensors(tiny_llama / "model.safetensors", ["model.embed_tokens.weight"])["model.embed_tokens.weight"]
    store = ModelStore(tmp_path / "home")
    same = tmp_path / "same"
    shutil.copytree(tiny_llama, same)
    add_tensors(same, {"lm_head.weight": emb.copy()})
    assert import_model(same, name="same", store=store, progress=False).tied_embeddings
    other = tmp_path / "other"
    shutil.copytree(tiny_llama, other)
    add_tensors(other, {"lm_head.weight": emb * 2})
    with pytest.raises(UnmappedTensorError, match="lm_head.weight"):
        import_model(other, name="other", store=store, progress=False)
    assert [p.name for p in store.models_dir.iterdir()] == ["same"]


def test_an_embedding_table_keeps_the_files_blocks_where_8_bits_hold_them() -> None:
    """In a block store, a Q4_0 or Q8_0 table is stored as its own blocks (exactly, 8 bits); a
    Q4_1 one (whose mins 8-bit blocks cannot hold) as float16, or requantised to 8 bits when the
    output layer shares it."""
    from tests.shards.importers.test_gguf_blocks import random_blocks

    for type_name in ("Q4_0", "Q8_0"):
        table = random_blocks(type_name, 96, 64)
        stored = convert_tensors({"embed": table}, "mixed")
        parts = {k.removeprefix("embed."): v for k, v in stored.items()}
        assert set(parts) == {"qweight", "scales", "zeros"}
        np.testing.assert_allclose(dequantize(parts), table.to_float(), rtol=0, atol=1e-7)
    table = random_blocks("Q4_1", 96, 64)
    stored = convert_tensors({"embed": table}, "q4")
    assert stored["embed"].dtype == np.float16
    np.testing.assert_array_equal(stored["embed"], table.to_float().astype(np.float16))
    assert set(convert_tensors({"embed": table}, "q4", shared_table=True)) == {"embed.qweight", "embed.scales",
                                                                               "embed.zeros"}
