"""The ONNX graph of a whole encoder with its pooling (encoder_graph), built from the weights of
tiny random transformers models (BertModel: post-norm, biases, learned positions, exact GELU;
NomicBertModel: rotary positions, no biases, SwiGLU) and run with onnxruntime: a padded batch
of texts of different lengths gives transformers' last hidden states pooled over each text's
real tokens (the mean, or the first token's) and scaled to unit length when asked; an embedding
depends neither on its padding nor on the other rows of its batch (a property); the graph's
inputs and outputs; what the shape refuses, and a missing tensor named."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shards.errors import ModelFormatError
from shards.graph.encoder_graph import OPSET, EncoderShape, encoder_graph
from shards.store.encoder_manifest import EncoderManifest
from shards.store.manifest import WeightFile
from tests.examples import examples

VOCAB, HIDDEN, LAYERS, HEADS, FFN, POSITIONS = 40, 32, 2, 4, 64, 32
EPS = 1e-12  # transformers' default layer_norm_eps for both
TOLERANCE = 2e-5  # float32 graph against float32 torch
LENGTHS = (7, 3, 5)  # a batch of three texts, padded to the longest
_PROPS = settings(max_examples=examples(50), deadline=None)


@pytest.fixture(scope="module")
def models() -> dict:
    """A random BertModel and NomicBertModel (hidden 32, 2 layers, 4 heads), in eval mode."""
    import torch
    from transformers import BertConfig, BertModel, NomicBertConfig, NomicBertModel

    shape = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
             "intermediate_size": FFN, "max_position_embeddings": POSITIONS}
    torch.manual_seed(0)
    bert = BertModel(BertConfig(**shape), add_pooling_layer=False).eval()
    nomic = NomicBertModel(NomicBertConfig(**shape, initializer_range=0.3,  # sharp attention: positions show
                                           rope_parameters={"rope_type": "default", "rope_theta": 500.0})).eval()
    with torch.no_grad():  # norms away from 1 and 0, so that a misplaced one shows
        for model in (bert, nomic):
            for name, param in model.named_parameters():
                if "LayerNorm" in name or "layernorm" in name:
                    param.add_(torch.randn_like(param) * 0.1)
    return {"bert": bert, "nomic_bert": nomic}


def weights_of(model) -> dict[str, np.ndarray]:
    return {name: value.detach().numpy().copy() for name, value in model.state_dict().items()}


def shape_of(architecture: str, pooling: str = "mean", normalize: bool = True) -> EncoderShape:
    return EncoderShape(LAYERS, HIDDEN, HEADS, EPS, pooling, normalize, architecture,
                        500.0 if architecture == "nomic_bert" else None)


def session(weights: dict[str, np.ndarray], shape: EncoderShape) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(encoder_graph(weights, shape).SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def batch(lengths: tuple[int, ...], seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and attention mask [batch, longest]: each row's own tokens, then padding (id 0, mask 0)."""
    rng = np.random.default_rng(seed)
    ids, mask = np.zeros((len(lengths), max(lengths)), np.int64), np.zeros((len(lengths), max(lengths)), np.int64)
    for row, n in enumerate(lengths):
        ids[row, :n], mask[row, :n] = rng.integers(1, VOCAB, n), 1
    return ids, mask


def embed(s: ort.InferenceSession, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    (out,) = s.run(None, {"input_ids": ids, "attention_mask": mask})
    return out


def transformers_embeddings(model, ids: np.ndarray, mask: np.ndarray, pooling: str, normalize: bool) -> np.ndarray:
    """Each text alone through transformers (no padding at all), pooled and normalised by hand
    as sentence-transformers' Pooling and Normalize modules do."""
    import torch

    out = []
    for row in range(ids.shape[0]):
        real = torch.from_numpy(ids[row, mask[row] == 1])[None]
        with torch.no_grad():
            states = model(input_ids=real, attention_mask=torch.ones_like(real)).last_hidden_state[0]
        vector = states.mean(0) if pooling == "mean" else states[0]
        out.append((vector / vector.norm() if normalize else vector).numpy())
    return np.stack(out)


@pytest.mark.parametrize("architecture, pooling, normalize", [
    ("bert", "mean", True), ("bert", "mean", False), ("bert", "cls", True), ("bert", "cls", False),
    ("nomic_bert", "mean", True), ("nomic_bert", "cls", False),
])
def test_a_padded_batch_gives_transformers_pooled_states(models, architecture, pooling, normalize) -> None:
    model = models[architecture]
    ids, mask = batch(LENGTHS)
    ours = embed(session(weights_of(model), shape_of(architecture, pooling, normalize)), ids, mask)
    theirs = transformers_embeddings(model, ids, mask, pooling, normalize)
    assert ours.shape == (len(LENGTHS), HIDDEN) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE, rtol=0)
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)
    else:
        assert np.abs(np.linalg.norm(ours, axis=1) - 1.0).min() > 1e-2  # the raw pooled states


@pytest.fixture(scope="module")
def mean_sessions(models) -> dict[str, ort.InferenceSession]:
    return {a: session(weights_of(models[a]), shape_of(a, "mean", normalize=False)) for a in models}


@_PROPS
@given(architecture=st.sampled_from(["bert", "nomic_bert"]), lengths=st.lists(st.integers(1, 12), min_size=1,
                                                                               max_size=4),
       extra=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_an_embedding_depends_neither_on_its_padding_nor_on_its_batch(mean_sessions, architecture, lengths, extra,
                                                                    seed) -> None:
    s = mean_sessions[architecture]
    ids, mask = batch(tuple(lengths), seed)
    pad = ((0, 0), (0, extra))
    together = embed(s, np.pad(ids, pad), np.pad(mask, pad))  # more padding than the longest needs
    for row, n in enumerate(lengths):
        alone = embed(s, ids[row:row + 1, :n], mask[row:row + 1, :n])
        np.testing.assert_allclose(together[row], alone[0], atol=1e-5, rtol=0)


def test_first_token_pooling_reads_the_first_position_only(models) -> None:
    s = session(weights_of(models["bert"]), shape_of("bert", "cls", normalize=False))
    ids, mask = batch((6,))
    changed = ids.copy()
    changed[0, 0] = (ids[0, 0] % (VOCAB - 1)) + 1  # another first token
    base = embed(s, ids, mask)
    assert np.abs(embed(s, changed, mask) - base).max() > 1e-3
    swapped = ids.copy()
    swapped[0, 1:] = ids[0, 1:][::-1]  # the same tokens after it in another order: their positions change
    assert np.abs(embed(s, swapped, mask) - base).max() > 1e-4  # bidirectional: the first state sees them


def test_a_row_without_real_tokens_gives_zeros_not_nan(models) -> None:
    s = session(weights_of(models["bert"]), shape_of("bert", "mean", normalize=True))
    ids, mask = batch((4, 4))
    mask[1] = 0
    out = embed(s, ids, mask)
    assert np.isfinite(out).all() and np.abs(out[1]).max() == 0.0
    np.testing.assert_allclose(np.linalg.norm(out[0]), 1.0, atol=1e-6)


def test_the_graph_takes_ids_and_mask_of_any_batch_and_length(models) -> None:
    model = encoder_graph(weights_of(models["nomic_bert"]), shape_of("nomic_bert"))
    onnx.checker.check_model(model)
    g = model.graph
    dims = lambda v: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]  # noqa: E731
    assert [(i.name, dims(i), i.type.tensor_type.elem_type) for i in g.input] == [
        ("input_ids", ["batch", "tokens"], onnx.TensorProto.INT64),
        ("attention_mask", ["batch", "tokens"], onnx.TensorProto.INT64)]
    assert [(o.name, dims(o), o.type.tensor_type.elem_type) for o in g.output] == [
        ("embeddings", ["batch", HIDDEN], onnx.TensorProto.FLOAT)]
    assert [(o.domain, o.version) for o in model.opset_import] == [("", OPSET)]
    assert "embeddings.position_embeddings.weight" not in {t.name for t in g.initializer}  # rotary: no table
    bert = encoder_graph(weights_of(models["bert"]), shape_of("bert")).graph
    assert "embeddings.position_embeddings.weight" in {t.name for t in bert.initializer}


# --- what is refused ---------------------------------------------------------------------------------
def test_a_missing_tensor_is_named(models) -> None:
    weights = weights_of(models["bert"])
    del weights["encoder.layer.1.attention.self.key.weight"]
    with pytest.raises(ModelFormatError, match=r"^the encoder has no tensor 'encoder\.layer\.1\.attention\.self\.key"
                                               r"\.weight'$"):
        encoder_graph(weights, shape_of("bert"))
    nomic = weights_of(models["nomic_bert"])
    del nomic["layers.0.mlp.up_proj.weight"]
    with pytest.raises(ModelFormatError, match="'layers.0.mlp.up_proj.weight'"):
        encoder_graph(nomic, shape_of("nomic_bert"))


@pytest.mark.parametrize("fields, message", [
    ({"architecture": "bert", "rope_theta": 500.0}, "bert: rope_theta is needed by rotary positions, and only there"),
    ({"architecture": "nomic_bert", "rope_theta": None},
     "nomic_bert: rope_theta is needed by rotary positions, and only there"),
    ({"pooling": "max"}, "unknown pooling 'max' (ncm pools by mean, cls)"),
    ({"n_heads": 5}, "hidden_size must be a multiple of the number of heads"),
])
def test_a_shape_ncm_cannot_build_is_refused(fields, message) -> None:
    with pytest.raises(ModelFormatError) as refused:
        dataclasses.replace(shape_of("bert"), **fields)
    assert str(refused.value) == message


@pytest.mark.parametrize("architecture", ["bert", "nomic_bert"])
def test_the_shape_of_a_manifest_is_its_fields(architecture) -> None:
    rope = 500.0 if architecture == "nomic_bert" else None
    manifest = EncoderManifest(name="tiny", architecture=architecture, n_layers=LAYERS, hidden_size=HIDDEN,
                               intermediate_size=FFN, n_heads=HEADS, vocab_size=VOCAB, max_positions=POSITIONS,
                               max_tokens=16, layer_norm_eps=1e-6, pooling="cls", normalize=False,
                               files={"weights": WeightFile("weights.safetensors", 1, "0" * 64)},
                               source_digest="1" * 64, rope_theta=rope)
    assert EncoderShape.of(manifest) == EncoderShape(LAYERS, HIDDEN, HEADS, 1e-6, "cls", False, architecture, rope)
