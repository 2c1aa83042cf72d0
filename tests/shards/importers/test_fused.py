"""Phi-3's fused matrices split into the ones ncm stores: the query/key/value projection into
q_proj, k_proj and v_proj (rows of n_heads, n_kv_heads and n_kv_heads heads) and the gate/up
one into gate_proj and up_proj (gate first). The parts are the rows of the fused matrix in
order (a property over shapes), and they compute what transformers' own Phi3Attention and
Phi3MLP compute with the fused matrix."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shards.importers.fused import SPLITS, split_fused
from tests.examples import examples

_PROPS = settings(max_examples=examples(100), deadline=None)


def fused_matrix(rows: int, columns: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 1.0, (rows, columns)).astype(np.float32)


@_PROPS
@given(n_kv_heads=st.integers(1, 4), group=st.integers(1, 4), head_dim=st.integers(1, 12), columns=st.integers(1, 9))
def test_qkv_splits_into_query_key_and_value_rows_in_order(n_kv_heads, group, head_dim, columns) -> None:
    n_heads = n_kv_heads * group
    params = {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim}
    q_rows, kv_rows = n_heads * head_dim, n_kv_heads * head_dim
    matrix = fused_matrix(q_rows + 2 * kv_rows, columns)
    parts = split_fused(params, "qkv_proj", matrix)
    assert list(parts) == ["q_proj", "k_proj", "v_proj"]
    np.testing.assert_array_equal(parts["q_proj"], matrix[:q_rows])
    np.testing.assert_array_equal(parts["k_proj"], matrix[q_rows:q_rows + kv_rows])
    np.testing.assert_array_equal(parts["v_proj"], matrix[q_rows + kv_rows:])
    assert parts["v_proj"].shape == (kv_rows, columns)


@_PROPS
@given(intermediate=st.integers(1, 40), columns=st.integers(1, 9))
def test_gate_up_splits_into_two_halves_gate_first(intermediate, columns) -> None:
    matrix = fused_matrix(2 * intermediate, columns)
    parts = split_fused({"intermediate_size": intermediate}, "gate_up_proj", matrix)
    assert list(parts) == ["gate_proj", "up_proj"]
    np.testing.assert_array_equal(parts["gate_proj"], matrix[:intermediate])
    np.testing.assert_array_equal(parts["up_proj"], matrix[intermediate:])
    np.testing.assert_array_equal(np.concatenate(list(parts.values())), matrix)


def test_the_split_names_are_the_ones_the_importers_store() -> None:
    assert SPLITS == {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module")
def phi3():
    """A tiny Phi3Config with grouped queries: 4 heads of 8 dims over 2 KV heads."""
    from transformers import Phi3Config

    config = Phi3Config(vocab_size=32, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    config._attn_implementation = "eager"
    return config


def params_of(config) -> dict[str, int]:
    head_dim = config.hidden_size // config.num_attention_heads
    return {"n_heads": config.num_attention_heads, "n_kv_heads": config.num_key_value_heads, "head_dim": head_dim,
            "intermediate_size": config.intermediate_size}


def test_split_gate_and_up_compute_what_phi3_mlp_computes(phi3) -> None:
    import torch
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    torch.manual_seed(0)
    mlp = Phi3MLP(phi3).eval()
    parts = split_fused(params_of(phi3), "gate_up_proj", mlp.gate_up_proj.weight.detach().numpy())
    x = np.random.default_rng(1).normal(0.0, 1.0, (5, phi3.hidden_size)).astype(np.float32)
    gate = x.astype(np.float64) @ parts["gate_proj"].T
    ours = (gate / (1.0 + np.exp(-gate)) * (x @ parts["up_proj"].T)) @ mlp.down_proj.weight.detach().numpy().T
    with torch.no_grad():
        theirs = mlp(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


def test_split_query_key_and_value_compute_what_phi3_attention_computes(phi3) -> None:
    """Phi3Attention without rotation (cos 1, sin 0) and without a mask: its attention weights
    are the softmax of our queries and keys, its output our values weighted by them."""
    import torch
    from transformers.models.phi3.modeling_phi3 import Phi3Attention

    torch.manual_seed(2)
    attention = Phi3Attention(phi3, layer_idx=0).eval()
    p = params_of(phi3)
    parts = split_fused(p, "qkv_proj", attention.qkv_proj.weight.detach().numpy())
    tokens, hd, group = 6, p["head_dim"], p["n_heads"] // p["n_kv_heads"]
    x = np.random.default_rng(3).normal(0.0, 1.0, (tokens, phi3.hidden_size)).astype(np.float32)
    heads = lambda w, n: (x.astype(np.float64) @ w.T).reshape(tokens, n, hd).transpose(1, 0, 2)  # noqa: E731
    q, k, v = heads(parts["q_proj"], p["n_heads"]), heads(parts["k_proj"], p["n_kv_heads"]), \
        heads(parts["v_proj"], p["n_kv_heads"])
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)  # query head h reads KV head h // group
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    context = (weights @ v).transpose(1, 0, 2).reshape(tokens, -1)
    ours = context @ attention.o_proj.weight.detach().numpy().T.astype(np.float64)
    no_turn = (torch.ones(1, tokens, hd), torch.zeros(1, tokens, hd))
    with torch.no_grad():
        theirs, their_weights = attention(torch.from_numpy(x)[None], position_embeddings=no_turn, attention_mask=None)
    np.testing.assert_allclose(weights, their_weights[0].numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(ours, theirs[0].numpy(), atol=1e-5, rtol=0)
