"""A GGUF file's blocks carried over into ncm's MatMulNBits blocks: the values gguf's own
dequantisation gives, for every byte pattern of the codes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from shards.importers.gguf_blocks import CARRIED, QuantBlocks, carry
from shards.importers.quant import dequantize

# the float16 fields each carried type's block starts with: d, and the min (Q4_1) or dmin (Q4_K)
LEADING_HALVES = {"Q4_0": 1, "Q4_1": 2, "Q5_0": 1, "Q8_0": 1, "Q4_K": 2}


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
