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
Q6_K, Q5_K and Q5_1 ones moved to 8-bit blocks straight from their codes, the others dequantised and quantised
again. A ``mixed`` store keeps those carried blocks as the file holds them, shuffled into ncm's
when a fragment is built (:mod:`shards.importers.stored_form`): the store is about the file's
size and the import about a copy. Each file is written by a thread of its own while another
hashes the same bytes from memory and the next file is converted; a third hashes the source.

Every tensor of the checkpoint is used or the import is refused (UnmappedTensorError, naming
them): a tensor the importer does not map would be a weight silently dropped. Each source
names the few harmless extras it skips in an explicit, documented list.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tqdm import tqdm

from shards.errors import ModelFormatError, UnmappedTensorError
from shards.importers.gguf_blocks import QuantBlocks
from shards.importers.linear import EXPERT_LINEAR
from shards.importers.stored_form import convert_tensors, loaded_nbytes, shares_table
from shards.store.manifest import AUTO_WEIGHTS, BLOCK_FORMATS, WEIGHT_FORMATS, Manifest, WeightFile, layer_key
from shards.store.model_store import ModelStore
from shards.store.tensorfile import file_chunks, write_chunks
from shards.store.verify import hash_chunks

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


class _Writes:
    """The import's weight files, each written by ``pool`` while another of its threads hashes
    the same bytes from memory and the caller converts the next one: one file in flight, so one
    more file's tensors in memory at most."""

    def __init__(self, pool: ThreadPoolExecutor, model_dir: Path, bar: tqdm) -> None:
        self.files: dict[str, WeightFile] = {}
        self._pool, self._model_dir, self._bar = pool, model_dir, bar
        self._pending: tuple[str, str, int, Future[None], Future[Any]] | None = None

    def submit(self, key: str, rel: str, tensors: dict[str, np.ndarray]) -> None:
        self.wait()
        chunks = file_chunks(tensors)
        grown = loaded_nbytes(tensors) - sum(v.nbytes for v in tensors.values())  # file blocks, once loaded
        self._pending = (key, rel, grown, self._pool.submit(write_chunks, self._model_dir / rel, chunks),
                         self._pool.submit(hash_chunks, chunks))

    def wait(self) -> None:
        """The file in flight, written and hashed (an error of either raised here) and counted."""
        if self._pending is None:
            return
        key, rel, grown, written, hashed = self._pending
        self._pending = None
        digest = hashed.result().hexdigest()
        written.result()
        size = (self._model_dir / rel).stat().st_size
        self.files[key] = WeightFile(path=rel, bytes=size, sha256=digest, memory_bytes=size + grown if grown else 0)
        self._bar.update(size)


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

    # three threads: the source's digest from the start, and each file's write and hash
    with store.staging(name) as tmp, ThreadPoolExecutor(3, thread_name_prefix="ncm-import") as pool:
        source_digest = pool.submit(src.digest)
        (tmp / WEIGHTS_DIR).mkdir()
        # Bytes written; the total is estimated once the first layer is written (layers are
        # alike) and set exactly at the end.
        bar = tqdm(desc=f"import {name}", unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)
        writes = _Writes(pool, tmp, bar)
        try:
            blocks = weights in BLOCK_FORMATS  # a GGUF file's blocks, carried over where they fit
            emb = src.embed(blocks=blocks)
            if emb.shape != (params["vocab_size"], params["hidden_size"]):
                raise ModelFormatError(f"embedding has shape {emb.shape}, expected "
                                       f"({params['vocab_size']}, {params['hidden_size']})")
            shared = shares_table(params, weights, lm_head_bits)
            writes.submit("embed", f"{WEIGHTS_DIR}/embed.safetensors",
                          convert_tensors({"embed": emb}, weights, shared_table=shared))
            del emb
            for i in range(n):
                t = src.layer(i, blocks=blocks)
                _check_layer(params, i, t)
                writes.submit(layer_key(i), f"{WEIGHTS_DIR}/layer_{i:03d}.safetensors",
                              convert_tensors(t, weights, narrow=src.narrow_tensors(i)))
                del t
                if i == 1:
                    bar.total = _estimated_bytes(writes.files["embed"].bytes, writes.files[layer_key(0)].bytes, n,
                                                 shared)
            head = src.head(blocks=blocks)
            if head["lm_head"].shape != (params["vocab_size"], params["hidden_size"]):
                raise ModelFormatError(f"lm_head has shape {head['lm_head'].shape}")
            if shared:  # the embed file's table is the output layer's
                del head["lm_head"]
            writes.submit("head", f"{WEIGHTS_DIR}/head.safetensors", convert_tensors(head, weights, lm_head_bits))
            writes.wait()
            bar.total = bar.n
            refuse_unused(path.name, everything - src.consumed - ignored)  # what was actually read
        finally:
            bar.close()
        files = writes.files
        save_tokenizer_spec(spec, tmp)
        manifest = Manifest(name=name, weight_format=weights, files=files, source_digest=source_digest.result(),
                            source=path.name, shared_table=shared, **params)
        store.write_manifest(tmp, manifest)
    log.info("imported %s (%s, %d layers, %s)", name, params["architecture"], n, weights)
    return manifest


__all__ = ["import_model", "open_source", "convert_tensors", "default_name", "refuse_unused", "auto_weights"]
