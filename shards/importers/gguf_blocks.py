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

Q6_K (``d * sc * (q - 32)``, an int8 ``sc`` per 16 weights) does not fit one 8-bit scale per
32 weights as it is: :func:`nearest_eight_bit` moves each pair of its sub-blocks into one 8-bit
block, exactly where the two scales share a grid of 256 codes, else spread over 256 codes (a step
at most 64/255 of the file's coarser one), straight from its codes. Q5_K (``d * sc * q - dmin *
m`` per 32 weights) and Q5_1 (``d * q + m``) likewise: exact where ``m`` is a whole number of
steps, else spread.

Other types (the 2- and 3-bit ones, the IQ ones...) and other widths come back as
float32 (:meth:`QuantBlocks.to_float`) for the importer to quantise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shards.importers.quant import BLOCK, Q4_ZERO, Q8_ZERO

_F16 = np.dtype("<f2")
_Q6_K_HIGH_SHIFTS = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)  # qh's 2-bit fields, per run of 32
_Q5_K_HIGH_SHIFTS = np.arange(8, dtype=np.uint8).reshape(1, 4, 2, 1)  # qh's bit of sub-block 2c + h
# bytes and weights per block of each type carried over (per super-block for the K-quants)
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q8_0": 34, "Q5_0": 22, "Q6_K": 210, "Q5_K": 176, "Q5_1": 24}
BLOCK_WEIGHTS = {"Q4_0": BLOCK, "Q4_1": BLOCK, "Q4_K": 256, "Q8_0": BLOCK, "Q5_0": BLOCK, "Q6_K": 256, "Q5_K": 256,
                 "Q5_1": BLOCK}
CARRIED = {4: ("Q4_0", "Q4_1", "Q4_K"), 8: ("Q8_0", "Q5_0", "Q4_0")}
# byte offsets of each block type's float16 scales (d; and m, dmin for Q4_1, Q4_K) in its block
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q6_K": (208,),
                 "Q5_K": (0, 2), "Q5_1": (0, 2)}
NEAREST = ("Q6_K", "Q5_K", "Q5_1")  # the types nearest_eight_bit moves
SLICE_SUPER_BLOCKS = 2048  # K-quant super-blocks converted at a time: temporaries that stay in cache


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

    @classmethod
    def of_rows(cls, type_name: str, data: np.ndarray) -> "QuantBlocks":
        """Blocks of a type of :data:`BLOCK_BYTES` from their rows of bytes alone (the width follows)."""
        size = BLOCK_BYTES[type_name]
        if data.ndim != 2 or data.shape[1] % size:
            raise ValueError(f"{type_name} rows must be whole blocks of {size} bytes, got {data.shape}")
        return cls(type_name, data, data.shape[1] // size * BLOCK_WEIGHTS[type_name])

    def to_float(self) -> np.ndarray:
        """Float32 [rows, cols] (gguf's own dequantisation)."""
        import gguf

        qtype = gguf.GGMLQuantizationType[self.type_name]
        return np.asarray(gguf.quants.dequantize(self.data, qtype), dtype=np.float32).reshape(self.shape)


def finite_scales(blocks: QuantBlocks) -> bool:
    """Whether every float16 scale of ``blocks`` (a type of :data:`SCALE_OFFSETS`) is finite."""
    raw = np.ascontiguousarray(blocks.data).reshape(-1, BLOCK_BYTES[blocks.type_name])
    return all(np.isfinite(raw[:, at:at + 2].copy().view(_F16)).all() for at in SCALE_OFFSETS[blocks.type_name])


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
        return _four_bit(*_sliced(_q4_k, raw), rows)
    d = raw[:, :2].copy().view(_F16)[:, 0].astype(np.float32)
    if blocks.type_name == "Q8_0":
        codes = raw[:, 2:] ^ np.uint8(Q8_ZERO)  # int8 q as uint8 q + 128: its sign bit flipped
        return _eight_bit(codes, d, Q8_ZERO, rows)
    if blocks.type_name == "Q5_0":
        return _eight_bit(_five_bit(raw[:, 2:6], raw[:, 6:]), d, 16, rows)
    if blocks.type_name == "Q4_1":
        m = raw[:, 2:4].copy().view(_F16)[:, 0].astype(np.float32)
        return _four_bit(_repacked(raw[:, 4:]), d, m + np.float32(Q4_ZERO) * d, rows)
    if bits == 8:  # Q4_0
        return _eight_bit(_nibbles(raw[:, 2:]), d, Q4_ZERO, rows)
    return _four_bit(_repacked(raw[:, 2:]), d, np.zeros_like(d), rows)


def nearest_eight_bit(blocks: QuantBlocks) -> dict[str, np.ndarray] | None:
    """8-bit stored parts for Q6_K, Q5_K or Q5_1 ``blocks`` (None for other types), straight
    from their codes.

    - Q6_K: each 32-weight block holds two of the file's 16-weight sub-blocks, ``d * sc1 *
      (q - 32)`` and ``d * sc2 * (q - 32)``. With ``g = gcd(sc1, sc2)`` both are ``d * g`` times
      integers; where those span at most 256 codes the block keeps them exactly (scale
      ``d * g``), otherwise its values are spread over 256 codes from the lowest to the highest
      (zero included), within half a step of the file's.
    - Q5_K: each 32-weight block is one of the file's sub-blocks, ``d * sc * q - dmin * m`` with
      5-bit ``q``: exact where the offset is a whole number of steps (``m`` zero, most often),
      otherwise spread over 256 codes as above (a step about an eighth of the file's).
    - Q5_1: ``d * q + m`` per 32 weights, as Q5_K's sub-blocks."""
    if blocks.type_name not in NEAREST or blocks.cols % BLOCK or blocks.data.size % BLOCK_BYTES[blocks.type_name]:
        return None
    rows, per_row = blocks.shape[0], blocks.cols // BLOCK
    raw = np.ascontiguousarray(blocks.data).reshape(-1, BLOCK_BYTES[blocks.type_name])
    convert = {"Q6_K": _q6_k_eight_bit, "Q5_K": _q5_k_eight_bit, "Q5_1": _q5_1_eight_bit}[blocks.type_name]
    codes, scale, zero = _sliced(convert, raw)
    return {"qweight": codes.reshape(rows, per_row, BLOCK), "scales": scale.reshape(rows, per_row),
            "zeros": zero.reshape(rows, per_row)}


def _sliced(convert: Callable[[np.ndarray], tuple[np.ndarray, ...]], raw: np.ndarray) -> tuple[np.ndarray, ...]:
    """``convert`` applied to ``raw``'s super-blocks a slice at a time, its outputs joined."""
    parts = [convert(raw[start:start + SLICE_SUPER_BLOCKS]) for start in range(0, len(raw), SLICE_SUPER_BLOCKS)]
    return tuple(np.concatenate(p) for p in zip(*parts))


def _q6_k_eight_bit(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K super-blocks [n, 210] -> 8-bit codes [n * 8, 32], scales and zeros [n * 8], all in
    integer units of ``d * g``: a block spanning more than 256 of them is scaled down by ``f``."""
    n = raw.shape[0]
    ql = raw[:, :128].reshape(n, 2, 2, 32)  # two halves of 128 weights, each two runs of 32 bytes
    qh = raw[:, 128:192].reshape(n, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # the half's weights 0-31, 32-63, 64-95, 96-127
    q = (low | (((qh >> _Q6_K_HIGH_SHIFTS) & 0x03) << 4)).view(np.int8) - np.int8(32)
    sc = raw[:, 192:208].copy().view(np.int8).astype(np.int16).reshape(n * 8, 2)  # one per 16 weights
    d = np.repeat(raw[:, 208:210].copy().view(_F16)[:, 0].astype(np.float32), 8)
    g = np.maximum(np.gcd(sc[:, 0], sc[:, 1]), 1)
    units = (q.reshape(n * 8, 2, 16) * (sc // g[:, None])[..., None]).reshape(n * 8, BLOCK)  # values / (d * g)
    lo = np.minimum(units.min(axis=1), 0).astype(np.float32)
    span = np.maximum(units.max(axis=1), 0) - lo
    f = np.where(span > 255, np.float32(255) / np.maximum(span, 1), np.float32(1)).astype(np.float32)
    zero = np.rint(-lo * f)
    codes = units * f[:, None]
    np.rint(codes, out=codes)
    codes += zero[:, None]
    np.clip(codes, 0, 255, out=codes)
    return codes.astype(np.uint8), (d * g / f).astype(np.float32), zero.astype(np.uint8)


def _q5_k_eight_bit(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_K super-blocks [n, 176] -> 8-bit codes [n * 8, 32], scales and zeros [n * 8]."""
    n = raw.shape[0]
    step, offset = (v.reshape(-1) for v in _k_scales(raw))  # d * sc, dmin * m per sub-block
    qs = raw[:, 48:].reshape(n, 4, 1, BLOCK)  # 4 runs of 32 bytes: sub-block 2c low nibbles, 2c + 1 high
    qh = raw[:, 16:48].reshape(n, 1, 1, BLOCK)  # bit 2c (low) and 2c + 1 (high) of byte l: q's fifth bit
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # [n, 4, 2, 32]: sub-blocks 2c, 2c + 1
    q = (low | (((qh >> _Q5_K_HIGH_SHIFTS) & 1) << 4)).reshape(n * 8, BLOCK)
    return _offset_eight_bit(q, step, offset)


def _q5_1_eight_bit(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_1 blocks [n, 24] (``d * q + m``) -> 8-bit codes [n, 32], scales and zeros [n]."""
    d = raw[:, 0:2].copy().view(_F16)[:, 0].astype(np.float32)
    m = raw[:, 2:4].copy().view(_F16)[:, 0].astype(np.float32)
    return _offset_eight_bit(_five_bit(raw[:, 4:8], raw[:, 8:]), d, -m)


def _offset_eight_bit(q: np.ndarray, step: np.ndarray, offset: np.ndarray) -> tuple[np.ndarray, ...]:
    """Blocks of ``step * q - offset`` (codes ``q`` [n, 32] of at most 5 bits, float32 ``step`` and
    ``offset`` [n]) -> 8-bit codes, scales and zeros: exact where the offset is a whole number of
    steps (codes ``q``), else the values spread over 256 codes, zero included."""
    q = q.astype(np.float32)
    zero_exact = offset / np.where(step != 0, step, np.float32(1))
    exact = (zero_exact == np.rint(zero_exact)) & (zero_exact >= 0) & (zero_exact <= 255) & (step != 0)
    values = q * step[:, None] - offset[:, None]  # (exact: step * (q - zero), codes q)
    lo = np.minimum(values.min(axis=1), 0)
    spread = (np.maximum(values.max(axis=1), 0) - lo) / np.float32(255)
    scale = np.where(exact, step, np.where(spread > 0, spread, np.float32(1))).astype(np.float32)
    zero = np.where(exact, zero_exact, np.rint(-lo / scale))
    codes = np.where(exact[:, None], q, np.rint(values / scale[:, None]) + zero[:, None])
    np.clip(codes, 0, 255, out=codes)
    return codes.astype(np.uint8), scale, zero.astype(np.uint8)


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K and Q5_K super-blocks [n, ...] -> each sub-block's step ``d * sc`` and offset
    ``dmin * m`` [n, 8] (float32), from the 6-bit scales and mins packed in bytes 4-15."""
    n = raw.shape[0]
    d = raw[:, 0:2].copy().view(_F16).astype(np.float32)  # [n, 1]
    dmin = raw[:, 2:4].copy().view(_F16).astype(np.float32)
    packed = raw[:, 4:16].reshape(n, 3, 4)  # 6-bit scales and mins of the 8 sub-blocks
    low, mid, high = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)], axis=1).astype(np.float32)
    mins = np.concatenate([mid & 0x3F, (high >> 4) | ((mid >> 2) & 0x30)], axis=1).astype(np.float32)
    return d * sc, dmin * mins


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes of a 32-weight block -> codes [n, 32]: weights 0-15 in the low nibbles,
    16-31 in the high ones (the layout of Q4_0, Q4_1 and Q5_0)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _five_bit(high: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 codes [n, 32]: the nibbles of ``qs`` [n, 16] (:func:`_nibbles`), each with its
    fifth bit from ``high`` [n, 4] (one little-endian uint32 per block, bit j for weight j)."""
    bits = high.copy().view("<u4")[:, :1] >> np.arange(BLOCK, dtype=np.uint32)
    return _nibbles(qs) | ((bits & 1).astype(np.uint8) << 4)


def _pair_nibbles(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bytes 2j and 2j + 1 of a block, read as one little-endian uint16 -> the byte of their low
    nibbles (low nibble first) and the byte of their high nibbles, each in a uint16 below 256 for
    the caller to store as uint8."""
    return (pairs & 0x0F) | ((pairs >> 4) & 0xF0), ((pairs >> 4) & 0x0F) | ((pairs >> 8) & 0xF0)


def _repacked(qs: np.ndarray) -> np.ndarray:
    """The same [n, 16] bytes in ncm's order (weights 2j and 2j + 1 in byte j, low nibble
    first): byte j holds the low nibbles of bytes 2j and 2j + 1, byte j + 8 their high ones."""
    out = np.empty((qs.shape[0], 2, BLOCK // 4), np.uint8)
    out[:, 0], out[:, 1] = _pair_nibbles(np.ascontiguousarray(qs).view("<u2"))
    return out.reshape(qs.shape[0], BLOCK // 2)


def _q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [n, 144] -> ncm's packed codes [n * 8, 16], scales and offsets [n * 8]."""
    n = raw.shape[0]
    step, offset = _k_scales(raw)
    # 4 chunks of 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones; ncm's byte j
    # of a sub-block holds its weights 2j and 2j + 1
    packed_codes = np.empty((n, 4, 2, BLOCK // 2), np.uint8)
    packed_codes[:, :, 0], packed_codes[:, :, 1] = _pair_nibbles(
        np.ascontiguousarray(raw[:, 16:]).view("<u2").reshape(n, 4, BLOCK // 2))
    scale = step.reshape(-1)
    offset = (np.float32(Q4_ZERO) * scale - offset.reshape(-1)).astype(np.float32)
    return packed_codes.reshape(n * 8, BLOCK // 2), scale, offset


def _four_bit(packed: np.ndarray, scale: np.ndarray, offset: np.ndarray, rows: int) -> dict[str, np.ndarray]:
    return {"qweight": packed.reshape(rows, -1, BLOCK // 2), "scales": scale.reshape(rows, -1),
            "offsets": offset.reshape(rows, -1)}


def _eight_bit(codes: np.ndarray, scale: np.ndarray, zero: int, rows: int) -> dict[str, np.ndarray]:
    return {"qweight": codes.astype(np.uint8, copy=False).reshape(rows, -1, BLOCK),
            "scales": scale.reshape(rows, -1), "zeros": np.full((rows, scale.size // rows), zero, np.uint8)}


__all__ = ["QuantBlocks", "carry", "nearest_eight_bit", "CARRIED", "BLOCK_BYTES", "BLOCK_WEIGHTS", "finite_scales"]
