"""Import a GGUF file or a Hugging Face folder into the model store.

Weights are stored per layer (``weights/layer_NNN.safetensors``) plus ``weights/embed`` and
``weights/head``, in one of three formats:

- ``f32``: float32 everywhere.
- ``f16``: float16 linear weights and embeddings (norms and biases stay float32); fragments
  cast them to float32 when built, so compute is float32 and only disk/transfer size halves.
- ``q4``: the layers' linear weights as 4-bit blocks for ``MatMulNBits`` (see
  :mod:`shards.importers.quant`), quantised from the dequantised float32 weights; lm_head as 8-bit
  blocks (the logits are the most sensitive matrix), or 4-bit ones when asked
  (``lm_head_bits=4``: fewer bytes read per token, logits a little further from the source);
  the embedding table as float16, or as 8-bit blocks when they hold it exactly (a GGUF Q8_0
  table, whose values float16 would round).
- ``mixed``: as ``q4``, with each linear weight in the blocks that keep the source's own
  precision: 4-bit ones for a tensor the GGUF file holds in at most 4 bits per weight (Q4_0,
  Q4_1, Q4_K, Q3_K...), 8-bit ones for the others (Q5_0, Q6_K, Q8_0, float): about the file's
  size, nearly its precision. ``auto`` (``ncm import``'s default) picks it for a quantised GGUF
  file, ``f32`` for float checkpoints.

In the block formats a GGUF file's blocks that the stored ones hold as they are (Q4_0, Q4_1,
Q4_K in 4 bits; Q8_0, Q5_0 in 8) are carried over byte to byte (:mod:`shards.importers.gguf_blocks`),
the others dequantised and quantised again.

Every tensor of the checkpoint is used or the import is refused (UnmappedTensorError, naming
them): a tensor the importer does not map would be a weight silently dropped. Each source
names the few harmless extras it skips in an explicit, documented list.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tqdm import tqdm

from shards.errors import ModelFormatError, UnmappedTensorError
from shards.importers.gguf_blocks import QuantBlocks, carry
from shards.importers.linear import EXPERT_LINEAR, is_linear
from shards.importers.quant import exact_q8, quantize_q4, quantize_q8, without_zero_offsets
from shards.store.manifest import AUTO_WEIGHTS, BLOCK_FORMATS, WEIGHT_FORMATS, Manifest, WeightFile, layer_key
from shards.store.model_store import ModelStore
from shards.store.tensorfile import write_tensors
from shards.store.verify import hash_file

log = logging.getLogger(__name__)
WEIGHTS_DIR = "weights"


class ModelSource(Protocol):
    """What the importer needs from a checkpoint (GgufSource, HfSource): float32 tensors in
    the Hugging Face layout (linear weights [out, in]) under ncm's canonical names."""

    params: dict[str, Any]  # Manifest fields describing the model's shape
    consumed: set[str]  # checkpoint names of the tensors read so far

    def tensor_names(self) -> set[str]: ...  # every tensor the checkpoint holds

    def planned_names(self) -> set[str]: ...  # those layer()/embed()/head() will read, per params

    def ignored_names(self) -> set[str]: ...  # those on the source's documented harmless list

    # blocks: a GGUF file's quantised matrices as its blocks (QuantBlocks), not float32
    def layer(self, i: int, blocks: bool = False) -> dict[str, np.ndarray | QuantBlocks]: ...

    def embed(self, blocks: bool = False) -> np.ndarray | QuantBlocks: ...

    def head(self, blocks: bool = False) -> dict[str, np.ndarray | QuantBlocks]: ...  # {"norm", "lm_head"}

    def tokenizer_spec(self) -> Any: ...

    def digest(self) -> str: ...

    def narrow_tensors(self, i: int) -> frozenset[str]: ...  # layer i's linear weights held in <= 4 bits

    def quantised(self) -> bool: ...  # whether the checkpoint holds its linear weights in quantised blocks


def open_source(path: Path) -> ModelSource:
    """A GgufSource or HfSource for ``path`` (ModelFormatError if it is neither)."""
    path = Path(path)
    if path.is_dir():
        from shards.importers.hf import HfSource

        return HfSource(path)
    if path.is_file():
        from shards.importers.gguf import GgufSource

        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelFormatError(f"{path.name}: not a GGUF file (bad magic) nor a model folder")
        return GgufSource(path)
    raise ModelFormatError(f"{path}: no such file or folder")


def auto_weights(src: ModelSource) -> str:
    """The store format of ``weights="auto"`` (``ncm import``'s default): ``mixed`` for a
    quantised GGUF file (about the file's size and precision, its blocks carried over), ``f32``
    for float checkpoints (Hugging Face folders, F32/F16/BF16 GGUF files)."""
    return "mixed" if src.quantised() else "f32"


def default_name(path: Path) -> str:
    """Model name derived from a file or folder name."""
    stem = Path(path).name
    if stem.lower().endswith(".gguf"):
        stem = stem[:-5]
    clean = "".join(c if c.isalnum() or c in "._-" else "-" for c in stem).strip("-.") or "model"
    return clean.lower()[:100]


def shares_table(params: dict[str, Any], weights: str, lm_head_bits: int = 8) -> bool:
    """Whether a store keeps its tied table once, in 8-bit blocks the embedding and the output
    layer both read (a block format with an 8-bit output layer)."""
    return bool(params["tied_embeddings"]) and weights in BLOCK_FORMATS and lm_head_bits == 8


def convert_tensors(tensors: dict[str, np.ndarray | QuantBlocks], weights: str, lm_head_bits: int = 8,
                    narrow: frozenset[str] = frozenset(), shared_table: bool = False) -> dict[str, np.ndarray]:
    """Canonical tensors -> the stored form for ``weights`` (pure); float32 arrays, or a GGUF
    file's blocks (:class:`QuantBlocks`, carried over as they are where the stored blocks hold
    them, dequantised otherwise); ``narrow``: the linear weights the source holds in at most 4
    bits (the 4-bit ones of a ``mixed`` store); ``shared_table``: the embedding is the output
    layer's too (:func:`shares_table`), in its 8 bits."""
    out: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        if is_linear(name) or name == "lm_head":
            if weights in BLOCK_FORMATS:
                eight = (name == "lm_head" and lm_head_bits == 8) or (weights == "mixed" and is_linear(name)
                                                                       and name not in narrow)
                for part, val in _block_parts(name, arr, 8 if eight else 4).items():
                    out[f"{name}.{part}"] = val
            elif weights == "f16":
                out[name] = _float(name, arr).astype(np.float16)
            else:
                out[name] = _float(name, arr).astype(np.float32, copy=False)
        elif name == "embed" and weights in BLOCK_FORMATS:
            # 8-bit blocks: the file's own where they fit it as it is, a GGUF Q8_0 table's own
            # grid (where float16 would round its values), or the output layer's 8 bits
            parts = _carried(name, arr, 8)
            if parts is None:
                values = _float(name, arr)
                parts = quantize_q8(values) if shared_table or exact_q8(values) else None
            if parts is None:
                out[name] = values.astype(np.float16)
            else:
                out |= {f"{name}.{part}": val for part, val in parts.items()}
        elif name == "embed":
            out[name] = _float(name, arr).astype(np.float32 if weights == "f32" else np.float16)
        else:
            out[name] = _float(name, arr).astype(np.float32, copy=False)
    return out


def _float(name: str, arr: np.ndarray | QuantBlocks) -> np.ndarray:
    """Float32 values of a tensor (a file's blocks dequantised, checked finite)."""
    if not isinstance(arr, QuantBlocks):
        return arr
    values = arr.to_float()
    if not np.isfinite(values).all():
        raise ModelFormatError(f"{name} holds NaN or infinite values")
    return values


def _carried(name: str, arr: np.ndarray | QuantBlocks, bits: int) -> dict[str, np.ndarray] | None:
    """A file's blocks as ``bits``-bit stored ones, where those hold them as they are."""
    parts = carry(arr, bits) if isinstance(arr, QuantBlocks) else None
    if parts is not None and not all(np.isfinite(v).all() for v in parts.values() if v.dtype.kind == "f"):
        raise ModelFormatError(f"{name} holds NaN or infinite scales")
    return parts


def _block_parts(name: str, arr: np.ndarray | QuantBlocks, bits: int) -> dict[str, np.ndarray]:
    """``bits``-bit stored blocks: the file's own where they fit, else quantised from float32."""
    parts = _carried(name, arr, bits)
    if parts is None:
        parts = (quantize_q8 if bits == 8 else quantize_q4)(_float(name, arr))
    return without_zero_offsets(parts)


def _write(model_dir: Path, rel: str, tensors: dict[str, np.ndarray]) -> WeightFile:
    path = model_dir / rel
    write_tensors(path, tensors)
    return WeightFile(path=rel, bytes=path.stat().st_size, sha256=hash_file(path).hexdigest())


def _check_layer(src_params: dict[str, Any], i: int, t: dict[str, np.ndarray]) -> None:
    h, f = src_params["hidden_size"], src_params["intermediate_size"]
    q = src_params["n_heads"] * src_params["head_dim"]
    kv = src_params["n_kv_heads"] * src_params["head_dim"]
    want = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f),
            "input_norm": (h,), "post_norm": (h,), "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,),
            "o_bias": (h,), "gate_bias": (f,), "up_bias": (f,), "down_bias": (h,),
            "q_norm": (q if src_params.get("qk_norm_whole") else src_params["head_dim"],),
            "k_norm": (kv if src_params.get("qk_norm_whole") else src_params["head_dim"],),
            "attn_out_norm": (h,), "mlp_out_norm": (h,)}
    fe, fs = src_params.get("expert_intermediate_size", 0), src_params.get("shared_expert_intermediate_size", 0)
    want |= {"router": (src_params.get("n_experts", 0), h), "shared_expert_gate": (1, h)}
    for name, arr in t.items():
        expert = EXPERT_LINEAR.fullmatch(name)
        if expert:
            width = fs if name.startswith("shared_expert.") else fe
            want[name] = (h, width) if expert.group(1) == "down_proj" else (width, h)
        if tuple(arr.shape) != want[name]:
            raise ModelFormatError(f"layer {i}: {name} has shape {arr.shape}, expected {want[name]}")
        if not isinstance(arr, QuantBlocks) and not np.isfinite(arr).all():  # (blocks: when converted)
            raise ModelFormatError(f"layer {i}: {name} holds NaN or infinite values")


def refuse_unused(source: str, unused: Iterable[str], shown: int = 5) -> None:
    """UnmappedTensorError naming the first ``shown`` of ``unused`` (then a count), if any."""
    names = sorted(unused)
    if names:
        more = f" and {len(names) - shown} more" if len(names) > shown else ""
        plural = "tensor" if len(names) == 1 else "tensors"
        raise UnmappedTensorError(f"{source}: {len(names)} {plural} the importer does not map (importing would "
                                  f"drop them): {', '.join(names[:shown])}{more}", names)


def _estimated_bytes(embed_bytes: int, layer_bytes: int, n_layers: int, shared_table: bool) -> int:
    """Expected size of an import's weight files, for the progress bar: every layer like the
    first, and the head (lm_head has the embedding's shape) like the embedding, unless it
    shares the embedding's table."""
    return (1 if shared_table else 2) * embed_bytes + n_layers * layer_bytes


def import_model(path: Path | str, *, name: str | None = None, weights: str = "f32",
                 store: ModelStore | None = None, progress: bool = True, lm_head_bits: int = 8) -> Manifest:
    """Import a GGUF file or HF folder as model ``name``; returns its manifest.
    ``weights``: a format of WEIGHT_FORMATS, or ``"auto"`` (:func:`auto_weights`).
    ``lm_head_bits``: 8, or 4 for a 4-bit lm_head (q4 weights only).

    Raises UnsupportedArchitectureError, UnmappedTensorError (a tensor the import would not
    use), ModelFormatError or TokenizerError; on any error nothing is left in the store.
    """
    if weights not in (*WEIGHT_FORMATS, AUTO_WEIGHTS):
        raise ModelFormatError(f"unknown weight format {weights!r} (use one of {', '.join(WEIGHT_FORMATS)} "
                               f"or {AUTO_WEIGHTS})")
    store = store or ModelStore()
    path = Path(path)
    src = open_source(path)
    weights = auto_weights(src) if weights == AUTO_WEIGHTS else weights
    if lm_head_bits not in (4, 8) or (lm_head_bits != 8 and weights not in BLOCK_FORMATS):
        raise ModelFormatError(f"lm_head_bits must be 8, or 4 with q4 weights; got {lm_head_bits} with {weights}")
    everything, ignored = src.tensor_names(), src.ignored_names()
    refuse_unused(path.name, everything - src.planned_names() - ignored)  # before any work
    name = name or default_name(path)
    spec = src.tokenizer_spec()  # TokenizerError before anything is written
    params = dict(src.params)
    n = params["n_layers"]
    from shards.text.tokenizer_spec import save_tokenizer_spec

    with store.staging(name) as tmp:
        (tmp / WEIGHTS_DIR).mkdir()
        files: dict[str, WeightFile] = {}
        # Bytes written; the total is estimated once the first layer is written (layers are
        # alike) and set exactly at the end.
        bar = tqdm(desc=f"import {name}", unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)
        try:
            blocks = weights in BLOCK_FORMATS  # a GGUF file's blocks, carried over where they fit
            emb = src.embed(blocks=blocks)
            if emb.shape != (params["vocab_size"], params["hidden_size"]):
                raise ModelFormatError(f"embedding has shape {emb.shape}, expected "
                                       f"({params['vocab_size']}, {params['hidden_size']})")
            shared = shares_table(params, weights, lm_head_bits)
            files["embed"] = _write(tmp, f"{WEIGHTS_DIR}/embed.safetensors",
                                    convert_tensors({"embed": emb}, weights, shared_table=shared))
            del emb
            bar.update(files["embed"].bytes)
            for i in range(n):
                t = src.layer(i, blocks=blocks)
                _check_layer(params, i, t)
                files[layer_key(i)] = _write(tmp, f"{WEIGHTS_DIR}/layer_{i:03d}.safetensors",
                                             convert_tensors(t, weights, narrow=src.narrow_tensors(i)))
                if i == 0:
                    bar.total = _estimated_bytes(files["embed"].bytes, files[layer_key(0)].bytes, n, shared)
                bar.update(files[layer_key(i)].bytes)
            head = src.head(blocks=blocks)
            if head["lm_head"].shape != (params["vocab_size"], params["hidden_size"]):
                raise ModelFormatError(f"lm_head has shape {head['lm_head'].shape}")
            if shared:  # the embed file's table is the output layer's
                del head["lm_head"]
            files["head"] = _write(tmp, f"{WEIGHTS_DIR}/head.safetensors", convert_tensors(head, weights, lm_head_bits))
            bar.update(files["head"].bytes)
            bar.total = bar.n
            refuse_unused(path.name, everything - src.consumed - ignored)  # what was actually read
        finally:
            bar.close()
        save_tokenizer_spec(spec, tmp)
        manifest = Manifest(name=name, weight_format=weights, files=files, source_digest=src.digest(),
                            source=path.name, shared_table=shared, **params)
        store.write_manifest(tmp, manifest)
    log.info("imported %s (%s, %d layers, %s)", name, params["architecture"], n, weights)
    return manifest


__all__ = ["import_model", "open_source", "convert_tensors", "default_name", "refuse_unused", "auto_weights"]
