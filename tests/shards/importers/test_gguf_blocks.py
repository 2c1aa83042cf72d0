"""A GGUF file's blocks carried over into ncm's MatMulNBits blocks: the values gguf's own
dequantisation gives, for every byte pattern of the codes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from shards.importers.gguf_blocks import CARRIED, QuantBlocks, carry, nearest_eight_bit
from shards.importers.quant import dequantize

# the float16 fields each carried type's block starts with: d, and the min (Q4_1) or dmin (Q4_K)
LEADING_HALVES = {"Q4_0": 1, "Q4_1": 2, "Q5_0": 1, "Q8_0": 1, "Q4_K": 2, "Q5_K": 2, "Q5_1": 2}


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> QuantBlocks:
    """A [rows, cols] tensor of ``type_name`` blocks: random code bytes, random float16 scales."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    halves = LEADING_HALVES.get(type_name, 0)
    if halves:
        scales = rng.uniform(-0.1, 0.1, (rows, cols // block, halves)).astype(np.float16)
        raw[..., :2 * halves] = scales.view(np.uint8)
    return QuantBlocks(type_name, raw.reshape(rows, -1), cols)


@pytest.mark.parametrize(("type_name", "bits"), [(t, b) for b, types in CARRIED.items() for t in types])
def test_carried_blocks_hold_the_files_values(type_name: str, bits: int) -> None:
    blocks = random_blocks(type_name, 24, 512, seed=bits)
    parts = carry(blocks, bits)
    assert parts is not None and parts["qweight"].shape == (24, 16, 16 if bits == 4 else 32)
    want = blocks.to_float()
    np.testing.assert_allclose(dequantize(parts), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_a_q4_0_tensor_needs_no_offsets() -> None:
    parts = carry(random_blocks("Q4_0", 8, 64), 4)
    assert parts is not None and not parts["offsets"].any()  # the fragment skips the offsets' product


@pytest.mark.parametrize(("type_name", "bits"), [("Q4_1", 8), ("Q4_K", 8), ("Q5_0", 4), ("Q8_0", 4), ("Q6_K", 8),
                                                 ("Q5_K", 8), ("Q6_K", 4)])
def test_a_width_that_cannot_hold_a_type_is_declined(type_name: str, bits: int) -> None:
    assert carry(random_blocks(type_name, 4, 256), bits) is None


def test_row_operations_apply_to_the_blocks_as_to_the_floats() -> None:
    blocks = random_blocks("Q4_K", 12, 256)
    order = np.random.default_rng(1).permutation(12)
    moved = QuantBlocks("Q4_K", blocks.data[order], 256)
    np.testing.assert_array_equal(moved.to_float(), blocks.to_float()[order])
    assert moved.shape == (12, 256)


def test_blocks_are_uint8_rows() -> None:
    with pytest.raises(ValueError, match="uint8"):
        QuantBlocks("Q4_0", np.zeros((2, 18), np.int8), 32)
    with pytest.raises(ValueError, match="uint8"):
        QuantBlocks("Q4_0", np.zeros(36, np.uint8), 32)


def q6_k_blocks(rows: int, cols: int, sub_scales: np.ndarray, seed: int = 0) -> QuantBlocks:
    """A [rows, cols] Q6_K tensor: random 6-bit codes, ``sub_scales`` [16] as every super-block's
    int8 sub-block scales, float16 ``d`` in (0.001, 0.01)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 256, 210), dtype=np.uint8)
    raw[..., 192:208] = np.asarray(sub_scales, np.int8).view(np.uint8)
    raw[..., 208:210] = rng.uniform(0.001, 0.01, (rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    return QuantBlocks("Q6_K", raw.reshape(rows, -1), cols)


def within_half_a_step(blocks: QuantBlocks) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """:func:`nearest_eight_bit` of ``blocks``, its values checked within half their 8-bit step of
    gguf's own dequantisation: (parts, gguf's values, ours, steps), per 32-weight block."""
    parts = nearest_eight_bit(blocks)
    assert parts is not None
    rows = blocks.shape[0]
    want, got = blocks.to_float().reshape(rows, -1, 32), dequantize(parts).reshape(rows, -1, 32)
    step = parts["scales"].reshape(rows, -1, 1)
    assert np.all(np.abs(got - want) <= step * 0.5 + 1e-6 * np.abs(want).max())
    return parts, want, got, step


@pytest.mark.parametrize("sub_scales", [[7] * 16, [2, 4, -6, 3, 12, -12, 1, 1, 5, 10, 8, -4, 9, 6, -1, 2]])
def test_q6_k_sub_blocks_that_share_a_grid_move_to_8_bit_exactly(sub_scales: list[int]) -> None:
    blocks = q6_k_blocks(6, 512, np.array(sub_scales))
    parts = nearest_eight_bit(blocks)
    assert parts is not None and parts["qweight"].shape == (6, 16, 32)
    want = blocks.to_float()  # gguf's own dequantisation
    np.testing.assert_allclose(dequantize(parts), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_q6_k_sub_blocks_too_far_apart_are_spread_within_half_a_step() -> None:
    sub_scales = np.array([127, -128, 1, 100, 3, 97, -50, 51, 127, 2, 64, 63, -7, 120, 11, -127])
    blocks = q6_k_blocks(4, 256, sub_scales, seed=3)
    _, _, _, step = within_half_a_step(blocks)
    # each pair's 8-bit step is at most 64/255 of the file's coarser 6-bit one (64 of its steps at most)
    d = blocks.data.reshape(4, 1, 210)[..., 208:210].copy().view(np.float16).astype(np.float32)
    coarser = np.abs(sub_scales.reshape(8, 2)).max(axis=1).reshape(1, 8, 1) * d
    assert np.all(step <= coarser * 64 / 255 * (1 + 1e-6))


def q5_k_blocks(rows: int, cols: int, mins: np.ndarray, seed: int = 0) -> QuantBlocks:
    """A [rows, cols] Q5_K tensor: random 5-bit codes and 6-bit scales, ``mins`` [8] as every
    super-block's 6-bit sub-block mins, float16 ``d`` and ``dmin`` in (0.001, 0.01)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 256, 176), dtype=np.uint8)
    raw[..., :4] = rng.uniform(0.001, 0.01, (rows, cols // 256, 2)).astype(np.float16).view(np.uint8)
    mins = np.asarray(mins, np.uint8)
    raw[..., 8:12] = (raw[..., 8:12] & 0xC0) | (mins[:4] & 0x3F)  # sub-blocks 0-3: the low 6 bits of bytes 4-7
    raw[..., 12:16] = (raw[..., 12:16] & 0x0F) | ((mins[4:] & 0x0F) << 4)  # 4-7: a nibble here, two bits above
    raw[..., 8:12] = (raw[..., 8:12] & 0x3F) | ((mins[4:] >> 4) << 6)
    return QuantBlocks("Q5_K", raw.reshape(rows, -1), cols)


def test_q5_k_sub_blocks_without_a_min_move_to_8_bit_exactly() -> None:
    blocks = q5_k_blocks(6, 512, np.zeros(8))
    parts = nearest_eight_bit(blocks)
    assert parts is not None and parts["qweight"].shape == (6, 16, 32) and not parts["zeros"].any()
    want = blocks.to_float()  # gguf's own dequantisation
    np.testing.assert_allclose(dequantize(parts), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_q5_k_sub_blocks_with_a_min_are_spread_over_256_codes_within_half_a_step() -> None:
    mins = np.array([1, 5, 17, 63, 0, 30, 2, 44])  # (sub-block 4: no min, kept exactly)
    _, want, got, step = within_half_a_step(q5_k_blocks(4, 512, mins, seed=5))
    np.testing.assert_allclose(got[:, 4::8], want[:, 4::8], rtol=1e-6, atol=1e-6 * np.abs(want).max())
    # the others spread their values, zero included, over the 256 codes
    span = np.maximum(want.max(axis=2), 0) - np.minimum(want.min(axis=2), 0)
    spread = np.tile(mins != 0, 2)
    np.testing.assert_allclose(step[:, spread, 0], span[:, spread] / 255, rtol=1e-5)


def test_q5_1_blocks_move_to_8_bit_exactly_where_the_min_is_whole_steps_else_within_half_a_step() -> None:
    blocks = random_blocks("Q5_1", 8, 256, seed=7)
    raw = blocks.data.reshape(8, 8, 24).copy()
    d = (np.random.default_rng(2).integers(1, 100, (8, 4, 1)) / 1024).astype(np.float16)  # (5 * d: a float16 too)
    raw[:, :4, 0:2], raw[:, :4, 2:4] = d.view(np.uint8), (-d * np.float16(5)).view(np.uint8)  # min: -5 steps
    parts, want, got, _ = within_half_a_step(QuantBlocks("Q5_1", raw.reshape(8, -1), 256))
    np.testing.assert_allclose(got[:, :4], want[:, :4], rtol=1e-6, atol=1e-6 * np.abs(want).max())
    assert (parts["zeros"][:, :4] == 5).all()


@pytest.mark.parametrize("type_name", ["Q4_K", "Q3_K", "Q8_0"])
def test_only_q6_k_q5_k_and_q5_1_move_to_the_nearest_8_bit(type_name: str) -> None:
    assert nearest_eight_bit(random_blocks(type_name, 2, 256)) is None
