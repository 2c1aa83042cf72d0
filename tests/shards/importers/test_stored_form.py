"""The stored form of a tensor: a mixed store keeps the GGUF blocks a load shuffles into ncm's as
the file holds them, and a load gives what an import converting them would have stored."""

from __future__ import annotations

import numpy as np
import pytest

from shards.errors import ModelFormatError
from shards.importers.gguf_blocks import QuantBlocks
from shards.importers.quant import dequantize
from shards.importers.stored_form import FILE_BLOCKS, convert_tensors, loaded_nbytes, loaded_tensors
from tests.shards.importers.test_gguf_blocks import random_blocks

NARROW, WIDE = ("Q4_0", "Q4_1", "Q4_K"), ("Q8_0", "Q5_0", "Q6_K", "Q5_K", "Q5_1")


def parts(tensors: dict[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
    return {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}


@pytest.mark.parametrize("type_name", NARROW + WIDE)
def test_a_mixed_store_keeps_the_files_blocks_and_a_load_gives_ncms(type_name: str) -> None:
    blocks = random_blocks(type_name, 12, 512, seed=len(type_name))
    narrow = frozenset({"up_proj"}) if type_name in NARROW else frozenset()
    stored = convert_tensors({"up_proj": blocks, "input_norm": np.ones(8, np.float32)}, "mixed", narrow=narrow)
    assert set(stored) == {f"up_proj.{FILE_BLOCKS}.{type_name}", "input_norm"}
    np.testing.assert_array_equal(stored[f"up_proj.{FILE_BLOCKS}.{type_name}"], blocks.data)  # the file's bytes
    loaded = loaded_tensors(stored, "mixed")
    converted = convert_tensors({"up_proj": blocks, "input_norm": np.ones(8, np.float32)}, "mixed", narrow=narrow,
                                file_blocks=False)  # what an import used to store
    assert set(loaded) == set(converted)
    for key, value in converted.items():
        np.testing.assert_array_equal(loaded[key], value, err_msg=key)
    assert parts(loaded, "up_proj")["qweight"].shape[-1] == (16 if type_name in NARROW else 32)
    want = blocks.to_float()
    atol = (2e-2 if type_name in ("Q6_K", "Q5_K", "Q5_1") else 1e-6) * np.abs(want).max()  # (spread: within a step)
    np.testing.assert_allclose(dequantize(parts(loaded, "up_proj")), want, rtol=1e-5, atol=atol)
    size = sum(v.nbytes for v in loaded.values())
    assert size <= loaded_nbytes(stored) <= size + (blocks.shape[0] * 16 * 4 if type_name == "Q4_0" else 0)


def test_the_output_layer_keeps_8_bit_types_and_other_blocks_are_converted_at_import() -> None:
    stored = convert_tensors({"lm_head": random_blocks("Q6_K", 8, 256), "down_proj": np.ones((8, 256), np.float32),
                              "embed": random_blocks("Q8_0", 8, 256)}, "mixed")
    assert f"lm_head.{FILE_BLOCKS}.Q6_K" in stored
    assert {"down_proj.qweight", "embed.qweight"} <= set(stored)  # floats: quantised; the table: 8-bit now
    head = convert_tensors({"lm_head": random_blocks("Q4_K", 8, 256)}, "mixed")
    assert "lm_head.qweight" in head and head["lm_head.qweight"].shape[-1] == 32  # 8 bits, through float
    for weights in ("q4", "f16"):  # the explicit formats convert at import, as before
        assert not any(FILE_BLOCKS in k for k in convert_tensors({"q_proj": random_blocks("Q4_K", 8, 256)}, weights))


def test_a_stored_file_without_file_blocks_loads_as_it_is() -> None:
    stored = {"q_proj.qweight": np.zeros((4, 2, 16), np.uint8), "q_proj.scales": np.ones((4, 2), np.float32)}
    assert loaded_tensors(stored, "q4") is stored and loaded_nbytes(stored) == 4 * 2 * 16 + 4 * 2 * 4


def test_a_non_finite_scale_is_refused_at_import() -> None:
    blocks = random_blocks("Q4_K", 4, 256)
    data = blocks.data.copy()
    data[2, 2:4] = np.array([np.inf], np.float16).view(np.uint8)  # dmin of a row's super-block
    with pytest.raises(ModelFormatError, match="q_proj holds NaN or infinite scales"):
        convert_tensors({"q_proj": QuantBlocks("Q4_K", data, 256)}, "mixed", narrow=frozenset({"q_proj"}))


@pytest.mark.parametrize(("key", "shape"), [(f"q_proj.{FILE_BLOCKS}.Q3_K", (4, 110)),
                                            (f"q_proj.{FILE_BLOCKS}.Q4_K", (4, 100))])
def test_stored_blocks_a_load_cannot_read_are_a_format_error(key: str, shape: tuple[int, int]) -> None:
    with pytest.raises(ModelFormatError, match="not a block type ncm loads"):
        loaded_tensors({key: np.zeros(shape, np.uint8)}, "mixed")
