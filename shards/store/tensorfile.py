"""Read and write tensors in the safetensors file format with numpy only.

Layout: 8-byte little-endian header length, a JSON header mapping each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of the
header), then the raw little-endian tensor bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from shards.errors import ModelFormatError

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_BF16 = "BF16"
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16) to float32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """Return (tensor table, byte offset of the data section); ModelFormatError if malformed."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ModelFormatError(f"{path.name}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n <= 0 or n > _MAX_HEADER_BYTES or 8 + n > size:
                raise ModelFormatError(f"{path.name}: bad safetensors header length {n}")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"{path.name}: unreadable safetensors file ({e})") from e
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path.name}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + n
    for name, info in header.items():
        try:
            begin, end = info["data_offsets"]
            dtype, shape = info["dtype"], [int(d) for d in info["shape"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFormatError(f"{path.name}: bad entry for tensor {name!r}") from e
        if dtype not in _DTYPES and dtype != _BF16:
            raise ModelFormatError(f"{path.name}: tensor {name!r} has unsupported dtype {dtype}")
        itemsize = 2 if dtype == _BF16 else _DTYPES[dtype].itemsize
        if end - begin != itemsize * int(np.prod(shape, dtype=np.int64)) or data_start + end > size:
            raise ModelFormatError(f"{path.name}: tensor {name!r} is truncated or inconsistent")
    return header, data_start


def read_tensors(path: Path, names: list[str] | None = None) -> dict[str, np.ndarray]:
    """Load tensors (all, or ``names``) as numpy arrays; bfloat16 is widened to float32."""
    header, data_start = read_header(path)
    wanted = list(header) if names is None else names
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, np.ndarray] = {}
    for name in wanted:
        if name not in header:
            raise ModelFormatError(f"{path.name}: tensor {name!r} is missing")
        info = header[name]
        begin, end = info["data_offsets"]
        raw = mm[data_start + begin : data_start + end]
        shape = tuple(int(d) for d in info["shape"])
        if info["dtype"] == _BF16:
            out[name] = _bf16_to_f32(np.asarray(raw).view("<u2")).reshape(shape)
        else:
            out[name] = np.array(raw.view(_DTYPES[info["dtype"]])).reshape(shape)
    return out


def file_chunks(tensors: Mapping[str, np.ndarray]) -> list[memoryview | bytes]:
    """The bytes of a safetensors file holding ``tensors`` (names kept in the given order), in
    pieces: the header, then each tensor's bytes (views of the arrays, no copy)."""
    header: dict[str, dict] = {}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        a = np.asarray(arr)
        if not a.flags.c_contiguous:
            a = a.copy(order="C")
        dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
        if np.dtype(dt) not in _NAMES:
            raise ValueError(f"cannot store dtype {a.dtype} for tensor {name!r}")
        a = a.astype(dt, copy=False)
        header[name] = {
            "dtype": _NAMES[np.dtype(dt)],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return [struct.pack("<Q", len(blob)) + blob, *(memoryview(a.reshape(-1)).cast("B") for a in arrays)]


def write_tensors(path: Path, tensors: Mapping[str, np.ndarray]) -> None:
    """Write ``tensors`` to ``path`` in safetensors format (names kept in the given order)."""
    write_chunks(path, file_chunks(tensors))


def write_chunks(path: Path, chunks: list[memoryview | bytes]) -> None:
    """Write a file's :func:`file_chunks` to ``path``."""
    with open(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
