"""What a checkpoint's tensor becomes in a store, and what a stored file becomes once loaded.

:func:`convert_tensors` turns canonical tensors (float32 arrays, or a GGUF file's blocks as
:class:`~shards.importers.gguf_blocks.QuantBlocks`) into the stored form of a weight format.
A ``mixed`` store keeps a linear weight (and the output layer) whose blocks become ncm's by a
byte shuffle (Q4_0, Q4_1 and Q4_K in 4 bits; Q8_0, Q5_0, Q6_K, Q5_K and Q5_1 in 8) as the file's blocks
themselves, under ``{name}.file_blocks.{type}`` (uint8 [rows, row bytes]): the store is the
file's size, the import a copy. :func:`loaded_tensors` turns them into ncm's blocks when a
fragment is built (what the import did before, the same values); :func:`loaded_nbytes` is
what they take then, for the planner (a Q4_K matrix, 4.5 bits per weight on disk, takes 6 in
ncm's 4-bit blocks; a Q6_K one, 6.56 on disk, and a Q5_K one, 5.5, take 9.25 in its 8-bit ones).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from shards.errors import ModelFormatError
from shards.importers.gguf_blocks import CARRIED, NEAREST, QuantBlocks, carry, finite_scales, nearest_eight_bit
from shards.importers.linear import is_linear
from shards.importers.quant import BLOCK, exact_q8, quantize_q4, quantize_q8, without_zero_offsets
from shards.store.manifest import BLOCK_FORMATS, Manifest
from shards.store.tensorfile import read_tensors

FILE_BLOCKS = "file_blocks"
_FILE_BLOCKS_KEY = re.compile(rf"(.+)\.{FILE_BLOCKS}\.(\w+)")
_EIGHT_BIT_SHUFFLED = (*CARRIED[8], *NEAREST)  # file blocks that become 8-bit ones without a float round trip
_LOADED_BLOCK_BYTES = {4: BLOCK // 2 + 4 + 4, 8: BLOCK + 4 + 1}  # codes, float32 scale, offset or zero point


def shares_table(params: dict[str, Any], weights: str, lm_head_bits: int = 8) -> bool:
    """Whether a store keeps its tied table once, in 8-bit blocks the embedding and the output
    layer both read (a block format with an 8-bit output layer)."""
    return bool(params["tied_embeddings"]) and weights in BLOCK_FORMATS and lm_head_bits == 8


def convert_tensors(tensors: dict[str, np.ndarray | QuantBlocks], weights: str, lm_head_bits: int = 8,
                    narrow: frozenset[str] = frozenset(), shared_table: bool = False,
                    file_blocks: bool = True) -> dict[str, np.ndarray]:
    """Canonical tensors -> the stored form for ``weights`` (pure); float32 arrays, or a GGUF
    file's blocks (:class:`QuantBlocks`, carried over as they are where the stored blocks hold
    them, dequantised otherwise); ``narrow``: the linear weights the source holds in at most 4
    bits (the 4-bit ones of a ``mixed`` store); ``shared_table``: the embedding is the output
    layer's too (:func:`shares_table`), in its 8 bits; ``file_blocks``: a ``mixed`` store keeps
    the blocks a load shuffles into ncm's as the file's (:func:`loaded_tensors`)."""
    out: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        if is_linear(name) or name == "lm_head":
            if weights in BLOCK_FORMATS:
                eight = (name == "lm_head" and lm_head_bits == 8) or (weights == "mixed" and is_linear(name)
                                                                       and name not in narrow)
                bits = 8 if eight else 4
                if file_blocks and weights == "mixed" and _shuffled(arr, bits):
                    if not finite_scales(arr):
                        raise ModelFormatError(f"{name} holds NaN or infinite scales")
                    out[f"{name}.{FILE_BLOCKS}.{arr.type_name}"] = arr.data
                    continue
                for part, val in _block_parts(name, arr, bits).items():
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
                values = _float(name, arr)  # (a file's blocks on a symmetric 8-bit grid were carried)
                exact = not isinstance(arr, QuantBlocks) and exact_q8(values)
                parts = quantize_q8(values) if shared_table or exact else None
            if parts is None:
                out[name] = values.astype(np.float16)
            else:
                out |= {f"{name}.{part}": val for part, val in parts.items()}
        elif name == "embed":
            out[name] = _float(name, arr).astype(np.float32 if weights == "f32" else np.float16)
        else:
            out[name] = _float(name, arr).astype(np.float32, copy=False)
    return out


def _shuffled(arr: np.ndarray | QuantBlocks, bits: int) -> bool:
    """Whether ``arr`` is file blocks that become ``bits``-bit ones of ncm's by a byte shuffle."""
    return (isinstance(arr, QuantBlocks) and arr.cols % BLOCK == 0
            and arr.type_name in (CARRIED[4] if bits == 4 else _EIGHT_BIT_SHUFFLED))


def _file_blocks(stored: dict[str, np.ndarray]) -> dict[str, QuantBlocks]:
    """The file blocks among a stored file's tensors, by tensor name."""
    out = {}
    for key, data in stored.items():
        match = _FILE_BLOCKS_KEY.fullmatch(key)
        if match:
            try:
                out[match.group(1)] = QuantBlocks.of_rows(match.group(2), data)
            except (KeyError, ValueError) as e:
                raise ModelFormatError(f"stored {key!r} is not a block type ncm loads ({e})") from e
    return out


def loaded_tensors(stored: dict[str, np.ndarray], weights: str) -> dict[str, np.ndarray]:
    """A stored file's tensors as fragments read them: file blocks become ncm's blocks (4-bit
    ones for the file's 4-bit types, 8-bit ones for the others), the rest as stored."""
    blocks = _file_blocks(stored)
    if not blocks:
        return stored
    out = {key: value for key, value in stored.items() if not _FILE_BLOCKS_KEY.fullmatch(key)}
    for name, arr in blocks.items():
        narrow = frozenset({name}) if arr.type_name in CARRIED[4] else frozenset()  # (lm_head: 8 bits)
        out |= convert_tensors({name: arr}, weights, narrow=narrow, file_blocks=False)
    return out


def loaded_nbytes(stored: dict[str, np.ndarray]) -> int:
    """Bytes of :func:`loaded_tensors` for ``stored``, without loading it (file blocks of 4-bit
    types counted with their offsets)."""
    total = 0
    for key, value in stored.items():
        match = _FILE_BLOCKS_KEY.fullmatch(key)
        if match:
            bits = 4 if match.group(2) in CARRIED[4] and match.group(1) != "lm_head" else 8
            blocks = QuantBlocks.of_rows(match.group(2), value)
            total += blocks.shape[0] * (blocks.cols // BLOCK) * _LOADED_BLOCK_BYTES[bits]
        else:
            total += value.nbytes
    return total


def load_stored(model_dir: Path, manifest: Manifest, key: str) -> dict[str, np.ndarray]:
    """The tensors of weight file ``key`` of a stored model, as fragments read them."""
    return loaded_tensors(read_tensors(Path(model_dir) / manifest.files[key].path), manifest.weight_format)


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
    return _finite(name, carry(arr, bits) if isinstance(arr, QuantBlocks) else None)


def _finite(name: str, parts: dict[str, np.ndarray] | None) -> dict[str, np.ndarray] | None:
    if parts is not None and not all(np.isfinite(v).all() for v in parts.values() if v.dtype.kind == "f"):
        raise ModelFormatError(f"{name} holds NaN or infinite scales")
    return parts


def _block_parts(name: str, arr: np.ndarray | QuantBlocks, bits: int) -> dict[str, np.ndarray]:
    """``bits``-bit stored blocks: the file's own where they fit, else quantised from float32."""
    parts = _carried(name, arr, bits)
    if parts is None and bits == 8 and isinstance(arr, QuantBlocks):
        parts = _finite(name, nearest_eight_bit(arr))
    if parts is None:
        parts = (quantize_q8 if bits == 8 else quantize_q4)(_float(name, arr))
    return without_zero_offsets(parts)


__all__ = ["convert_tensors", "shares_table", "loaded_tensors", "loaded_nbytes", "load_stored", "FILE_BLOCKS"]
