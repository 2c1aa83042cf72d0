"""A GGUF file's quantised blocks carried over into ncm's ``MatMulNBits`` blocks as they are.

A quantised tensor of a GGUF file is rows of blocks, each a few float16 scales and integer
codes. Where ncm's block format (:mod:`shards.importers.quant`, 32 weights per block) can hold
a block type's grid, the codes and scales are moved over directly, with no float round trip and
no search for the grid: the stored weights are the file's, scales and mins as the file has them,
at the speed of a byte shuffle.

- 4-bit blocks (``W = (code - 8) * scale + offset``): Q4_0 (``d * (q - 8)``: the offset is
  zero), Q4_1 (``d * q + m``) and Q4_K (``d * sc * q - dmin * m`` per 32 weights of a
  256-weight super-block, 6-bit ``sc`` and ``m``).
- 8-bit blocks (``W = (code - zero) * scale``): Q8_0 (``d * q``, zero 128), Q5_0
  (``d * (q - 16)``, zero 16) and Q4_0 (zero 8).

Other types (Q5_1, Q5_K, Q6_K, the 2- and 3-bit ones, the IQ ones...) and other widths come back
as float32 (:meth:`QuantBlocks.to_float`) for the importer to quantise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shards.importers.quant import BLOCK, Q4_ZERO, Q8_ZERO

_F16 = np.dtype("<f2")
# bytes per block of each type carried over (per super-block for Q4_K)
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q8_0": 34, "Q5_0": 22}
CARRIED = {4: ("Q4_0", "Q4_1", "Q4_K"), 8: ("Q8_0", "Q5_0", "Q4_0")}


@dataclass(frozen=True)
class QuantBlocks:
    """A quantised matrix as the file holds it: ``data`` uint8 [rows, row bytes] of blocks of
    ``type_name`` (a ``gguf.GGMLQuantizationType`` name), ``cols`` weights per row. Row-wise
    numpy operations (slicing experts, splitting fused rows, permuting rotary rows) apply to
    ``data`` as they would to the float matrix."""

    type_name: str
    data: np.ndarray
    cols: int

    def __post_init__(self) -> None:
        if self.data.dtype != np.uint8 or self.data.ndim != 2:
            raise ValueError(f"QuantBlocks data must be uint8 [rows, bytes], got {self.data.dtype} {self.data.shape}")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[0]), self.cols)

    def to_float(self) -> np.ndarray:
        """Float32 [rows, cols] (gguf's own dequantisation)."""
        import gguf

        qtype = gguf.GGMLQuantizationType[self.type_name]
        return np.asarray(gguf.quants.dequantize(self.data, qtype), dtype=np.float32).reshape(self.shape)


def carry(blocks: QuantBlocks, bits: int) -> dict[str, np.ndarray] | None:
    """The stored parts of ``bits``-bit blocks holding ``blocks`` exactly (the keys of
    :func:`shards.importers.quant.quantize_q4` / ``quantize_q8``), or None when that width
    cannot hold its type as it is."""
    if blocks.type_name not in CARRIED.get(bits, ()) or blocks.cols % BLOCK:
        return None
    size = BLOCK_BYTES[blocks.type_name]
    if blocks.data.size % size:
        return None
    rows = blocks.shape[0]
    raw = np.ascontiguousarray(blocks.data).reshape(-1, size)
    if blocks.type_name == "Q4_K":
        return _four_bit(*_q4_k(raw), rows)
    d = raw[:, :2].copy().view(_F16)[:, 0].astype(np.float32)
    if blocks.type_name == "Q8_0":
        codes = raw[:, 2:] ^ np.uint8(Q8_ZERO)  # int8 q as uint8 q + 128: its sign bit flipped
        return _eight_bit(codes, d, Q8_ZERO, rows)
    if blocks.type_name == "Q5_0":
        high = raw[:, 2:6].copy().view("<u4")[:, 0]
        bit = ((high[:, None] >> np.arange(BLOCK, dtype=np.uint32)) & 1).astype(np.uint8)
        return _eight_bit(_nibbles(raw[:, 6:]) | (bit << 4), d, 16, rows)
    if blocks.type_name == "Q4_1":
        m = raw[:, 2:4].copy().view(_F16)[:, 0].astype(np.float32)
        return _four_bit(_repacked(raw[:, 4:]), d, m + np.float32(Q4_ZERO) * d, rows)
    if bits == 8:  # Q4_0
        return _eight_bit(_nibbles(raw[:, 2:]), d, Q4_ZERO, rows)
    return _four_bit(_repacked(raw[:, 2:]), d, np.zeros_like(d), rows)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes of a 32-weight block -> codes [n, 32]: weights 0-15 in the low nibbles,
    16-31 in the high ones (the layout of Q4_0, Q4_1 and Q5_0)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _repack_tables() -> tuple[np.ndarray, np.ndarray]:
    """For each pair of bytes (2j, 2j + 1) of a block's 16, read as one little-endian uint16:
    ncm's byte j (their low nibbles: weights 2j, 2j + 1) and byte j + 8 (their high nibbles:
    weights 2j + 16, 2j + 17)."""
    pair = np.arange(1 << 16, dtype=np.uint32)
    first, second = pair & 0xFF, pair >> 8
    return (((first & 0x0F) | ((second & 0x0F) << 4)).astype(np.uint8),
            ((first >> 4) | (second & 0xF0)).astype(np.uint8))


_LOW_NIBBLES, _HIGH_NIBBLES = _repack_tables()


def _repacked(qs: np.ndarray) -> np.ndarray:
    """The same [n, 16] bytes in ncm's order (weights 2j and 2j + 1 in byte j, low nibble
    first): two table lookups per pair of bytes."""
    pairs = np.ascontiguousarray(qs).view("<u2")
    out = np.empty((qs.shape[0], BLOCK // 2), np.uint8)
    out[:, :BLOCK // 4] = _LOW_NIBBLES[pairs]
    out[:, BLOCK // 4:] = _HIGH_NIBBLES[pairs]
    return out


def _q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [n, 144] -> ncm's packed codes [n * 8, 16], scales and offsets [n * 8]."""
    n = raw.shape[0]
    d = raw[:, 0:2].copy().view(_F16).astype(np.float32)  # [n, 1]
    dmin = raw[:, 2:4].copy().view(_F16).astype(np.float32)
    packed = raw[:, 4:16].reshape(n, 3, 4)  # 6-bit scales and mins of the 8 sub-blocks
    low, mid, high = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)], axis=1).astype(np.float32)
    mins = np.concatenate([mid & 0x3F, (high >> 4) | ((mid >> 2) & 0x30)], axis=1).astype(np.float32)
    qs = raw[:, 16:].reshape(n, 4, 1, 32)  # 4 chunks of 32 bytes: sub-block 2c low nibbles, 2c + 1 high
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n * 8, BLOCK)
    scale = (d * sc).reshape(-1)
    offset = (np.float32(Q4_ZERO) * scale - (dmin * mins).reshape(-1)).astype(np.float32)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)), scale, offset


def _four_bit(packed: np.ndarray, scale: np.ndarray, offset: np.ndarray, rows: int) -> dict[str, np.ndarray]:
    return {"qweight": packed.reshape(rows, -1, BLOCK // 2), "scales": scale.reshape(rows, -1),
            "offsets": offset.reshape(rows, -1)}


def _eight_bit(codes: np.ndarray, scale: np.ndarray, zero: int, rows: int) -> dict[str, np.ndarray]:
    return {"qweight": codes.astype(np.uint8, copy=False).reshape(rows, -1, BLOCK),
            "scales": scale.reshape(rows, -1), "zeros": np.full((rows, scale.size // rows), zero, np.uint8)}


__all__ = ["QuantBlocks", "carry", "CARRIED"]
