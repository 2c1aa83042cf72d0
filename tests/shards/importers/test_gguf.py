"""GGUF import of tiny llama / qwen2 / qwen3 / smollm3 / gemma3 / granite / olmo2 / mixtral / qwen3_moe / phi3 files written like llama.cpp's converter, against transformers."""

from __future__ import annotations

import re

import numpy as np
import pytest

from shards.errors import UnmappedTensorError
from shards.importers.importer import import_model
from shards.runtime.chain import chain_forward, open_chain
from shards.store.model_store import ModelStore
from tests.shards.fragment_helpers import load_dequantised, make_hf_checkpoint, write_gguf_from_hf

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "smollm3", "gemma3", "granite", "olmo2", "mixtral",
                                  "qwen3_moe", "phi3", "gemma2", "olmoe", "qwen2_moe"])
def test_gguf_logits_match_transformers(tmp_path, arch) -> None:
    import torch

    model = make_hf_checkpoint(tmp_path / "hf", arch, seed=7)
    gguf_path = write_gguf_from_hf(model, tmp_path / f"tiny-{arch}.gguf", arch)
    store = ModelStore(tmp_path / "home")
    m = import_model(gguf_path, store=store, progress=False)
    assert m.name == f"tiny-{arch}" and m.architecture == arch
    assert m.tied_embeddings is (arch not in ("llama", "olmo2", "mixtral", "phi3", "olmoe", "qwen2_moe"))
    assert m.attention_bias is (arch in ("qwen2", "qwen2_moe"))
    assert m.shared_expert_intermediate_size == (96 if arch == "qwen2_moe" else 0)
    assert m.qk_norm is (arch in ("qwen3", "gemma3", "olmo2", "qwen3_moe", "olmoe"))
    assert (m.n_experts, m.renormalize_experts) == {"mixtral": (4, True), "qwen3_moe": (6, True),
                                                    "olmoe": (6, False), "qwen2_moe": (4, False)}.get(arch, (0, False))
    assert m.head_dim == (32 if arch in ("qwen3", "gemma3", "gemma2") else 16)
    assert (m.attention_softcap, m.logit_softcap) == ((2.0, 3.0) if arch == "gemma2" else (0.0, 0.0))
    # gemma3: llama.cpp's every 6th layer global; phi3: every layer slides
    assert m.sliding_layers == {"gemma3": (0, 1, 2, 3, 4), "phi3": (0, 1, 2), "gemma2": (0, 2)}.get(arch, ())
    assert (m.rope_freq_factors is not None) is (arch == "llama")
    assert m.layers_without_rope == ((3,) if arch == "smollm3" else ())  # llama.cpp's fixed step of 4
    ids = np.random.default_rng(3).integers(3, 96, size=80).astype(np.int64)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids[None, :])).logits[0].numpy()
    runners = open_chain(store.model_dir(m.name), [(0, 1), (2, m.n_layers - 1)], threads=1)
    ours = np.concatenate([chain_forward(runners, "s", ids[:60]), chain_forward(runners, "s", ids[60:])], axis=1)[0]
    # gemma3: six layers scaled by 1 + w, logits past 10: float32 rounding reaches 1.2e-4
    np.testing.assert_allclose(ours, ref, atol=1e-3 if arch in ("gemma3", "gemma2") else 1e-4, rtol=0)


PHI4_MINI = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "partial_rotary_factor": 0.75}


@pytest.mark.parametrize("shape", [{}, PHI4_MINI], ids=["phi-3.5", "phi-4-mini"])
def test_phi3_long_rope_and_4_bit_fused_matrices_from_gguf(tmp_path, shape) -> None:
    """Phi-3.5's file (and Phi-4-mini's, whose rotary turns 3/4 of each head: its
    ``rope.dimension_count``): short factors and attention factor up to the original context,
    and its fused matrices in Q4_0 split into 4-bit blocks of their own in a mixed store."""
    import torch

    partial = shape.get("partial_rotary_factor", 1.0)
    head_dim = shape.get("hidden_size", 64) // shape.get("num_attention_heads", 4)
    factors = [1.0 + i / 4 for i in range(int(head_dim * partial) // 2)]
    model = make_hf_checkpoint(tmp_path / "hf", "phi3", seed=9, rope={
        **{k: v for k, v in shape.items() if k != "partial_rotary_factor"},
        "original_max_position_embeddings": 64, "sliding_window": None,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": factors,
                            "long_factor": [f * 2 for f in factors], "partial_rotary_factor": partial}})
    path = write_gguf_from_hf(model, tmp_path / "phi.gguf", "phi3", types={"attn_qkv": "Q4_0", "ffn_up": "Q4_0"})
    store = ModelStore(tmp_path / "home")
    m = import_model(path, name="phi", weights="mixed", store=store, progress=False)
    assert m.context_length == 64 and m.rope_freq_factors == pytest.approx(factors) and m.sliding_layers == ()
    assert m.weight_format == "mixed" and m.rotary_width == int(head_dim * partial)
    load_dequantised(model, store.model_dir("phi"), m)
    ids = np.random.default_rng(4).integers(3, 96, size=50).astype(np.int64)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids[None, :])).logits[0].numpy()
    ours = chain_forward(open_chain(store.model_dir("phi"), [(0, 2)], threads=1, activation_bits=16), "s", ids)[0]
    # about 16-bit activations (the importer's function, not int8's error); MatMulNBits' kernels differ by instruction set: on an AVX2-only CPU the logits (up to 6)
    # were off by up to 6e-4 (phi-3.5) and 1.2e-3 (phi-4-mini), within 1e-3 on AVX-512
    np.testing.assert_allclose(ours, ref, atol=3e-3, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_q4_fragments_compute_the_dequantised_model(tmp_path, monkeypatch, arch) -> None:
    """The q4 graph (MatMulNBits + offsets, 8-bit lm_head) equals fp32 math on the dequantised weights."""
    import torch

    model = make_hf_checkpoint(tmp_path / "hf", arch, seed=8)
    store = ModelStore(tmp_path / "home")
    m = import_model(write_gguf_from_hf(model, tmp_path / "q.gguf", arch), name="q", weights="q4",
                     store=store, progress=False)
    d = store.model_dir("q")
    load_dequantised(model, d, m)
    ids = np.arange(3, 50, dtype=np.int64)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids[None, :])).logits[0].numpy()
    fast = chain_forward(open_chain(d, [(0, 2)], threads=1, activation_bits=16), "s", ids)[0]
    # int8 activations taken twice (x, then what rounding left of it; the default takes x once):
    # the dequantised weights' function to about 16-bit activations
    np.testing.assert_allclose(fast, ref, atol=1e-3, rtol=0)
    monkeypatch.setattr("shards.graph.fragment.Q4_ACCURACY_LEVEL", 0)  # float activations everywhere: exact
    monkeypatch.setattr("shards.graph.fragment.Q8_ACCURACY_LEVEL", 0)
    exact = chain_forward(open_chain(d, [(0, 2)], threads=1), "s", ids)[0]
    np.testing.assert_allclose(exact, ref, atol=1e-4, rtol=0)


def test_a_mixed_store_keeps_each_tensor_in_the_blocks_of_its_precision(tmp_path) -> None:
    """Q4_0 tensors in 4-bit blocks (their grid, exactly), Q8_0 ones in 8-bit blocks (exactly) and
    Q5_0 and float ones in 8-bit blocks; the fragments compute the stored weights' function, and
    the file's to within the 8-bit rounding of its Q5_0 and float tensors."""
    import torch

    from shards.importers.quant import dequantize
    from shards.importers.stored_form import load_stored
    from shards.store.verify import verify_weight_files

    model = make_hf_checkpoint(tmp_path / "hf", "qwen2", seed=13)
    types = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q8_0", "ffn_gate": "Q4_0",
             "ffn_up": "Q5_0"}  # ffn_down: float32
    path = write_gguf_from_hf(model, tmp_path / "m.gguf", "qwen2", types=types)
    store = ModelStore(tmp_path / "home")
    m = import_model(path, name="mixed", weights="mixed", store=store, progress=False)
    layer = load_stored(store.model_dir("mixed"), m, "layer.0")
    entry = m.files["layer.0"]  # the file's blocks on disk, ncm's (bigger) once loaded, for the planner
    assert entry.bytes < sum(v.nbytes for v in layer.values()) <= entry.memory_bytes
    verify_weight_files(store.model_dir("mixed"), m, list(m.files))  # the hashes taken from memory
    bits = {name: layer[f"{name}.qweight"].shape[-1] // 4 for name in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                        "gate_proj", "up_proj", "down_proj")}
    assert bits == {"q_proj": 4, "k_proj": 4, "v_proj": 8, "o_proj": 8, "gate_proj": 4, "up_proj": 8, "down_proj": 8}
    from shards.importers.gguf import GgufSource

    source = GgufSource(path)
    file_layer = source.layer(0)
    for name in ("q_proj", "v_proj", "o_proj", "gate_proj"):  # Q4_0 and Q8_0 blocks: the file's values exactly
        stored = dequantize({k.split(".", 1)[1]: v for k, v in layer.items() if k.startswith(name + ".")})
        np.testing.assert_array_equal(stored, file_layer[name])
    load_dequantised(model, store.model_dir("mixed"), m)
    ids = np.arange(3, 60, dtype=np.int64)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids[None, :])).logits[0].numpy()
    ours = chain_forward(open_chain(store.model_dir("mixed"), [(0, 1), (2, 2)], threads=1, activation_bits=16),
                         "s", ids)[0]
    np.testing.assert_allclose(ours, ref, atol=1e-3, rtol=0)  # 8-bit products on int8 activations, twice


def test_gguf_biased_llama_matches_transformers(tmp_path) -> None:
    """A llama with attention_bias and mlp_bias: attn_output.bias and ffn_*.bias are applied."""
    import torch

    model = make_hf_checkpoint(tmp_path / "hf", "llama", seed=9, attention_bias=True, mlp_bias=True)
    store = ModelStore(tmp_path / "home")
    m = import_model(write_gguf_from_hf(model, tmp_path / "b.gguf", "llama"), store=store, progress=False)
    assert m.attention_bias and m.attention_output_bias and m.mlp_bias
    ids = np.random.default_rng(4).integers(3, 96, size=70).astype(np.int64)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids[None, :])).logits[0].numpy()
    runners = open_chain(store.model_dir(m.name), [(0, 0), (1, 2)], threads=1)
    ours = np.concatenate([chain_forward(runners, "s", ids[:60]), chain_forward(runners, "s", ids[60:])], axis=1)[0]
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("extra", ["blk.1.attn_q_norm.weight", "blk.1.attn_output.bias", "blk.3.ffn_up.weight",
                                   "output.bias"])
def test_gguf_unmapped_tensor_is_refused(tmp_path, extra) -> None:
    """A tensor the importer would not read (unknown, a bias in one layer only, a layer past
    block_count...) fails the import with its name, and nothing is stored."""
    model = make_hf_checkpoint(tmp_path / "hf", "llama", seed=10)
    shape = (64, 160) if extra.endswith("ffn_up.weight") else (64,)
    path = write_gguf_from_hf(model, tmp_path / "x.gguf", "llama", extra={extra: np.ones(shape, np.float32)})
    store = ModelStore(tmp_path / "home")
    with pytest.raises(UnmappedTensorError, match=re.escape(extra)) as caught:
        import_model(path, store=store, progress=False)
    assert caught.value.names == (extra,)
    assert not store.models_dir.exists() or list(store.models_dir.iterdir()) == []


@pytest.mark.parametrize("arch", ["llama", "phi3", "mixtral"])
def test_block_stores_carry_the_files_blocks_over(tmp_path, arch) -> None:
    """A quantised file's blocks carried over as they are (rows permuted back for llama's
    rotary, phi3's fused matrices split, experts sliced) hold what a round trip through float32
    stores, in q4 and mixed stores (these keep them as the file's, carried when loaded); the
    import's default format follows the file."""
    from shards.importers.gguf import GgufSource
    from shards.importers.gguf_blocks import QuantBlocks
    from shards.importers.importer import auto_weights, convert_tensors
    from shards.importers.quant import dequantize
    from shards.importers.stored_form import loaded_tensors

    model = make_hf_checkpoint(tmp_path / "hf", arch, seed=5)
    types = {"attn_q": "Q4_1", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q5_0", "attn_qkv": "Q4_1",
             "ffn_gate": "Q4_0", "ffn_up": "Q4_1", "ffn_down": "Q8_0", "ffn_gate_exps": "Q4_1",
             "ffn_up_exps": "Q5_0", "ffn_down_exps": "Q4_0"}
    path = write_gguf_from_hf(model, tmp_path / "m.gguf", arch, types=types)
    source = GgufSource(path)
    assert auto_weights(source) == "mixed"
    for weights in ("q4", "mixed"):
        for i in range(source.params["n_layers"]):
            narrow = source.narrow_tensors(i)
            blocks = source.layer(i, blocks=True)
            assert all(isinstance(v, QuantBlocks) for k, v in blocks.items() if k.endswith("_proj"))
            carried = loaded_tensors(convert_tensors(blocks, weights, narrow=narrow), weights)  # (mixed: at load)
            floats = convert_tensors(source.layer(i), weights, narrow=narrow)
            assert carried.keys() == floats.keys()
            for name in (k.removesuffix(".qweight") for k in carried if k.endswith(".qweight")):
                ours, theirs = ({k[len(name) + 1:]: v for k, v in t.items() if k.startswith(name + ".")}
                                for t in (carried, floats))
                want = dequantize(theirs)
                np.testing.assert_allclose(dequantize(ours), want, rtol=0, atol=1e-6 * np.abs(want).max())
    m = import_model(path, weights="auto", store=ModelStore(tmp_path / "home"), progress=False)
    assert m.weight_format == "mixed"
    float_file = write_gguf_from_hf(model, tmp_path / "f.gguf", arch)
    assert auto_weights(GgufSource(float_file)) == "f32"
