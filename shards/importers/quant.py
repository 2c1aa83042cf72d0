"""Block quantisation for onnxruntime's ``com.microsoft.MatMulNBits`` (block size 32 along K).

4-bit (the layers' linear weights), ``W[N, K]`` (out features, in features) becomes
``qweight`` uint8 [N, K/32, 16] (codes two per byte, low nibble first), ``scales`` float32
[N, K/32] and ``offsets`` float32 [N, K/32] (left out of a store when all zero) with
``W = (code - 8) * scale + offset``:
MatMulNBits runs with its default zero point 8 (integer zero points keep onnxruntime on its
fast kernels; float zero points were ~50x slower on CPU) and the fragment adds
``blocksum(x) @ offsets^T``. Each block maps its own [min, max] onto codes 0..15, so a GGUF
Q4_1 block (``d * q + m``) is represented (nearly) exactly; a block on a symmetric grid (a GGUF
Q4_0 block, ``d * (q - 8)``) keeps it exactly with a zero offset, and a matrix whose offsets are
all zero runs without the offsets' MatMul.

8-bit (lm_head, and an embedding table it holds exactly): ``qweight`` uint8 [N, K/32, 32],
``scales`` float32 [N, K/32], ``zeros`` uint8 [N, K/32] with ``W = (code - zero) * scale``. A
block on a symmetric grid ``d * k``, |k| <= 127 (a GGUF Q8_0 block) keeps it exactly with zero
point 128; any other block maps its [min(0, lo), max(0, hi)] onto 0..255.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
Q4_ZERO = 8
Q8_ZERO = 128
GRID_TOLERANCE = 1e-3  # of a code: how far from an integer a value on a block's grid may fall (float rounding)
Q8_PEAK = 127  # a GGUF Q8_0 block's largest code magnitude


def _blocks(w: np.ndarray) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"block quantisation needs K divisible by {BLOCK}, got {k}")
    return w.reshape(n, k // BLOCK, BLOCK)


def _by_rows(fn, w: np.ndarray, rows: int = 4096) -> dict[str, np.ndarray]:
    """Apply ``fn`` to row slices of ``w`` (bounds temporaries for huge matrices such as lm_head)."""
    parts = [fn(w[r:r + rows]) for r in range(0, w.shape[0], rows)]
    return {k: np.concatenate([p[k] for p in parts], axis=0) for k in parts[0]}


def quantize_q4(w: np.ndarray) -> dict[str, np.ndarray]:
    """4-bit: {"qweight", "scales", "offsets"} for ``w`` [N, K]."""
    return _by_rows(_q4, w)


def quantize_q8(w: np.ndarray) -> dict[str, np.ndarray]:
    """8-bit: {"qweight", "scales", "zeros"} for ``w`` [N, K]."""
    return _by_rows(_q8, w)


def _grid(b: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """(on_grid, step) per block of ``b``: whether its values are lo + k * step with integer k in
    0..levels - 1, step the smallest gap between two of its values. A block a quantised file
    stores (a GGUF Q4_1, Q4_K or Q5_0 block: d * q + m) is such a grid even when its codes do
    not reach both ends, where spreading [lo, hi] over all the codes would move its values."""
    ordered = np.sort(b, axis=2)
    gaps = np.diff(ordered, axis=2)
    step = np.where(gaps > 0, gaps, np.inf).min(axis=2).astype(np.float32)
    step = np.where(np.isfinite(step), step, np.float32(1.0)).astype(np.float32)  # one value: any step
    k = (b - ordered[..., :1]) / step[..., None]
    on_grid = np.all((np.abs(k - np.round(k)) <= GRID_TOLERANCE) & (np.round(k) <= levels - 1), axis=2)
    return on_grid, step


def _q4(w: np.ndarray) -> dict[str, np.ndarray]:
    b = _blocks(w)
    lo, hi = b.min(axis=2), b.max(axis=2)
    scale = ((hi - lo) / 15.0).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    on_grid, step = _grid(b, 16)  # its own grid, codes from 0 at its lowest value
    scale = np.where(on_grid, step, scale).astype(np.float32)
    codes = np.clip(np.round((b - lo[..., None]) / scale[..., None]), 0, 15)
    offsets = (lo + Q4_ZERO * scale).astype(np.float32)
    # A block on a symmetric grid, d * k with k in -8..7 and its largest magnitude at k = -8
    # (a GGUF Q4_0 block), keeps that grid exactly and needs no offset: when no block of a
    # matrix has one, its fragment skips the offsets' MatMul (0.625 bytes per weight, not 0.75).
    peak = np.take_along_axis(b, np.abs(b).argmax(axis=2)[..., None], axis=2)[..., 0]
    d = np.where(peak != 0, peak / np.float32(-Q4_ZERO), np.float32(1.0)).astype(np.float32)
    k = b / d[..., None]
    symmetric = np.all((k == np.round(k)) & (k >= -Q4_ZERO) & (k <= Q4_ZERO - 1), axis=2)
    codes = np.where(symmetric[..., None], np.clip(k + Q4_ZERO, 0, 15), codes).astype(np.uint8)
    scale = np.where(symmetric, d, scale).astype(np.float32)
    offsets = np.where(symmetric, np.float32(0.0), offsets).astype(np.float32)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return {"qweight": packed, "scales": scale, "offsets": offsets}


def _q8_grid(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(symmetric, d, k) per block of ``b``: whether it is ``d * k`` with integer k, |k| <= 127
    and its largest magnitude at |k| = 127 (a GGUF Q8_0 block)."""
    peak = np.abs(b).max(axis=2)
    d = np.where(peak > 0, peak / np.float32(Q8_PEAK), np.float32(1.0)).astype(np.float32)
    k = b / d[..., None]
    return np.all(k == np.round(k), axis=2), d, k


def _q8(w: np.ndarray) -> dict[str, np.ndarray]:
    b = _blocks(w)
    lo, hi = np.minimum(b.min(axis=2), 0.0), np.maximum(b.max(axis=2), 0.0)
    scale = ((hi - lo) / 255.0).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    zero = np.clip(np.round(-lo / scale), 0, 255)
    codes = np.clip(np.round(b / scale[..., None]) + zero[..., None], 0, 255)
    # its own grid when that puts zero on an integer code (a GGUF Q5_0 block, d * (q - 16)); a
    # block of positive values whose lowest is a whole number of steps counts from code 0
    on_grid, step = _grid(b, 256)
    grid_zero = -b.min(axis=2) / step
    on_grid &= np.abs(grid_zero - np.round(grid_zero)) <= GRID_TOLERANCE
    grid_zero = np.maximum(np.round(grid_zero), 0)
    on_grid &= np.round(b.max(axis=2) / step) + grid_zero <= 255
    codes = np.where(on_grid[..., None], np.round(b / step[..., None]) + grid_zero[..., None], codes)
    scale = np.where(on_grid, step, scale)
    zero = np.where(on_grid, grid_zero, zero)
    symmetric, d, k = _q8_grid(b)  # kept exactly, with zero point 128
    codes = np.where(symmetric[..., None], k + Q8_ZERO, codes).astype(np.uint8)
    scale = np.where(symmetric, d, scale).astype(np.float32)
    zero = np.where(symmetric, Q8_ZERO, zero).astype(np.uint8)
    return {"qweight": codes, "scales": scale, "zeros": zero}


def without_zero_offsets(parts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """4-bit parts as a store keeps them: offsets that are all zero (symmetric blocks, a GGUF
    Q4_0 tensor's) left out, 0.625 bytes per weight instead of 0.75."""
    if "offsets" in parts and not parts["offsets"].any():
        return {k: v for k, v in parts.items() if k != "offsets"}
    return parts


def exact_q8(w: np.ndarray) -> bool:
    """Whether :func:`quantize_q8` keeps ``w`` exactly (every block on a symmetric 8-bit grid)."""
    if w.ndim != 2 or w.shape[1] % BLOCK:
        return False
    return bool(np.all(_by_rows(lambda rows: {"symmetric": _q8_grid(_blocks(rows))[0]}, w)["symmetric"]))


def dequantize(t: dict[str, np.ndarray]) -> np.ndarray:
    """Float32 [N, K] from the output of :func:`quantize_q4` or :func:`quantize_q8`."""
    qw = t["qweight"]
    n, kb, blob = qw.shape
    sc = t["scales"].reshape(n, kb, 1)
    if blob == BLOCK // 2:  # 4-bit (a store leaves out offsets that are all zero: see without_zero_offsets)
        codes = np.empty((n, kb, BLOCK), np.float32)
        codes[..., 0::2] = qw & 0x0F
        codes[..., 1::2] = qw >> 4
        offsets = t["offsets"].reshape(n, kb, 1) if "offsets" in t else np.float32(0.0)
        return ((codes - Q4_ZERO) * sc + offsets).reshape(n, kb * BLOCK)
    return ((qw.astype(np.float32) - t["zeros"].reshape(n, kb, 1)) * sc).reshape(n, kb * BLOCK)
