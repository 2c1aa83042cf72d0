"""FragmentSpec, what a fragment is: its checks on construction (flavour, layer range, context,
the static flavour's chunk; each refusal a FragmentError naming what is wrong, the first
failing check's), its checks against a model's manifest (the range within the model's layers,
the context within the model's), and the constants the fragments are written with."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shards.errors import FragmentError
from shards.graph.spec import FINAL_HIDDEN, FUSED_FLAVOURS, IR_VERSION, ONNX_FILE, FragmentSpec
from shards.providers.backends import FLAVOURS
from shards.store.manifest import Manifest, WeightFile, layer_key
from tests.examples import examples

_PROPS = settings(max_examples=examples(100), deadline=None)


def manifest(n_layers: int = 4, context_length: int = 128) -> Manifest:
    """A valid manifest of ``n_layers`` layers (its weight files are never read here)."""
    file = WeightFile("weights/w.safetensors", 1, "0" * 64)
    files = {"embed": file, "head": file} | {layer_key(i): file for i in range(n_layers)}
    return Manifest(name="tiny", architecture="llama", n_layers=n_layers, hidden_size=64, intermediate_size=128,
                    n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=96, rope_theta=10000.0, rms_norm_eps=1e-5,
                    context_length=context_length, tied_embeddings=True, attention_bias=False, weight_format="f32",
                    files=files, source_digest="1" * 64)


def expected_refusal(first: int, last: int, flavour: str, max_context: int, prefill_chunk: int) -> str | None:
    """What FragmentSpec should say of these fields (None: nothing, it is valid), written from
    its documented contract: a known flavour, 0 <= first <= last, a positive context, a chunk
    not negative, and for the static flavour 0 < chunk <= context; the first failing check wins."""
    if flavour not in FLAVOURS:
        return f"unknown flavour {flavour!r}"
    if not 0 <= first <= last:
        return f"bad layer range {first}..{last}"
    if max_context <= 0 or prefill_chunk < 0:
        return "max_context must be positive and prefill_chunk not negative"
    if flavour == "static" and not 0 < prefill_chunk <= max_context:
        return "the static flavour needs 0 < prefill_chunk <= max_context"
    return None


@_PROPS
@given(first=st.integers(-3, 40), last=st.integers(-3, 40), flavour=st.sampled_from((*FLAVOURS, "tpu", "CPU", "")),
       max_context=st.integers(-4, 300), prefill_chunk=st.integers(-4, 300))
def test_a_spec_is_refused_exactly_when_a_field_is_out_of_its_range(first, last, flavour, max_context,
                                                                   prefill_chunk) -> None:
    want = expected_refusal(first, last, flavour, max_context, prefill_chunk)
    if want is None:
        spec = FragmentSpec(first, last, flavour, max_context, prefill_chunk)
        assert (spec.first_layer, spec.last_layer, spec.flavour, spec.max_context, spec.prefill_chunk) == (
            first, last, flavour, max_context, prefill_chunk)
    else:
        with pytest.raises(FragmentError) as refused:
            FragmentSpec(first, last, flavour, max_context, prefill_chunk)
        assert str(refused.value).startswith(want), (str(refused.value), want)


def test_an_unknown_flavour_is_named_with_the_known_ones() -> None:
    with pytest.raises(FragmentError) as refused:
        FragmentSpec(0, 1, "tpu", 64, 0)
    assert str(refused.value) == "unknown flavour 'tpu' (known: cpu, gpu, portable, static)"


@pytest.mark.parametrize("chunk", [1, 64])
def test_the_static_flavour_takes_a_chunk_from_one_to_the_whole_context(chunk) -> None:
    assert FragmentSpec(2, 2, "static", 64, chunk).prefill_chunk == chunk


@pytest.mark.parametrize("chunk", [0, 65])
def test_the_static_flavour_refuses_no_chunk_or_one_past_the_context(chunk) -> None:
    with pytest.raises(FragmentError, match=r"^the static flavour needs 0 < prefill_chunk <= max_context$"):
        FragmentSpec(2, 2, "static", 64, chunk)


def test_a_spec_is_frozen_and_equal_by_value() -> None:
    spec = FragmentSpec(1, 3, "cpu", 64, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.last_layer = 5  # type: ignore[misc]
    assert spec == FragmentSpec(1, 3, "cpu", 64, 0) and hash(spec) == hash(FragmentSpec(1, 3, "cpu", 64, 0))
    assert spec != FragmentSpec(1, 3, "portable", 64, 0)


@_PROPS
@given(n_layers=st.integers(1, 12), context=st.integers(1, 512), first=st.integers(0, 14), span=st.integers(0, 14),
       max_context=st.integers(1, 600))
def test_validate_accepts_exactly_the_ranges_and_contexts_the_model_has(n_layers, context, first, span,
                                                                       max_context) -> None:
    m = manifest(n_layers, context)
    spec = FragmentSpec(first, first + span, "cpu", max_context, 0)
    if first + span >= n_layers:
        with pytest.raises(FragmentError, match=rf"^bad layer range {first}\.\.{first + span} "
                                                rf"for a model with {n_layers} layers$"):
            spec.validate(m)
    elif max_context > context:
        with pytest.raises(FragmentError, match=rf"^max_context {max_context} must be in 1\.\.{context}$"):
            spec.validate(m)
    else:
        assert spec.validate(m) is None


def test_the_whole_model_at_its_full_context_is_a_valid_fragment() -> None:
    m = manifest(n_layers=4, context_length=128)
    FragmentSpec(0, 3, "static", 128, 128).validate(m)
    with pytest.raises(FragmentError, match="for a model with 4 layers"):
        FragmentSpec(0, 4, "static", 128, 128).validate(m)


def test_the_constants_fragments_are_written_with() -> None:
    assert set(FUSED_FLAVOURS) < set(FLAVOURS) and FUSED_FLAVOURS == ("cpu", "gpu")
    assert {"portable", "static"}.isdisjoint(FUSED_FLAVOURS)  # the plain-op flavours
    assert IR_VERSION == 8 and ONNX_FILE == "fragment.onnx" and FINAL_HIDDEN == "final_hidden"
