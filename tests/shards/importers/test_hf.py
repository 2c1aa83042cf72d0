"""Hugging Face folder import (tiny random llama / mistral / qwen2 / qwen3 / smollm3 / gemma3 / granite / olmo2 / phi3) against transformers on the same weights."""

from __future__ import annotations

import numpy as np
import pytest

from shards.importers.importer import import_model
from shards.runtime.chain import chain_forward, open_chain
from shards.store.model_store import ModelStore
from shards.store.tensorfile import read_tensors
from tests.shards.fragment_helpers import greedy, load_dequantised, make_hf_checkpoint

pytestmark = pytest.mark.slow


ARCHS = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "gemma3", "granite", "olmo2", "mixtral", "qwen3_moe", "phi3", "gemma2",
         "olmoe", "qwen2_moe")
N_LAYERS = {"smollm3": 5, "gemma3": 6, "gemma2": 4}  # the others: 3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    store = ModelStore(tmp_path_factory.mktemp("home"))
    out = {}
    for arch in ARCHS:
        model = make_hf_checkpoint(root / arch, arch)
        manifest = import_model(root / arch, name=f"tiny-{arch}", store=store, progress=False)
        out[arch] = (model, manifest, store.model_dir(manifest.name))
    return out


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(ids[None, :])).logits[0].numpy()


@pytest.mark.parametrize("arch", ARCHS)
def test_manifest_reflects_config(checkpoints, arch) -> None:
    _, m, _ = checkpoints[arch]
    head_dim = 32 if arch in ("qwen3", "gemma3", "gemma2") else 16
    n_layers = N_LAYERS.get(arch, 3)
    assert (m.architecture, m.n_layers, m.hidden_size, m.n_heads, m.n_kv_heads, m.head_dim) == (arch, n_layers, 64, 4,
                                                                                                 2, head_dim)
    assert m.tied_embeddings is (arch not in ("llama", "mistral", "olmo2", "mixtral", "phi3", "olmoe", "qwen2_moe"))
    assert m.layers_without_rope == ((3,) if arch == "smollm3" else ())
    assert m.attention_bias is (arch in ("qwen2", "qwen2_moe"))
    assert m.shared_expert_intermediate_size == (96 if arch == "qwen2_moe" else 0)
    assert not m.attention_output_bias and not m.mlp_bias
    assert m.qk_norm is (arch in ("qwen3", "gemma3", "olmo2", "qwen3_moe", "olmoe"))
    assert m.qk_norm_whole is (arch in ("olmo2", "olmoe"))
    assert (m.n_experts, m.experts_per_token, m.renormalize_experts) == {
        "mixtral": (4, 2, True), "qwen3_moe": (6, 2, True), "olmoe": (6, 2, False),
        "qwen2_moe": (4, 2, False)}.get(arch, (0, 0, False))
    assert (m.sliding_layers, m.sliding_window) == {"gemma3": ((0, 1, 2, 3, 4), 16), "phi3": ((0, 1, 2), 16),
                                                    "gemma2": ((0, 2), 16)}.get(arch, ((), 0))
    assert (m.attention_softcap, m.logit_softcap) == ((2.0, 3.0) if arch == "gemma2" else (0.0, 0.0))
    # bias-free, norm-free manifests as before
    assert not {"attention_output_bias", "mlp_bias"} & set(m.to_dict()) and ("qk_norm" in m.to_dict()) is m.qk_norm
    assert ("layers_without_rope" in m.to_dict()) is (arch == "smollm3")
    if arch == "granite":
        assert (m.embedding_scale, m.residual_scale, m.attention_scale, m.logit_scale) == (3.0, 0.4, 0.05, 0.4)
    assert (m.rope_freq_factors is not None) is (arch == "llama")


def test_a_mistral_window_shorter_than_the_context_slides_on_every_layer(tmp_path) -> None:
    """Mistral 7B v0.1's window (4096 of 32k positions), here 16: each layer attends to the
    last 16 positions, as transformers' Mistral does; Qwen's layer-by-layer windows are refused."""
    import json

    from transformers import MistralForCausalLM

    from shards.errors import UnsupportedArchitectureError

    make_hf_checkpoint(tmp_path / "src", "mistral", seed=2)
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps(config | {"sliding_window": 16}))
    store = ModelStore(tmp_path / "home")
    m = import_model(tmp_path / "src", name="windowed", store=store, progress=False)
    assert (m.sliding_window, m.sliding_layers) == (16, (0, 1, 2))
    model = MistralForCausalLM.from_pretrained(tmp_path / "src").eval()
    ids = np.random.default_rng(8).integers(3, 96, size=50).astype(np.int64)
    runners = open_chain(store.model_dir("windowed"), [(0, 2)], threads=1)
    ours = np.concatenate([chain_forward(runners, "s", ids[:30]), chain_forward(runners, "s", ids[30:])], axis=1)[0]
    np.testing.assert_allclose(ours, torch_logits(model, ids), atol=1e-4, rtol=0)
    (tmp_path / "src" / "config.json").write_text(json.dumps(config | {"use_sliding_window": True}))
    with pytest.raises(UnsupportedArchitectureError, match=r"^src: sliding-window attention is not supported$"):
        import_model(tmp_path / "src", name="qwen-like", store=store, progress=False)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cut", ["whole", "per layer"])
def test_logits_match_transformers(checkpoints, arch, cut) -> None:
    model, m, model_dir = checkpoints[arch]
    ids = np.random.default_rng(1).integers(3, 96, size=90).astype(np.int64)  # spans the llama3 rope regimes
    last = m.n_layers - 1
    runners = open_chain(model_dir, [(0, last)] if cut == "whole" else [(i, i) for i in range(last + 1)], threads=1)
    ref = torch_logits(model, ids)
    # prefill in two chunks then decode one by one, as a real session does
    parts = [chain_forward(runners, "s", ids[:50]), chain_forward(runners, "s", ids[50:80])]
    parts += [chain_forward(runners, "s", ids[i:i + 1]) for i in range(80, 90)]
    ours = np.concatenate(parts, axis=1)[0]
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_phi3_long_rope_up_to_the_original_context(tmp_path) -> None:
    """Phi-3.5's long rope: the short factors and the attention factor, as transformers applies
    them up to the original context (which caps the stored one)."""
    factors = [1.0, 1.1, 1.3, 1.6, 2.0, 2.6, 3.3, 4.0]
    model = make_hf_checkpoint(tmp_path / "src", "phi3", seed=4, rope={
        "original_max_position_embeddings": 64, "sliding_window": None,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": factors,
                            "long_factor": [f * 3 for f in factors]}})
    store = ModelStore(tmp_path / "home")
    m = import_model(tmp_path / "src", name="phi", store=store, progress=False)
    assert m.context_length == 64 and m.rope_freq_factors == tuple(factors) and m.sliding_window == 0
    assert m.rotary_scale == pytest.approx(np.sqrt(1 + np.log(4) / np.log(64)))  # context 256 / original 64
    ids = np.random.default_rng(5).integers(3, 96, size=60).astype(np.int64)
    runners = open_chain(store.model_dir("phi"), [(0, 1), (2, 2)], threads=1)
    ours = np.concatenate([chain_forward(runners, "s", ids[:40]), chain_forward(runners, "s", ids[40:])], axis=1)[0]
    np.testing.assert_allclose(ours, torch_logits(model, ids), atol=1e-4, rtol=0)


PHI4_MINI_SHAPE = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}  # heads 64 wide


@pytest.mark.parametrize("flavour", ["cpu", "portable", "static"])
def test_phi4_mini_partial_rotary_with_its_long_rope(tmp_path, flavour) -> None:
    """Phi-4-mini's rotary turns 3/4 of each head (48 of 64 dims here, 96 of 128 in the model),
    the rest passing as it is, with a long rope's short factors over the turned dims: every
    flavour matches transformers across a split; a rotary ncm cannot turn is refused in one line."""
    import json

    from shards.errors import UnsupportedArchitectureError

    factors = [1.0 + i / 8 for i in range(24)]  # one per frequency of the 48 turned dims
    model = make_hf_checkpoint(tmp_path / "src", "phi3", seed=6, rope={
        **PHI4_MINI_SHAPE, "original_max_position_embeddings": 64, "sliding_window": None, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                            "short_factor": factors, "long_factor": [f * 3 for f in factors]}})
    store = ModelStore(tmp_path / "home")
    m = import_model(tmp_path / "src", name="phi4", store=store, progress=False)
    assert (m.head_dim, m.rotary_dim, m.rope_freq_factors) == (64, 48, tuple(factors))
    ids = np.random.default_rng(7).integers(3, 96, size=37).astype(np.int64)
    kw = {"flavour": "static", "max_context": 64, "prefill_chunk": 8} if flavour == "static" else {"flavour": flavour}
    runners = open_chain(store.model_dir("phi4"), [(0, 1), (2, 2)], threads=1, **kw)
    if flavour == "static":
        rows, _ = greedy(runners, "s", ids, 0)
        np.testing.assert_allclose(rows[0], torch_logits(model, ids)[-1], atol=1e-4, rtol=0)
    else:
        np.testing.assert_allclose(chain_forward(runners, "s", ids)[0], torch_logits(model, ids), atol=1e-4, rtol=0)
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config["rope_parameters"]["partial_rotary_factor"] = 0.5  # 32 of 64 dims: a multiple of 16, so fine...
    config["rope_parameters"]["short_factor"] = config["rope_parameters"]["long_factor"] = [1.0] * 16
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    assert import_model(tmp_path / "src", name="phi4-half", store=store, progress=False).rotary_dim == 32
    config["rope_parameters"]["partial_rotary_factor"] = 0.375  # ...24 is not
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match=r"^src: a rotary over 24 of 64 dims is not supported"):
        import_model(tmp_path / "src", name="phi4-odd", store=store, progress=False)


def test_bfloat16_checkpoint(tmp_path) -> None:
    import torch

    model = make_hf_checkpoint(tmp_path / "src", "qwen2", seed=3)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "src")  # weights on disk as BF16
    m = import_model(tmp_path / "src", name="bf16", store=ModelStore(tmp_path / "home"), progress=False)
    runners = open_chain(ModelStore(tmp_path / "home").model_dir(m.name), [(0, 2)], threads=1)
    ids = np.arange(3, 40, dtype=np.int64)
    ours = chain_forward(runners, "s", ids)[0]
    from transformers import Qwen2ForCausalLM

    ref = Qwen2ForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32).eval()  # bf16 values, fp32 math
    np.testing.assert_allclose(ours, torch_logits(ref, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_static_flavour_matches_transformers(checkpoints, arch) -> None:
    model, m, model_dir = checkpoints[arch]
    ids = np.random.default_rng(2).integers(3, 96, size=37).astype(np.int64)
    runners = open_chain(model_dir, [(0, 1), (2, m.n_layers - 1)], flavour="static", max_context=64, prefill_chunk=8, threads=1)
    rows, _ = greedy(runners, "s", ids, 0)
    np.testing.assert_allclose(rows[0], torch_logits(model, ids)[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "smollm3", "gemma3", "olmo2", "mixtral", "phi3", "gemma2", "olmoe"])
@pytest.mark.parametrize("flavour", ["portable", "gpu"])
def test_head_norms_and_unrotated_layers_in_the_other_flavours(checkpoints, arch, flavour) -> None:
    """Qwen3's per-head query/key norms, SmolLM3's layers without rope and Gemma 3's sliding
    windows in the plain-ops graph, and in float16 (the norms in float32)."""
    model, m, model_dir = checkpoints[arch]
    ids = np.random.default_rng(6).integers(3, 96, size=41).astype(np.int64)
    runners = open_chain(model_dir, [(0, 1), (2, m.n_layers - 1)], flavour=flavour, threads=1)
    ours = np.concatenate([chain_forward(runners, "s", ids[:30]), chain_forward(runners, "s", ids[30:])], axis=1)[0]
    ref = torch_logits(model, ids)
    # float16: within 2 % of the logits' range
    np.testing.assert_allclose(ours, ref, atol=1e-4 if flavour == "portable" else 2e-2 * np.abs(ref).max(), rtol=0)


def test_experts_are_picked_per_token_and_run_from_4_bit_blocks(checkpoints, tmp_path) -> None:
    """Mixtral's routing differs from token to token in this prompt (the float store follows
    transformers there, above), and the q4 store computes its dequantised weights' function: each
    expert's products on the rows that picked it only."""
    model, _, _ = checkpoints["mixtral"]
    ids = np.random.default_rng(1).integers(3, 96, size=40).astype(np.int64)
    picks = []
    hook = model.model.layers[0].mlp.gate.register_forward_hook(lambda _m, _i, out: picks.append(out))
    torch_logits(model, ids)
    hook.remove()
    _, _, chosen = picks[0]  # the router's logits, its top-k weights and the top-k expert ids
    assert len({tuple(sorted(row.tolist())) for row in chosen.reshape(-1, 2)}) > 2
    source = make_hf_checkpoint(tmp_path / "src", "mixtral", seed=4)
    store = ModelStore(tmp_path / "home")
    m = import_model(tmp_path / "src", name="moe-q4", weights="q4", store=store, progress=False)
    load_dequantised(source, store.model_dir(m.name), m)
    runners = open_chain(store.model_dir(m.name), [(0, 1), (2, 2)], threads=1, activation_bits=16)
    ours = np.concatenate([chain_forward(runners, "s", ids[:30])] +
                          [chain_forward(runners, "s", ids[i:i + 1]) for i in range(30, 40)], axis=1)[0]
    np.testing.assert_allclose(ours, torch_logits(source, ids), atol=1e-3, rtol=0)  # the lm_head's int8 x2


def test_experts_weighted_by_their_probabilities_as_they_are(tmp_path) -> None:
    """norm_topk_prob off (OLMoE's and some Qwen MoE models' way): the picked experts' outputs are
    weighted by their softmax probabilities without renormalising them."""
    import json

    from transformers import Qwen3MoeForCausalLM

    make_hf_checkpoint(tmp_path / "src", "qwen3_moe", seed=6)
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps(config | {"norm_topk_prob": False}))
    store = ModelStore(tmp_path / "home")
    m = import_model(tmp_path / "src", name="raw-weights", store=store, progress=False)
    assert not m.renormalize_experts
    ids = np.random.default_rng(5).integers(3, 96, size=33).astype(np.int64)
    ours = chain_forward(open_chain(store.model_dir(m.name), [(0, 2)], threads=1), "s", ids)[0]
    reference = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "src").eval()
    np.testing.assert_allclose(ours, torch_logits(reference, ids), atol=1e-4, rtol=0)


def test_sharded_checkpoint_with_index(tmp_path) -> None:
    model = make_hf_checkpoint(tmp_path / "src", "llama", seed=5)
    model.save_pretrained(tmp_path / "src", max_shard_size="100KB")
    assert (tmp_path / "src" / "model.safetensors.index.json").is_file()
    (tmp_path / "src" / "model.safetensors").unlink(missing_ok=True)  # the unsharded copy
    (tmp_path / "src" / "stray.safetensors").write_bytes(b"not part of the model")
    store = ModelStore(tmp_path / "home")
    m = import_model(tmp_path / "src", name="sharded", store=store, progress=False)
    ids = np.arange(3, 30, dtype=np.int64)
    ours = chain_forward(open_chain(store.model_dir(m.name), [(0, 2)], threads=1), "s", ids)[0]
    np.testing.assert_allclose(ours, torch_logits(model, ids), atol=1e-4, rtol=0)


BIASES = {"attention": dict(attention_bias=True), "mlp": dict(mlp_bias=True),
          "attention+mlp": dict(attention_bias=True, mlp_bias=True)}


@pytest.mark.parametrize("biases", list(BIASES))
def test_biased_llama_logits_match_transformers(tmp_path, biases) -> None:
    """Llama ``attention_bias`` (q/k/v and o_proj biases) and ``mlp_bias`` (gate/up/down): every
    bias is stored and applied, in the dynamic and the static flavours."""
    kw = BIASES[biases]
    model = make_hf_checkpoint(tmp_path / "src", "llama", seed=11, **kw)
    store = ModelStore(tmp_path / "home")
    m = import_model(tmp_path / "src", name="biased", store=store, progress=False)
    assert (m.attention_bias, m.attention_output_bias) == (kw.get("attention_bias", False),) * 2
    assert m.mlp_bias is kw.get("mlp_bias", False)
    assert store.manifest(m.name) == m  # the flags survive the manifest's JSON
    d = store.model_dir(m.name)
    ids = np.random.default_rng(5).integers(3, 96, size=60).astype(np.int64)
    ref = torch_logits(model, ids)
    runners = open_chain(d, [(0, 1), (2, 2)], threads=1)
    ours = np.concatenate([chain_forward(runners, "s", ids[:50])] +
                          [chain_forward(runners, "s", ids[i:i + 1]) for i in range(50, 60)], axis=1)[0]
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    static = open_chain(d, [(0, 0), (1, 2)], flavour="static", max_context=64, prefill_chunk=8, threads=1)
    rows, _ = greedy(static, "s", ids[:37], 0)
    np.testing.assert_allclose(rows[0], ref[36], atol=1e-4, rtol=0)


def test_biased_llama_q4_computes_the_dequantised_model(tmp_path, monkeypatch) -> None:
    """q4 with biases: the linear weights are quantised, the biases stay float and are applied."""
    model = make_hf_checkpoint(tmp_path / "src", "llama", seed=12, attention_bias=True, mlp_bias=True)
    store = ModelStore(tmp_path / "home")
    m = import_model(tmp_path / "src", name="biased-q4", weights="q4", store=store, progress=False)
    d = store.model_dir(m.name)
    layer = read_tensors(d / m.files["layer.0"].path)
    assert {layer[b].dtype for b in ("q_bias", "o_bias", "gate_bias", "up_bias", "down_bias")} == {np.dtype(np.float32)}
    load_dequantised(model, d, m)
    monkeypatch.setattr("shards.graph.fragment.Q4_ACCURACY_LEVEL", 0)  # float activations everywhere: exact
    monkeypatch.setattr("shards.graph.fragment.Q8_ACCURACY_LEVEL", 0)
    ids = np.arange(3, 50, dtype=np.int64)
    ours = chain_forward(open_chain(d, [(0, 2)], threads=1), "s", ids)[0]
    np.testing.assert_allclose(ours, torch_logits(model, ids), atol=1e-4, rtol=0)
