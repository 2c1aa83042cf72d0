"""GGUF import of tiny llama / qwen2 files written like llama.cpp's converter, against transformers."""

from __future__ import annotations

import numpy as np
import pytest

from fragment_helpers import make_hf_checkpoint, write_gguf_from_hf
from shards.importer import import_model
from shards.runner import chain_forward, open_chain
from shards.store import ModelStore

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_logits_match_transformers(tmp_path, arch) -> None:
    import torch

    model = make_hf_checkpoint(tmp_path / "hf", arch, seed=7)
    gguf_path = write_gguf_from_hf(model, tmp_path / f"tiny-{arch}.gguf", arch)
    store = ModelStore(tmp_path / "home")
    m = import_model(gguf_path, store=store, progress=False)
    assert m.name == f"tiny-{arch}" and m.architecture == arch
    assert m.tied_embeddings is (arch == "qwen2") and m.attention_bias is (arch == "qwen2")
    assert (m.rope_freq_factors is not None) is (arch == "llama")
    ids = np.random.default_rng(3).integers(3, 96, size=80).astype(np.int64)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids[None, :])).logits[0].numpy()
    runners = open_chain(store.model_dir(m.name), [(0, 1), (2, 2)], threads=1)
    ours = np.concatenate([chain_forward(runners, "s", ids[:60]), chain_forward(runners, "s", ids[60:])], axis=1)[0]
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_q4_fragments_compute_the_dequantised_model(tmp_path, monkeypatch) -> None:
    """The q4 graph (MatMulNBits + offsets, 8-bit lm_head) equals fp32 math on the dequantised weights."""
    import torch

    from shards.quant import dequantize
    from shards.tensorfile import read_tensors

    model = make_hf_checkpoint(tmp_path / "hf", "qwen2", seed=8)
    store = ModelStore(tmp_path / "home")
    m = import_model(write_gguf_from_hf(model, tmp_path / "q.gguf", "qwen2"), name="q", weights="q4",
                     store=store, progress=False)
    d = store.model_dir("q")

    def deq(t: dict, name: str) -> torch.Tensor:
        return torch.from_numpy(dequantize({k.split(".", 1)[1]: v for k, v in t.items() if k.startswith(name + ".")}))

    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            t = read_tensors(d / m.files[f"layer.{i}"].path)
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, proj).weight.copy_(deq(t, proj))
            for proj in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, proj).weight.copy_(deq(t, proj))
        head = read_tensors(d / m.files["head"].path)
        emb = read_tensors(d / m.files["embed"].path)["embed"]
        model.lm_head = torch.nn.Linear(64, 96, bias=False)  # untie: the q4 head is 8-bit, the table f16
        model.lm_head.weight.copy_(deq(head, "lm_head"))
        model.model.embed_tokens.weight.copy_(torch.from_numpy(emb.astype(np.float32)))
        ids = np.arange(3, 50, dtype=np.int64)
        ref = model(torch.from_numpy(ids[None, :])).logits[0].numpy()
    fast = chain_forward(open_chain(d, [(0, 2)], threads=1), "s", ids)[0]
    # default accuracy_level 4 (int8 activations, fast): close on this chaotic random net
    assert (fast.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    # accuracy_level 0 (float activations): the very same function as the dequantised weights
    monkeypatch.setattr("shards.fragment.Q4_ACCURACY_LEVEL", 0)
    exact = chain_forward(open_chain(d, [(0, 2)], threads=1), "s", ids)[0]
    np.testing.assert_allclose(exact, ref, atol=1e-4, rtol=0)
