"""A rotary over part of each head, as both importers read it (rotary_params): nothing for a
whole-head rotary, ``rotary_dim`` for Phi-3's partial one when onnxruntime's fused attention can
turn it (a multiple of 16 below the head's width), one line of UnsupportedArchitectureError
otherwise (properties over widths and architectures). The width it grants, as a manifest's
``rotary_dim`` turned by the fragments' rotary tables, gives the frequencies and the cos / sin
of transformers' own Phi-3 rotary (Phi3RotaryEmbedding, plain and with a long rope, whose
frequencies and attention factor ROPE_INIT_FUNCTIONS gives) for partial_rotary_factor 1/4, 1/2
and 3/4."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shards.errors import ModelFormatError, UnsupportedArchitectureError
from shards.graph.fragment_graph import rope_tables
from shards.importers.rotary import PARTIAL_ROTARY_ARCHITECTURES, ROTARY_DIM_MULTIPLE, rotary_params
from shards.store.manifest import ARCHITECTURES, Manifest, WeightFile, layer_key
from tests.examples import examples

_PROPS = settings(max_examples=examples(100), deadline=None)
HIDDEN, HEADS = 128, 2  # head_dim 64, as Phi-4-mini's heads are 128 wide with 96 dims turned
HEAD_DIM = HIDDEN // HEADS
ORIGINAL_CONTEXT = 64


def manifest(rotary: dict, head_dim: int = HEAD_DIM, **fields) -> Manifest:
    """A phi3 manifest with ``rotary`` (rotary_params' answer) among its fields."""
    file = WeightFile("weights/w.safetensors", 1, "0" * 64)
    files = {"embed": file, "head": file, layer_key(0): file}
    return Manifest(name="phi", architecture="phi3", n_layers=1, hidden_size=HIDDEN, intermediate_size=256,
                    n_heads=HEADS, n_kv_heads=1, head_dim=head_dim, vocab_size=32, rope_theta=10000.0,
                    rms_norm_eps=1e-5, context_length=ORIGINAL_CONTEXT, tied_embeddings=False, attention_bias=False,
                    weight_format="f32", files=files, source_digest="1" * 64, **rotary, **fields)


# --- the rule ------------------------------------------------------------------------------------
@_PROPS
@given(architecture=st.sampled_from(ARCHITECTURES), half=st.integers(1, 128))
def test_a_whole_head_rotary_adds_nothing_to_the_manifest(architecture, half) -> None:
    assert rotary_params("src", architecture, 2 * half, 2 * half) == {}


@_PROPS
@given(architecture=st.sampled_from([a for a in ARCHITECTURES if a not in PARTIAL_ROTARY_ARCHITECTURES]),
       head_dim=st.integers(2, 256), rotary_dim=st.integers(0, 256))
def test_a_partial_rotary_is_refused_for_architectures_that_do_not_pass_dims(architecture, head_dim,
                                                                            rotary_dim) -> None:
    if rotary_dim == head_dim:
        return
    with pytest.raises(UnsupportedArchitectureError) as refused:
        rotary_params("my-model", architecture, rotary_dim, head_dim)
    assert str(refused.value) == (f"my-model: a rotary over part of each head ({rotary_dim} of {head_dim} dims) "
                                  f"is not supported for {architecture}")


@_PROPS
@given(head_dim=st.integers(2, 320), rotary_dim=st.integers(-32, 320))
def test_phi3_keeps_a_partial_rotary_exactly_when_the_fused_attention_can_turn_it(head_dim, rotary_dim) -> None:
    if rotary_dim == head_dim:
        assert rotary_params("src", "phi3", rotary_dim, head_dim) == {}
    elif 0 < rotary_dim < head_dim and rotary_dim % ROTARY_DIM_MULTIPLE == 0:
        assert rotary_params("src", "phi3", rotary_dim, head_dim) == {"rotary_dim": rotary_dim}
    else:
        with pytest.raises(UnsupportedArchitectureError) as refused:
            rotary_params("src", "phi3", rotary_dim, head_dim)
        assert str(refused.value) == (f"src: a rotary over {rotary_dim} of {head_dim} dims is not supported "
                                      f"(ncm rotates a multiple of {ROTARY_DIM_MULTIPLE})")


def test_refusals_are_model_format_errors_of_one_line() -> None:
    for args in (("a/b.gguf", "llama", 48, 64), ("phi-4", "phi3", 24, 64), ("phi-4", "phi3", 80, 64)):
        with pytest.raises(ModelFormatError) as refused:
            rotary_params(*args)
        assert "\n" not in str(refused.value) and str(refused.value).startswith(f"{args[0]}: ")


def test_the_rule_is_the_one_the_manifest_and_the_fused_kernel_share() -> None:
    assert PARTIAL_ROTARY_ARCHITECTURES == ("phi3",) and ROTARY_DIM_MULTIPLE == 16
    rotary = rotary_params("phi-4-mini", "phi3", 96, 128)
    assert manifest(rotary, head_dim=128).rotary_width == 96
    assert manifest(rotary_params("phi-3", "phi3", 64, 64)).rotary_width == 64


# --- against transformers' Phi-3 rotary ----------------------------------------------------------
def phi3_config(partial: float, rope: dict):
    from transformers import Phi3Config

    return Phi3Config(vocab_size=32, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=HEADS, num_key_value_heads=1, max_position_embeddings=4 * ORIGINAL_CONTEXT,
                      original_max_position_embeddings=ORIGINAL_CONTEXT, pad_token_id=0,
                      rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": partial, **rope})


def inverse_frequencies(m: Manifest) -> np.ndarray:
    """The fragments' frequencies, read back from their table: the angle of position 1."""
    cos, sin = rope_tables(m, 2)
    return np.arctan2(sin[1], cos[1]).astype(np.float64)


def transformers_cos_sin(config, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """Phi3RotaryEmbedding's cos and sin of positions 0..positions-1 (its width: the turned dims)."""
    import torch
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    with torch.no_grad():
        cos, sin = Phi3RotaryEmbedding(config)(torch.zeros(1, positions, HIDDEN), torch.arange(positions)[None])
    return cos[0].double().numpy(), sin[0].double().numpy()


@pytest.mark.parametrize("partial", [0.25, 0.5, 0.75])
def test_the_granted_width_gives_phi3s_plain_rotary(partial) -> None:
    config = phi3_config(partial, {"rope_type": "default"})
    rotary = rotary_params("phi", "phi3", int(HEAD_DIM * partial), HEAD_DIM)
    m = manifest(rotary)
    their_cos, their_sin = transformers_cos_sin(config, ORIGINAL_CONTEXT)
    assert their_cos.shape[-1] == m.rotary_width == rotary["rotary_dim"] == int(HEAD_DIM * partial)
    cos, sin = rope_tables(m, ORIGINAL_CONTEXT)
    np.testing.assert_allclose(np.concatenate([cos, cos], axis=1), their_cos, atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.concatenate([sin, sin], axis=1), their_sin, atol=2e-5, rtol=0)


@pytest.mark.parametrize("partial", [0.25, 0.5, 0.75])
def test_the_granted_width_gives_phi3s_long_rope_cos_and_sin_up_to_the_original_context(partial) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    width = int(HEAD_DIM * partial)
    short = [1.0 + i / 4 for i in range(width // 2)]
    config = phi3_config(partial, {"rope_type": "longrope", "short_factor": short,
                                   "long_factor": [2 * f for f in short]})
    inv_freq, attention = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=ORIGINAL_CONTEXT)
    rotary = rotary_params("phi", "phi3", width, HEAD_DIM)
    m = manifest(rotary, rope_freq_factors=tuple(short), rotary_scale=float(attention))
    assert m.rotary_width == width == 2 * len(inv_freq)
    assert attention == pytest.approx(np.sqrt(1 + np.log(4) / np.log(64)))  # context 256 over the original 64
    np.testing.assert_allclose(inverse_frequencies(m), inv_freq.double().numpy(), rtol=1e-6, atol=0)
    their_cos, their_sin = transformers_cos_sin(config, ORIGINAL_CONTEXT)
    cos, sin = rope_tables(m, ORIGINAL_CONTEXT)
    assert their_cos.shape[-1] == width  # transformers turns the same dims: [cos, cos] over the rotary width
    np.testing.assert_allclose(np.concatenate([cos, cos], axis=1), their_cos, atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.concatenate([sin, sin], axis=1), their_sin, atol=2e-5, rtol=0)
