"""The fragment graphs of shards.graph.fragment_graph, written by write_fragment from a tiny
stored llama (2 layers, 4 query heads of 32 dims over 2 KV heads, norms away from 1) and run
with onnxruntime the way each flavour's contract says, against a float64 numpy forward of the
checkpoint's own tensors written here:

- every flavour (cpu, gpu, portable, static) over a prefill then decode steps gives the
  reference's logits and keeps its rotated keys and values, with the manifest's knobs
  (embedding, residual, attention and logit scales, soft-caps, GELU, sliding windows with a
  rotary base of their own, a partial rotary with frequency factors and its scale, layers
  without rotary positions);
- fragments of a split hand their hidden states on; the fused flavours run rows of a batch at
  their own positions and return the logits of ``logits_from`` on, with the final hidden states;
- each flavour's inputs, outputs and ops; 16-bit and 4-bit weights (MatMulNBits on int8
  activations taken twice, x and what rounding left of it) compute with their stored values;
- rope_tables against transformers' ROPE_INIT_FUNCTIONS (llama3, linear) and its own formula;
- weights as content-addressed files hard-linked from the pool.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from shards.graph.fragment import Q4_ACCURACY_LEVEL, Q8_ACCURACY_LEVEL
from shards.graph.fragment_graph import INT8_ACTIVATIONS, MS, _Graph, rope_tables, write_fragment
from shards.graph.spec import FINAL_HIDDEN, IR_VERSION, ONNX_FILE, FragmentSpec
from shards.importers.hf import llama3_freq_factors
from shards.importers.importer import import_model
from shards.importers.quant import dequantize
from shards.importers.stored_form import load_stored
from shards.store.manifest import Manifest, WeightFile, layer_key
from shards.store.model_store import ModelStore
from shards.store.tensorfile import read_tensors
from tests.examples import examples
from tests.shards.fragment_helpers import VOCAB, add_tensors, write_tiny_checkpoint

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2, 64, 4, 2, 32
MAX_CONTEXT, CHUNK = 32, 4
IDS = np.random.default_rng(0).integers(3, VOCAB, 9)
STEPS = (6, 1, 1, 1)  # a prefill, then decode steps (static: chunks of 4, the prefill's second one padded)
FLAVOURS = ("cpu", "gpu", "portable", "static")
EXACT = 1e-4  # float32 graph against the float64 reference (logits of a few units)
HALF = 5e-3  # the "gpu" flavour's float16 products, relative to the largest magnitude
INT8_TWICE = 2e-4  # block products on int8 activations taken twice (about 16 bits each)
INT8_ONCE = 5e-2  # taken once (activation_bits 8): on the random tiny model about 3 % of the largest logit
_PROPS = settings(max_examples=examples(100), deadline=None)
VARIANTS = {  # manifest fields over the same weights
    "plain": {},
    "scales": {"embedding_scale": 3.0, "residual_scale": 0.4, "logit_scale": 2.5, "attention_scale": 0.05},
    "softcaps_gelu_window": {"activation": "gelu_tanh", "attention_softcap": 2.0, "logit_softcap": 3.0,
                             "sliding_window": 4, "sliding_layers": (0,)},
    "window_with_own_base": {"rope_theta": 1e6, "sliding_window": 3, "sliding_layers": (1,),
                             "sliding_rope_theta": 50.0},
    "partial_rotary": {"rotary_dim": 16, "rope_freq_factors": (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 9.0),
                       "rotary_scale": 1.2, "sliding_window": 5, "sliding_layers": (0, 1)},
    "no_rope_layer": {"layers_without_rope": (1,), "rope_freq_factors": tuple(np.linspace(1.0, 8.0, 16))},
}


# --- the model and its reference --------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Stored:
    manifest: Manifest
    model_dir: Path
    weights: dict[str, np.ndarray]  # Hugging Face names, float64: what the reference computes with


def write_checkpoint(folder: Path) -> Path:
    """write_tiny_checkpoint's llama with heads of 32 dims (wider than hidden / heads: 4 query
    heads over 2 KV heads, so that a query head reading the wrong KV head shows) and random norm
    weights (so that a misplaced norm shows)."""
    write_tiny_checkpoint(folder, seed=3, layers=LAYERS)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_attention_heads": HEADS,
                                                             "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM}))
    rng = np.random.default_rng(5)
    norms = ["model.norm.weight"] + [f"model.layers.{i}.{n}.weight" for i in range(LAYERS)
                                     for n in ("input_layernorm", "post_attention_layernorm")]
    tensors = {name: rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32) for name in norms}
    shapes = {"q_proj": (HEADS * HEAD_DIM, HIDDEN), "k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
              "v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "o_proj": (HIDDEN, HEADS * HEAD_DIM)}
    for i in range(LAYERS):
        tensors |= {f"model.layers.{i}.self_attn.{name}.weight": rng.normal(0.0, 0.15, shape).astype(np.float32)
                    for name, shape in shapes.items()}
    add_tensors(folder, tensors)
    return folder


def stored_weights(model_dir: Path, m: Manifest) -> dict[str, np.ndarray]:
    """The stored tensors under their Hugging Face names, as float64 (blocks dequantised)."""
    def value(t: dict[str, np.ndarray], name: str) -> np.ndarray:
        if name in t:
            return t[name].astype(np.float64)
        return dequantize({k[len(name) + 1:]: v for k, v in t.items() if k.startswith(name + ".")}).astype(np.float64)

    embed, head = load_stored(model_dir, m, "embed"), load_stored(model_dir, m, "head")
    out = {"model.embed_tokens.weight": value(embed, "embed"), "model.norm.weight": value(head, "norm")}
    shared = m.shared_table  # the output layer is the embedding file's table (its 8-bit blocks)
    out["lm_head.weight"] = value(embed, "embed") if shared else value(head, "lm_head")
    names = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"} | {
        p: f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")} | {
        p: f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    for i in range(m.n_layers):
        t = load_stored(model_dir, m, layer_key(i))
        out |= {f"model.layers.{i}.{hf}.weight": value(t, ours) for ours, hf in names.items()}
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Stored]:
    root = tmp_path_factory.mktemp("fragment-graph")
    checkpoint = write_checkpoint(root / "checkpoint")
    store = ModelStore(root / "home")
    out = {}
    for weights in ("f32", "f16", "q4"):
        m = import_model(checkpoint, name=f"tiny-{weights}", weights=weights, store=store, progress=False)
        model_dir = store.model_dir(m.name)
        reference = read_tensors(checkpoint / "model.safetensors") if weights == "f32" else stored_weights(model_dir, m)
        out[weights] = Stored(m, model_dir, {k: np.asarray(v, np.float64) for k, v in reference.items()})
    return out


def rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rotate(x: np.ndarray, positions: np.ndarray, m: Manifest, sliding: bool) -> np.ndarray:
    """Rotate-half rotary of the first rotary_width dims of ``x`` [heads, tokens, head_dim]."""
    width, own = m.rotary_width, sliding and m.sliding_rope_theta is not None
    inv = 1.0 / (m.sliding_rope_theta if own else m.rope_theta) ** (np.arange(0, width, 2) / width)
    if m.rope_freq_factors is not None and not own:
        inv = inv / np.array(m.rope_freq_factors)
    angles = positions[:, None] * inv[None]
    scale = 1.0 if own else m.rotary_scale
    cos, sin = scale * np.cos(angles), scale * np.sin(angles)
    x1, x2 = x[..., :width // 2], x[..., width // 2:width]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., width:]], axis=-1)


def reference(m: Manifest, w: dict[str, np.ndarray], ids: np.ndarray, first: int = 0, last: int = LAYERS - 1,
              hidden: np.ndarray | None = None) -> dict:
    """The whole sequence at once: per layer its rotated keys and values [kv_heads, tokens,
    head_dim] and its output; for the tail the final normed states and the logits."""
    x = w["model.embed_tokens.weight"][ids] * m.embedding_scale if hidden is None else hidden.astype(np.float64)
    n, hd, group = x.shape[0], m.head_dim, m.n_heads // m.n_kv_heads
    positions = np.arange(n, dtype=np.float64)
    out: dict = {"k": {}, "v": {}, "hidden": {}}
    for li in range(first, last + 1):
        p = f"model.layers.{li}."
        sliding = li in m.sliding_layers
        xn = rms(x, w[p + "input_layernorm.weight"], m.rms_norm_eps)
        q, k, v = ((xn @ w[p + f"self_attn.{name}_proj.weight"].T).reshape(n, heads, hd).transpose(1, 0, 2)
                   for name, heads in (("q", m.n_heads), ("k", m.n_kv_heads), ("v", m.n_kv_heads)))
        if li not in m.layers_without_rope:
            q, k = rotate(q, positions, m, sliding), rotate(k, positions, m, sliding)
        out["k"][li], out["v"][li] = k, v
        query, key = np.arange(n)[:, None], np.arange(n)[None, :]
        visible = (key <= query) & ((key > query - m.sliding_window) if sliding else True)
        scale = m.attention_scale if m.attention_scale is not None else 1.0 / np.sqrt(hd)
        heads = []
        for h in range(m.n_heads):
            scores = q[h] @ k[h // group].T * scale
            if m.attention_softcap:
                scores = m.attention_softcap * np.tanh(scores / m.attention_softcap)
            scores = np.where(visible, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            heads.append(probs / probs.sum(-1, keepdims=True) @ v[h // group])
        x = x + np.concatenate(heads, axis=-1) @ w[p + "self_attn.o_proj.weight"].T * m.residual_scale
        xn = rms(x, w[p + "post_attention_layernorm.weight"], m.rms_norm_eps)
        gate = xn @ w[p + "mlp.gate_proj.weight"].T
        if m.activation == "silu":
            act = gate / (1.0 + np.exp(-gate))
        else:
            act = 0.5 * gate * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (gate + 0.044715 * gate ** 3)))
        x = x + (act * (xn @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T * m.residual_scale
        out["hidden"][li] = x
    if last == m.n_layers - 1:
        out["final"] = rms(x, w["model.norm.weight"], m.rms_norm_eps)
        logits = out["final"] @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T * m.logit_scale
        out["logits"] = m.logit_softcap * np.tanh(logits / m.logit_softcap) if m.logit_softcap else logits
    return out


# --- building and running fragments -----------------------------------------------------------
def build(stored: Stored, m: Manifest, spec: FragmentSpec, out: Path, *, q4_level: int = Q4_ACCURACY_LEVEL,
          q8_level: int = Q8_ACCURACY_LEVEL, int8_min_weights: int = 0, int8_twice: bool = True) -> tuple[Path, int]:
    """The fragment's graph; every block product at its bits' level unless ``int8_min_weights``
    (the tiny model's products are all below the stores' own threshold)."""
    out.mkdir(parents=True)
    pool = out.parent / "pool"
    pool.mkdir(exist_ok=True)
    weight_bytes = write_fragment(stored.model_dir, m, spec, out, pool, q4_level=q4_level, q8_level=q8_level,
                                  int8_min_weights=int8_min_weights, int8_twice=int8_twice)
    return out / ONNX_FILE, weight_bytes


def open_session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def spec_of(flavour: str, first: int = 0, last: int = LAYERS - 1) -> FragmentSpec:
    return FragmentSpec(first, last, flavour, MAX_CONTEXT, CHUNK if flavour == "static" else 0)


def run(session: ort.InferenceSession, m: Manifest, spec: FragmentSpec, x: np.ndarray,
        steps: tuple[int, ...] = STEPS) -> tuple[np.ndarray, dict]:
    """Feed ``x`` (token ids [N] or hidden states [N, hidden]) in ``steps`` as the flavour's
    contract says; returns the first output's rows [N, width] and the cache of every layer
    ({layer: (keys, values)}, [kv_heads, N, head_dim] float64)."""
    flavour, layers = spec.flavour, range(spec.first_layer, spec.last_layer + 1)
    names = [o.name for o in session.get_outputs()]
    inputs = {i.name for i in session.get_inputs()}
    tail = "logits_from" in inputs or "logits" in names
    kv_dtype = np.float16 if flavour == "gpu" else np.float32
    length = {"cpu": MAX_CONTEXT, "gpu": MAX_CONTEXT, "portable": 0, "static": MAX_CONTEXT}[flavour]
    cache = {f"past_{kind}.{li}": np.zeros((1, m.n_kv_heads, length, m.head_dim), kv_dtype)
             for li in layers for kind in ("key", "value")}
    x_name = "input_ids" if "input_ids" in inputs else "hidden_states"
    rows, done = [], 0
    for n in steps:
        for start in range(0, n, CHUNK if flavour == "static" else n):
            valid = min(CHUNK, n - start) if flavour == "static" else n
            piece = x[done:done + valid][None]
            if flavour == "static" and valid < CHUNK:  # a padded chunk: its last rows are garbage
                piece = np.concatenate([piece, np.zeros((1, CHUNK - valid, *piece.shape[2:]), piece.dtype)], axis=1)
            feeds = {x_name: piece, **cache}
            if flavour != "portable":
                feeds["past_length"] = np.array([done], np.int64)
            if tail and flavour in ("cpu", "gpu"):
                feeds["logits_from"] = np.array([0], np.int64)
            outs = dict(zip(names, session.run(None, feeds)))
            for name in cache:
                if flavour == "static":
                    cache[name][:, :, done:done + valid] = outs[name.replace("past_", "new_")][:, :, :valid]
                else:
                    cache[name] = outs[name.replace("past_", "present_")]
            rows.append(outs[names[0]][0, :valid])
            done += valid
    kv = {li: tuple(cache[f"past_{kind}.{li}"][0, :, :done].astype(np.float64) for kind in ("key", "value"))
          for li in layers}
    return np.concatenate(rows), kv


def assert_close(got: np.ndarray, want: np.ndarray, flavour: str, exact: float = EXACT) -> None:
    scale = max(1.0, float(np.abs(want).max()))
    tolerance = HALF * scale if flavour == "gpu" else exact * scale
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= tolerance, (flavour, float(np.abs(got - want).max()), tolerance)


# --- every flavour against the reference ------------------------------------------------------
@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_whole_model_fragment_gives_the_reference_logits_and_cache(tiny, tmp_path, variant, flavour) -> None:
    stored = tiny["f32"]
    m = dataclasses.replace(stored.manifest, **VARIANTS[variant])
    spec = spec_of(flavour)
    path, _ = build(stored, m, spec, tmp_path / "fragment")
    logits, kv = run(open_session(path), m, spec, IDS)
    want = reference(m, stored.weights, IDS)
    assert logits.dtype == np.float32
    assert_close(logits, want["logits"], flavour)
    for li in range(LAYERS):
        assert_close(kv[li][0], want["k"][li], flavour)
        assert_close(kv[li][1], want["v"][li], flavour)


def test_the_reference_sees_what_the_variants_change(tiny) -> None:
    """Each variant moves the logits (so the comparisons above check the knob, not the plain model)."""
    stored = tiny["f32"]
    plain = reference(stored.manifest, stored.weights, IDS)["logits"]
    for variant, fields in VARIANTS.items():
        if fields:
            moved = reference(dataclasses.replace(stored.manifest, **fields), stored.weights, IDS)["logits"]
            assert np.abs(moved - plain).max() > 1e-2, variant


@pytest.mark.parametrize("flavour", ["cpu", "portable", "static"])
def test_fragments_of_a_split_hand_their_hidden_states_on(tiny, tmp_path, flavour) -> None:
    stored = tiny["f32"]
    m = dataclasses.replace(stored.manifest, **VARIANTS["window_with_own_base"])
    head_path, _ = build(stored, m, spec_of(flavour, 0, 0), tmp_path / "head")
    tail_path, _ = build(stored, m, spec_of(flavour, 1, 1), tmp_path / "tail")
    head, tail = open_session(head_path), open_session(tail_path)
    assert [i.name for i in head.get_inputs()][0] == "input_ids" and head.get_outputs()[0].name == "hidden_states_out"
    assert [i.name for i in tail.get_inputs()][0] == "hidden_states" and tail.get_outputs()[0].name == "logits"
    hidden, head_kv = run(head, m, spec_of(flavour, 0, 0), IDS)
    logits, tail_kv = run(tail, m, spec_of(flavour, 1, 1), hidden)
    want = reference(m, stored.weights, IDS)
    assert set(head_kv) == {0} and set(tail_kv) == {1}
    assert_close(hidden, want["hidden"][0], flavour)
    assert_close(tail_kv[1][0], want["k"][1], flavour)
    assert_close(logits, want["logits"], flavour)


def test_a_fused_batch_runs_each_row_at_its_own_position(tiny, tmp_path) -> None:
    """Two rows whose caches hold 5 and 2 positions decode one token each in one run."""
    stored = tiny["f32"]
    m = dataclasses.replace(stored.manifest, **VARIANTS["softcaps_gelu_window"])
    spec = spec_of("cpu")
    session = open_session(build(stored, m, spec, tmp_path / "fragment")[0])
    other = np.random.default_rng(9).integers(3, VOCAB, 3)
    lengths = (5, 2)
    caches = [run(session, m, spec, ids[:n], (n,))[1] for ids, n in ((IDS, lengths[0]), (other, lengths[1]))]
    feeds = {"input_ids": np.array([[IDS[5]], [other[2]]]), "past_length": np.array(lengths, np.int64),
             "logits_from": np.array([0], np.int64)}
    for li in range(LAYERS):
        for j, kind in enumerate(("key", "value")):
            buffer = np.zeros((2, m.n_kv_heads, MAX_CONTEXT, m.head_dim), np.float32)
            for row, cache in enumerate(caches):
                buffer[row, :, :lengths[row]] = cache[li][j]
            feeds[f"past_{kind}.{li}"] = buffer
    outs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    assert outs["logits"].shape == (2, 1, VOCAB)
    assert_close(outs["logits"][0, 0], reference(m, stored.weights, IDS[:6])["logits"][5], "cpu")
    assert_close(outs["logits"][1, 0], reference(m, stored.weights, other)["logits"][2], "cpu")
    present = outs["present_key.1"]
    assert_close(present[1, :, :3].astype(np.float64), reference(m, stored.weights, other)["k"][1], "cpu")


def test_logits_from_keeps_the_last_rows_with_their_final_hidden_states(tiny, tmp_path) -> None:
    stored = tiny["f32"]
    m, spec = stored.manifest, spec_of("cpu")
    session = open_session(build(stored, m, spec, tmp_path / "fragment")[0])
    feeds = {"input_ids": IDS[None, :6], "past_length": np.array([0], np.int64), "logits_from": np.array([4], np.int64)}
    feeds |= {f"past_{kind}.{li}": np.zeros((1, KV_HEADS, MAX_CONTEXT, HEAD_DIM), np.float32)
              for li in range(LAYERS) for kind in ("key", "value")}
    outs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    want = reference(m, stored.weights, IDS[:6])
    assert outs["logits"].shape == (1, 2, VOCAB) and outs[FINAL_HIDDEN].shape == (1, 2, HIDDEN)
    assert_close(outs["logits"][0], want["logits"][4:], "cpu")
    assert_close(outs[FINAL_HIDDEN][0], want["final"][4:], "cpu")


# --- what each flavour's graph is -----------------------------------------------------------------
def dims(value_info) -> list:
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in value_info.type.tensor_type.shape.dim]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_each_flavour_has_its_inputs_outputs_and_ops(tiny, tmp_path, flavour) -> None:
    stored = tiny["f32"]
    path, _ = build(stored, stored.manifest, spec_of(flavour), tmp_path / "fragment")
    model = onnx.load(path, load_external_data=False)
    g = model.graph
    assert model.ir_version == IR_VERSION and g.name == f"ncm_tiny-f32_0_1_{flavour}"
    assert {(o.domain, o.version) for o in model.opset_import} == {("", 17), (MS, 1)}
    inputs = {i.name: (dims(i), i.type.tensor_type.elem_type) for i in g.input}
    outputs = {o.name: (dims(o), o.type.tensor_type.elem_type) for o in g.output}
    kv_type = onnx.TensorProto.FLOAT16 if flavour == "gpu" else onnx.TensorProto.FLOAT
    f32, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    batch, t, past, new = {"cpu": ("B", "T", "C", "C"), "gpu": ("B", "T", "C", "C"),
                           "portable": (1, "T", "P", "P_plus_T"),
                           "static": (1, CHUNK, MAX_CONTEXT, CHUNK)}[flavour]
    rows = "L" if flavour in ("cpu", "gpu") else t
    want_in = {"input_ids": ([batch, t], i64)} | {f"past_{kind}.{li}": ([batch, KV_HEADS, past, HEAD_DIM], kv_type)
                                                  for li in range(LAYERS) for kind in ("key", "value")}
    if flavour != "portable":
        want_in["past_length"] = ([batch], i64)
    if flavour in ("cpu", "gpu"):
        want_in["logits_from"] = ([1], i64)
    kv_out = "new" if flavour == "static" else "present"
    want_out = {"logits": ([batch, rows, VOCAB], f32), FINAL_HIDDEN: ([batch, rows, HIDDEN], f32)} | {
        f"{kv_out}_{kind}.{li}": ([batch, KV_HEADS, new, HEAD_DIM], kv_type) for li in range(LAYERS)
        for kind in ("key", "value")}
    assert inputs == want_in and outputs == want_out
    assert [o.name for o in g.output][0] == "logits" and [o.name for o in g.output][-1] == FINAL_HIDDEN
    ops = {(n.domain or "", n.op_type) for n in g.node}
    if flavour in ("cpu", "gpu"):
        assert {(MS, "GroupQueryAttention"), (MS, "SkipSimplifiedLayerNormalization")} <= ops
    else:
        assert {domain for domain, _ in ops} == {""}


@pytest.mark.parametrize("flavour", ["cpu", "gpu", "portable", "static"])
@pytest.mark.parametrize("weights", ["f16", "q4"])
def test_stored_16_and_4_bit_weights_compute_with_their_values(tiny, tmp_path, weights, flavour) -> None:
    """The reference computes with the stored weights (4-bit blocks dequantised); block products
    run on int8 activations taken twice (x, then what rounding left of it: about 16 bits)."""
    stored = tiny[weights]
    spec = spec_of(flavour)
    path, _ = build(stored, stored.manifest, spec, tmp_path / "fragment")
    logits, _ = run(open_session(path), stored.manifest, spec, IDS)
    assert_close(logits, reference(stored.manifest, stored.weights, IDS)["logits"], flavour,
                 INT8_TWICE if weights == "q4" else EXACT)


@pytest.mark.parametrize("flavour, levels", [("cpu", (0, INT8_ACTIVATIONS)), ("portable", (1, 2)), ("gpu", (4, 4))])
def test_block_products_run_at_the_accuracy_level_given_for_their_bits(tiny, tmp_path, flavour, levels) -> None:
    stored = tiny["q4"]
    path, _ = build(stored, stored.manifest, spec_of(flavour), tmp_path / "fragment", q4_level=levels[0],
                    q8_level=levels[1])
    graph = onnx.load(path, load_external_data=False).graph
    made_by = {out: n for n in graph.node for out in n.output}
    by_bits: dict[int, list[int]] = {}
    for n in (n for n in graph.node if n.op_type == "MatMulNBits"):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert n.domain == MS and attrs["block_size"] == 32
        by_bits.setdefault(attrs["bits"], []).append(attrs["accuracy_level"])
        # on int8 activations, the rows of the one product are x and what rounding left of it
        stacked = n.input[0] in made_by and made_by[n.input[0]].op_type == "Concat"
        assert stacked == (attrs["accuracy_level"] == INT8_ACTIVATIONS)
    # per layer: q/k/v (one fused product, or three apart for plain attention), o, gate/up, down;
    # the output layer: one
    per_layer = 4 if flavour in ("cpu", "gpu") else 6
    assert len(by_bits[4]) == per_layer * LAYERS and len(by_bits[8]) == 1
    want = (0, 0) if flavour == "gpu" else levels  # CUDA's kernels: float activations only
    assert set(by_bits[4]) == {want[0]} and set(by_bits[8]) == {want[1]}


def test_without_the_second_take_block_products_run_on_8_bit_activations(tiny, tmp_path) -> None:
    """``int8_twice=False`` (an agent's activation_bits 8): each product on x alone, as one call
    of x's rows, and the logits off by more than the second take leaves, within int8's own error."""
    stored = tiny["q4"]
    spec = spec_of("cpu")
    path, _ = build(stored, stored.manifest, spec, tmp_path / "fragment", int8_twice=False)
    graph = onnx.load(path, load_external_data=False).graph
    made_by = {out: n for n in graph.node for out in n.output}
    products = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert products and not any(n.input[0] in made_by and made_by[n.input[0]].op_type == "Concat" for n in products)
    logits, _ = run(open_session(path), stored.manifest, spec, IDS)
    want = reference(stored.manifest, stored.weights, IDS)["logits"]
    assert_close(logits, want, "cpu", INT8_ONCE)
    assert np.abs(logits - want).max() > INT8_TWICE * max(1.0, float(np.abs(want).max()))


def test_small_4_bit_products_take_float_activations(tiny, tmp_path) -> None:
    """Below ``int8_min_weights`` weights a 4-bit product runs on float activations (its int8
    path's small ops would cost more than they save); 8-bit ones have no float kernel to take."""
    stored = tiny["q4"]
    m = stored.manifest
    qkv_weights = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim * m.hidden_size
    path, _ = build(stored, m, spec_of("cpu"), tmp_path / "fragment", q4_level=INT8_ACTIVATIONS,
                    q8_level=INT8_ACTIVATIONS, int8_min_weights=qkv_weights + 1)
    levels = {}
    for n in onnx.load(path, load_external_data=False).graph.node:
        if n.op_type == "MatMulNBits":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            large = attrs["bits"] == 8 or attrs["N"] * attrs["K"] > qkv_weights
            levels.setdefault((attrs["bits"], large), set()).add(attrs["accuracy_level"])
    assert levels == {(4, False): {0}, (4, True): {INT8_ACTIVATIONS}, (8, True): {INT8_ACTIVATIONS}}


# --- rotary tables ----------------------------------------------------------------------------------
def manifest(**fields) -> Manifest:
    """A manifest for rope_tables alone (its weight files are never read)."""
    file = WeightFile("weights/w.safetensors", 1, "0" * 64)
    base = dict(name="rope", architecture="llama", n_layers=1, hidden_size=64, intermediate_size=128, n_heads=2,
                n_kv_heads=1, head_dim=HEAD_DIM, vocab_size=32, rope_theta=10000.0, rms_norm_eps=1e-5,
                context_length=256, tied_embeddings=True, attention_bias=False, weight_format="f32",
                files={"embed": file, "head": file, layer_key(0): file}, source_digest="1" * 64)
    return Manifest(**(base | fields))


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
])
def test_rope_tables_turn_at_transformers_scaled_frequencies(rope) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=HEAD_DIM, max_position_embeddings=256,
                         rope_parameters=rope)
    inv_freq, attention = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
    factors = llama3_freq_factors(HEAD_DIM, rope["rope_theta"], rope) if rope["rope_type"] == "llama3" \
        else (rope["factor"],) * (HEAD_DIM // 2)  # as the importers read them
    cos, sin = rope_tables(manifest(rope_theta=rope["rope_theta"], rope_freq_factors=factors), 256)
    angles = np.arange(256)[:, None] * inv_freq.double().numpy()[None, :]
    assert attention == 1.0 and cos.shape == sin.shape == (256, HEAD_DIM // 2) and cos.dtype == np.float32
    np.testing.assert_allclose(cos, np.cos(angles), atol=2e-5, rtol=0)
    np.testing.assert_allclose(sin, np.sin(angles), atol=2e-5, rtol=0)


@_PROPS
@given(theta=st.floats(10.0, 1e6), half=st.sampled_from([8, 16]), scale=st.floats(0.5, 2.0),
       factors=st.lists(st.floats(0.25, 32.0), min_size=16, max_size=16), own=st.none() | st.floats(10.0, 1e5),
       sliding=st.booleans(), n=st.integers(1, 80))
def test_rope_tables_are_the_scaled_cos_and_sin_of_position_times_frequency(theta, half, scale, factors, own, sliding,
                                                                            n) -> None:
    width = 2 * half
    m = manifest(rope_theta=theta, rotary_dim=width if width < HEAD_DIM else 0, rope_freq_factors=factors[:half],
                 rotary_scale=scale, sliding_rope_theta=own)
    cos, sin = rope_tables(m, n, sliding=sliding)
    if sliding and own is not None:  # the sliding layers' own base: no factors, no scale
        inv, scale = own ** -(np.arange(0, width, 2) / width), 1.0
    else:
        inv = theta ** -(np.arange(0, width, 2) / width) / np.array(factors[:half])
    angles = np.arange(n)[:, None] * inv[None, :]
    assert cos.shape == sin.shape == (n, half) and cos.dtype == sin.dtype == np.float32
    np.testing.assert_allclose(cos, scale * np.cos(angles), atol=1e-6 * 64, rtol=0)
    np.testing.assert_allclose(sin, scale * np.sin(angles), atol=1e-6 * 64, rtol=0)


# --- weight files ------------------------------------------------------------------------------------
def external(model: onnx.ModelProto) -> dict[str, dict[str, str]]:
    """name -> external data fields of each initializer stored outside the graph."""
    return {t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL}


def read_back(t: onnx.TensorProto, folder: Path) -> np.ndarray:
    """An initializer's array, its external data read as onnxruntime reads it (raw bytes in C
    order; onnx's own loader refuses files with several hard links, as these are)."""
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return onnx.numpy_helper.to_array(t)
    fields = {e.key: e.value for e in t.external_data}
    raw = (folder / fields["location"]).read_bytes()[int(fields["offset"]):][:int(fields["length"])]
    return np.frombuffer(raw, onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).reshape(tuple(t.dims))


def test_weights_are_files_named_by_their_bytes_and_linked_from_the_pool(tiny, tmp_path) -> None:
    stored = tiny["f32"]
    path, weight_bytes = build(stored, stored.manifest, spec_of("cpu"), tmp_path / "a")
    model = onnx.load(path, load_external_data=False)
    files = external(model)
    assert files and weight_bytes == sum(int(f["length"]) for f in files.values())
    for name, fields in files.items():
        blob = path.parent / fields["location"]
        assert fields["offset"] == "0" and blob.stat().st_size == int(fields["length"])
        assert fields["location"] == hashlib.sha256(blob.read_bytes()).hexdigest() + ".bin", name
        assert blob.stat().st_ino == (tmp_path / "pool" / blob.stem).stat().st_ino  # one file, two names
    inline = [t for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    assert inline and all(onnx.numpy_helper.to_array(t).nbytes <= 1024 for t in inline)
    table = next(t for t in model.graph.initializer if t.name == "embed")
    np.testing.assert_array_equal(read_back(table, path.parent), stored.weights["model.embed_tokens.weight"])
    # another fragment sharing layer 1 links its blobs from the pool rather than writing them again
    other, _ = build(stored, stored.manifest, FragmentSpec(1, 1, "portable", 16, 0), tmp_path / "b")
    shared = {f["location"] for f in external(onnx.load(other, load_external_data=False)).values()} & {
        f["location"] for f in files.values()}
    assert shared  # layer 1's matrices
    for location in shared:
        assert (other.parent / location).stat().st_ino == (path.parent / location).stat().st_ino
        assert (tmp_path / "pool" / Path(location).stem).stat().st_nlink == 3


def test_one_array_under_two_names_is_one_file_and_a_name_is_registered_once(tmp_path) -> None:
    pool = tmp_path / "pool"
    pool.mkdir()
    g = _Graph(tmp_path, pool)
    big = np.arange(1024, dtype=np.float32).reshape(32, 32)
    assert g.const("a", big) == "a" and g.const("b", big.copy()) == "b" and g.const("a", big * 2) == "a"
    assert [t.name for t in g.inits] == ["a", "b"]
    assert len(list(tmp_path.glob("*.bin"))) == 1 and g.weight_bytes == 2 * big.nbytes


def test_a_pooled_blob_cut_short_is_written_again(tmp_path) -> None:
    pool = tmp_path / "pool"
    pool.mkdir()
    big = np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32)
    digest = hashlib.sha256(big.tobytes()).hexdigest()
    (pool / digest).write_bytes(big.tobytes()[:100])  # what a power loss left
    (tmp_path / "out").mkdir()
    _Graph(tmp_path / "out", pool).const("w", big)
    assert (tmp_path / "out" / f"{digest}.bin").read_bytes() == big.tobytes()
    assert (pool / digest).stat().st_ino == (tmp_path / "out" / f"{digest}.bin").stat().st_ino


def test_a_pool_that_cannot_link_still_gets_the_fragment_written(tmp_path, caplog) -> None:
    big = np.ones((64, 16), np.float32)
    with caplog.at_level(logging.DEBUG, logger="shards.graph.fragment_graph"):
        g = _Graph(tmp_path, tmp_path / "no-such-pool")
        g.const("w", big)
    location = next(e.value for e in g.inits[0].external_data if e.key == "location")
    assert (tmp_path / location).read_bytes() == big.tobytes()
    assert any("not pooled" in record.getMessage() for record in caplog.records)


_shapes = st.lists(st.integers(1, 40), min_size=0, max_size=3)


@_PROPS
@given(array=st.sampled_from([np.float32, np.float16, np.int64, np.uint8]).flatmap(
    lambda dtype: arrays(dtype, _shapes.map(tuple))), transpose=st.booleans())
def test_any_initializer_reads_back_as_the_array_it_was_given(array, transpose) -> None:
    """Small ones inline, big ones in a blob file; a transposed (non-contiguous) array in C
    order; a 0-d one stays 0-d."""
    array = array.T if transpose else array
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        (out / "pool").mkdir()
        g = _Graph(out, out / "pool")
        g.const("x", array)
        (t,) = g.inits
        assert (t.data_location == onnx.TensorProto.EXTERNAL) is (array.nbytes > 1024)
        back = read_back(t, out)
        assert back.dtype == array.dtype and back.shape == array.shape
        np.testing.assert_array_equal(back, array)
