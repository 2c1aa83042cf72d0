"""ONNX layer fragments of a stored model: the flavours, the cache and its keys.

A fragment holds layers [first, last]; the head fragment (first == 0) also holds the token
embedding, the tail fragment (last == n_layers - 1) the final norm and lm_head. Every fragment
computes its own prologue (positions from the past length, rotary tables, causal mask) from
its own inputs, so chains of any split give the same logits as the whole model.

Flavours (one logical model, several graphs):

- ``"cpu"``: dynamic shapes, fused ``com.microsoft`` ops (GroupQueryAttention with rotary,
  SkipSimplifiedLayerNormalization, MatMulNBits for q4), a KV cache written in place and
  batches of rows. Inputs ``input_ids`` int64 [B, T] or ``hidden_states`` float32
  [B, T, hidden], ``past_length`` int64 [B] (positions each row holds already) and
  ``past_key.L`` / ``past_value.L`` float32 [B, kv_heads, C, head_dim], a buffer of capacity
  C >= past_length + T; outputs ``logits`` [B, T, vocab] or ``hidden_states_out``, plus
  ``present_key.L`` / ``present_value.L`` [B, kv_heads, C, head_dim]. Bound (IOBinding) to
  the same buffer as the past, the present is that buffer with the T new positions written at
  past_length: nothing else is copied.
- ``"gpu"``: the "cpu" flavour's graph and contract in mixed precision, for CUDA (whose
  GroupQueryAttention kernel takes float16 only): weights, matrix products, attention and the
  KV buffers (float16 [B, kv_heads, C, head_dim]) are half precision; the residual stream and
  its norms stay float32 (as in llama.cpp), and so do ``hidden_states`` in and out and
  ``logits``, so its fragments chain with any other flavour's.
- ``"portable"``: plain opset-17 ops only (MatMulNBits stays for q4), for GPU providers that
  lack the fused float32 kernels: inputs as "cpu" but batch 1, no ``past_length`` and a past
  of exactly P positions; the present is a new [1, kv_heads, P + T, head_dim] tensor.
- ``"static"``: plain opset-17 ops and fixed shapes for NPUs: T == prefill_chunk, the KV
  inputs have max_context positions, plus ``past_length`` int64 [1]; outputs ``new_key.L`` /
  ``new_value.L`` [1, kv_heads, T, head_dim] (the caller writes them into its fixed cache).
  Rows past the valid length of a padded chunk are garbage and must be ignored.

Weights go to ONNX external data so no protobuf limit applies: one file per tensor, named by
its content hash and hard-linked from the cache's blob pool (``.blobs/``), so fragments that
share layers (standby ranges, re-plans, other flavours or context lengths) share their bytes
on disk. Blobs no fragment links to any more are removed when the cache is pruned.

The graphs themselves are emitted by :mod:`shards.graph.fragment_graph`, imported only to build one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from shards.errors import FragmentError, ModelFormatError
from shards.graph.spec import IR_VERSION, ONNX_FILE, FragmentSpec
from shards.store.manifest import Manifest
from shards.store.model_store import MANIFEST_FILE
from shards.store.verify import verify_weight_files

log = logging.getLogger(__name__)
BUILDER_VERSION = 17
FRAGMENTS_DIR = "fragments"  # the default cache, inside the model's directory
BLOB_POOL = ".blobs"
TMP_PREFIX = ".tmp-frag-"
# accuracy_level of MatMulNBits on CPU: 0 = float activations, 4 = int8 ones (per block of 32).
# 8-bit weights have no fast float kernel; 4-bit ones take int8 activations from
# INT8_MIN_WEIGHTS[activation_bits] weights per product, float ones below.
# activation_bits (an agent's setting): 8 (the default) takes each int8 product on x once, as
# llama.cpp does against its 4- and 8-bit blocks; 16 takes it on x and on what rounding x to int8
# left of it, the two as rows of one call (about 16 bits, the weights still read once per decode
# step), for twice the arithmetic where the rows cost more than the weights' reading (a prompt, a
# batch of decode steps). On an AVX2 core, where the int8 kernel runs 128 rows no faster than the
# float one (bench/q4_kernels.py), 8 reads the 1B shape's prompts and decodes its 8 streams about
# 2x as fast as 16.
# The threshold: with 16, the two takes add a dozen small ops per product, which cost more than
# the int8 kernel saves below 4M weights (a Zen 4 core, 2 threads: the 1B shape's products, 4.2M-
# 33.5M weights, decode 1.7x faster on int8 and read prompts 0.67x as fast, SmolLM2's, 0.3M-1.8M,
# decode 1.04x faster on float). With 8, an int8 product is the float one's call at another
# level, nothing added, so every 4-bit product takes it: on an AVX2 core SmolLM2's q4 store
# decodes 1.7-1.8x as fast so and reads prompts 0.8-0.9x as fast (still 1.6x llama.cpp's).
# In answers (bench/q4_precision.py, the packaged model's q4 store against its float store, 8
# questions, 32 greedy tokens word for word): 8 keeps 2 answers in 8 (4 with its small products
# on float), 16 keeps 8 in 8, llama.cpp on the same file keeps 2. See fragment_graph._Builder._linear_nbits.
Q4_ACCURACY_LEVEL = 4
Q8_ACCURACY_LEVEL = 4
ACTIVATION_BITS = (8, 16)  # the choices of activation_bits: int8 taken once (the default), twice
DEFAULT_ACTIVATION_BITS = ACTIVATION_BITS[0]
INT8_MIN_WEIGHTS = {8: 0, 16: 1 << 22}  # by activation_bits


def load_manifest(model_dir: Path) -> Manifest:
    """The manifest of a model directory (ModelFormatError if missing or bad)."""
    p = Path(model_dir) / MANIFEST_FILE
    if not p.is_file():
        raise ModelFormatError(f"{model_dir}: no {MANIFEST_FILE}")
    return Manifest.from_json(p.read_text(encoding="utf-8"))


def fragment_key(m: Manifest, spec: FragmentSpec, activation_bits: int, int8_min_weights: int) -> str:
    """Cache key: changes when the builder, the weights, the range, flavour, shapes or
    activations change."""
    doc = {
        "builder": BUILDER_VERSION, "ir": IR_VERSION, "q4_level": Q4_ACCURACY_LEVEL, "q8_level": Q8_ACCURACY_LEVEL,
        "int8_min_weights": int8_min_weights,
        "activation_bits": activation_bits,
        "model": m.to_dict() | {"files": None},
        "files": {k: m.files[k].sha256 for k in m.fragment_files(spec.first_layer, spec.last_layer)},
        "spec": [spec.first_layer, spec.last_layer, spec.flavour, spec.max_context, spec.prefill_chunk],
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def build_fragment(model_dir: Path, first_layer: int, last_layer: int, *, flavour: str = "cpu",
                   max_context: int | None = None, prefill_chunk: int | None = None,
                   cache_dir: Path | None = None, activation_bits: int = DEFAULT_ACTIVATION_BITS,
                   int8_min_weights: int | None = None) -> Path:
    """Build (or reuse from cache) the ONNX fragment for layers [first, last]; returns its path.

    The cache lives under ``cache_dir`` or ``<model_dir>/fragments/`` and is keyed by the
    model's weights, the range, the flavour, the shapes, ``activation_bits`` (8: block
    products on int8 activations take x once; 16: twice) and ``int8_min_weights`` (the least
    weights of a 4-bit product on int8 activations, :data:`INT8_MIN_WEIGHTS` of the bits when
    None; a draft model's fragments take 0); writes are atomic. A fragment is built only from weight
    files that match the manifest's sha256 (CorruptWeightsError if not).
    """
    if activation_bits not in ACTIVATION_BITS:
        raise FragmentError(f"activation_bits must be one of {ACTIVATION_BITS}, got {activation_bits!r}")
    min_weights = INT8_MIN_WEIGHTS[activation_bits] if int8_min_weights is None else int8_min_weights
    if not isinstance(min_weights, int) or isinstance(min_weights, bool) or min_weights < 0:
        raise FragmentError(f"int8_min_weights must be a whole number >= 0, got {int8_min_weights!r}")
    model_dir = Path(model_dir)
    m = load_manifest(model_dir)
    mc = int(max_context) if max_context is not None else m.context_length
    if flavour == "static":
        pc = int(prefill_chunk) if prefill_chunk is not None else min(64, mc)
    else:
        pc = 0
    spec = FragmentSpec(int(first_layer), int(last_layer), flavour, mc, pc)
    spec.validate(m)
    key = fragment_key(m, spec, activation_bits, min_weights)
    root = Path(cache_dir) if cache_dir is not None else model_dir / FRAGMENTS_DIR
    prefix = (f"{m.name}-{spec.first_layer:03d}-{spec.last_layer:03d}-{flavour}-c{mc}-p{pc}-a{activation_bits}-"
              f"i{min_weights}-")
    final = root / (prefix + key[:20])
    if (final / ONNX_FILE).is_file():
        return final / ONNX_FILE
    verify_weight_files(model_dir, m, m.fragment_files(spec.first_layer, spec.last_layer))
    (root / BLOB_POOL).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=root))
    try:
        from shards.graph.fragment_graph import write_fragment  # onnx: imported only to build

        weight_bytes = write_fragment(model_dir, m, spec, tmp, root / BLOB_POOL, q4_level=Q4_ACCURACY_LEVEL,
                                      q8_level=Q8_ACCURACY_LEVEL, int8_min_weights=min_weights,
                                      int8_twice=activation_bits == ACTIVATION_BITS[1])  # x, then what rounding left
        (tmp / "fragment.json").write_text(json.dumps({"key": key, "builder": BUILDER_VERSION,
                                                       "weight_bytes": weight_bytes, "spec": spec.__dict__,
                                                       "activation_bits": activation_bits,
                                                       "int8_min_weights": min_weights}),
                                           encoding="utf-8")
        try:
            os.replace(tmp, final)
        except OSError:  # another process built it first
            if not (final / ONNX_FILE).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        prune_blobs(root)
        raise
    # from older weights or builder; the other activations' builds have a prefix of their own
    stale = [p for p in root.glob(prefix + "*") if p != final]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    if stale:
        prune_blobs(root)
    log.info("built fragment %s", final.name)
    return final / ONNX_FILE


def prune_blobs(cache_dir: Path) -> int:
    """Remove pooled blobs that no fragment under ``cache_dir`` links to; returns bytes freed."""
    freed = 0
    pool = Path(cache_dir) / BLOB_POOL
    for blob in pool.glob("*") if pool.is_dir() else ():
        try:
            st = blob.stat()
            if st.st_nlink == 1:
                blob.unlink()
                freed += st.st_size
        except OSError:  # gone meanwhile, or not ours to delete: pruning is best effort
            continue
    return freed


def sweep_fragments(cache_dir: Path, *, now_s: float, tmp_age_s: float = 3600.0) -> int:
    """Delete what an upgrade or a crash left in a fragment cache: fragments of another builder
    version, and temporary build directories older than ``tmp_age_s`` (``now_s`` is a
    ``time.time()`` value); then prune the blobs. Returns how many directories went."""
    root = Path(cache_dir)
    removed = 0
    for path in root.iterdir() if root.is_dir() else ():
        if not path.is_dir() or path.name == BLOB_POOL:
            continue
        try:
            if path.name.startswith(TMP_PREFIX):
                doomed = now_s - path.stat().st_mtime > tmp_age_s
            else:
                info = json.loads((path / "fragment.json").read_text(encoding="utf-8"))
                doomed = info.get("builder") != BUILDER_VERSION
        except (OSError, ValueError, AttributeError):  # no or unreadable fragment.json: not ours to trust
            doomed = not path.name.startswith(TMP_PREFIX)
        if doomed:
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    if removed:
        prune_blobs(root)
    return removed
