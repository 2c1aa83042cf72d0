"""The numpy safetensors reader/writer used for stored weights and HF checkpoints."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from shards.errors import ModelFormatError
from shards.store.tensorfile import file_chunks, read_header, read_tensors, write_chunks, write_tensors


def test_round_trip(tmp_path) -> None:
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": np.arange(7, dtype=np.uint8),
               "c": rng.standard_normal(4).astype(np.float16), "d": np.array(5, np.int64)}
    write_tensors(tmp_path / "t.safetensors", tensors)
    back = read_tensors(tmp_path / "t.safetensors")
    assert list(back) == list(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        np.testing.assert_array_equal(back[k], v)
    assert list(read_tensors(tmp_path / "t.safetensors", ["b"])) == ["b"]


def test_the_chunks_are_the_files_bytes_and_write_as_the_tensors_do(tmp_path) -> None:
    tensors = {"w": np.arange(40, dtype=np.float32).reshape(5, 8)[:, ::2], "z": np.arange(9, dtype=">i4")}
    chunks = file_chunks(tensors)  # (a non-contiguous and a big-endian array: copied, as written)
    write_tensors(tmp_path / "a.safetensors", tensors)
    write_chunks(tmp_path / "b.safetensors", chunks)
    assert (tmp_path / "a.safetensors").read_bytes() == b"".join(chunks) == (tmp_path / "b.safetensors").read_bytes()
    np.testing.assert_array_equal(read_tensors(tmp_path / "b.safetensors")["w"], tensors["w"])


def test_readable_by_the_safetensors_package(tmp_path) -> None:
    st = pytest.importorskip("safetensors.numpy")
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    write_tensors(tmp_path / "t.safetensors", {"x": a})
    np.testing.assert_array_equal(st.load_file(str(tmp_path / "t.safetensors"))["x"], a)


def test_bfloat16_is_widened(tmp_path) -> None:
    vals = np.array([1.0, -2.5, 3.140625], np.float32)
    raw = (vals.view(np.uint32) >> 16).astype("<u2").tobytes()
    header = json.dumps({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]}}).encode()
    (tmp_path / "b.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + raw)
    np.testing.assert_array_equal(read_tensors(tmp_path / "b.safetensors")["w"], vals)


@pytest.mark.parametrize("blob", [
    b"", b"\x01\x02", struct.pack("<Q", 10**12) + b"{}", struct.pack("<Q", 4) + b"[1]x",
    struct.pack("<Q", 2) + b"{(",
])
def test_malformed_files(tmp_path, blob) -> None:
    (tmp_path / "x.safetensors").write_bytes(blob)
    with pytest.raises(ModelFormatError):
        read_header(tmp_path / "x.safetensors")


def test_inconsistent_entries(tmp_path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(ModelFormatError, match="inconsistent"):
        read_tensors(tmp_path / "x.safetensors")
    header = json.dumps({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "y.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(ModelFormatError, match="dtype"):
        read_tensors(tmp_path / "y.safetensors")
    write_tensors(tmp_path / "z.safetensors", {"a": np.zeros(2, np.float32)})
    with pytest.raises(ModelFormatError, match="missing"):
        read_tensors(tmp_path / "z.safetensors", ["nope"])
