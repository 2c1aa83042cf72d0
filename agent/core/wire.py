"""Data-plane frames: a small msgpack header plus the raw bytes of one tensor.

Layout: b"NCM1" | header length (u32, little endian) | msgpack header | raw tensor bytes.
The header names the message kind and, when a tensor follows, its dtype and shape; decoding
checks the dtype against an allowed list, the shape, and that the byte length matches, and
returns the tensor as a zero-copy view of the frame.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import msgpack
import numpy as np

from agent.core.errors import WireError

MAGIC = b"NCM1"
_LENGTH = struct.Struct("<I")
MAX_HEADER_BYTES = 1 << 20  # a sampling step carries its grammar (tools, a JSON schema)
MAX_TENSOR_DIMS = 4
ALLOWED_DTYPES = frozenset({"float32", "float16", "int64", "int32"})

_STR, _INT, _BOOL, _MAP, _BYTES, _OPT_INT, _OPT_STR, _IDS = "str", "int", "bool", "map", "bytes", "int?", "str?", "ids"
MAX_VECTOR_BYTES = 1 << 18  # a result's embedding: float32, up to 65,536 dimensions
MAX_DRAFT_TOKENS = 16  # a speculative step's drafted tokens, and the tokens its result accepts after the first
# kind -> required fields and their types; "tensor" marks kinds that carry a tensor.
SCHEMAS: dict[str, dict[str, str]] = {
    "step": {"sid": _STR, "seq": _INT, "layer": _INT, "start": _INT, "sample": _BOOL, "epoch": _INT, "plan": _INT,
             "reply": _STR, "reply_url": _STR},  # the node its result or failure goes to, the orchestrator
    "result": {"sid": _STR, "seq": _INT, "token": _OPT_INT},
    "close": {"sid": _STR, "layer": _INT},
    "error": {"sid": _STR, "seq": _INT, "code": _STR, "message": _STR, "node": _OPT_STR},
    # A liveness probe on a link, answered at once by the event loop that reads it: a node
    # that does not is frozen or gone.
    "ping": {},
    "pong": {},
}
TENSOR_KINDS = frozenset({"step"})
# "cid" pairs a pong with its ping on one link.
OPTIONAL_FIELDS: dict[str, dict[str, str]] = {
    "step": {"params": _MAP, "reuse": _STR, "embed": _BOOL, "draft": _IDS},
    "close": {"plan": _INT, "keep": _BOOL},
    "result": {"logprobs": _MAP, "embedding": _BYTES, "more": _IDS},
    "ping": {"cid": _INT},
    "pong": {"cid": _INT},
}


_TYPE_CHECKS = {
    _STR: lambda value: isinstance(value, str) and len(value) <= 4096,
    _INT: lambda value: isinstance(value, int) and not isinstance(value, bool),
    _BOOL: lambda value: isinstance(value, bool),
    _MAP: lambda value: isinstance(value, dict),
    _BYTES: lambda value: isinstance(value, bytes) and len(value) <= MAX_VECTOR_BYTES and len(value) % 4 == 0,
    _IDS: lambda value: isinstance(value, list) and len(value) <= MAX_DRAFT_TOKENS
    and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 31 for i in value),
}
# kind -> (name, type, its check, None allowed, required) per field: what a frame is checked against
_FIELDS: dict[str, tuple[tuple[str, str, Any, bool, bool], ...]] = {
    kind: tuple((name, expected.rstrip("?"), _TYPE_CHECKS[expected.rstrip("?")], expected.endswith("?"), required)
                for fields, required in ((SCHEMAS[kind], True), (OPTIONAL_FIELDS.get(kind, {}), False))
                for name, expected in fields.items())
    for kind in SCHEMAS
}
_DTYPE_NAMES = {np.dtype(name): name for name in ALLOWED_DTYPES}
_ITEM_BYTES = {name: np.dtype(name).itemsize for name in ALLOWED_DTYPES}


def validate_header(header: Any) -> dict[str, Any]:
    if not isinstance(header, dict):
        raise WireError("frame header must be a map")
    kind = header.get("kind")
    fields = _FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        raise WireError(f"unknown frame kind {kind!r}")
    for name, base, check, nullable, required in fields:
        if name not in header:
            if required:
                raise WireError(f"{kind} frame is missing {name!r}")
            continue
        value = header[name]
        if not (check(value) or (nullable and value is None)):
            raise WireError(f"{kind} frame: field {name!r} must be {base}, got {type(value).__name__}")
    return header


def encode_frame(header: dict[str, Any], tensor: np.ndarray | None = None) -> bytes:
    """Pack a header (validated) and an optional tensor into one frame."""
    header = dict(header)
    if tensor is not None:
        dtype = _DTYPE_NAMES.get(tensor.dtype)
        if dtype is None:
            raise WireError(f"dtype {tensor.dtype.name} is not allowed on the wire")
        tensor = np.ascontiguousarray(tensor)
        header["tensor"] = {"dtype": dtype, "shape": list(tensor.shape)}
    validate_header(header)
    if (header["kind"] in TENSOR_KINDS) != (tensor is not None):
        raise WireError(f"{header['kind']} frame {'needs' if tensor is None else 'takes no'} tensor")
    packed = msgpack.packb(header, use_bin_type=True)
    parts: list[Any] = [MAGIC, _LENGTH.pack(len(packed)), packed]
    if tensor is not None:
        parts.append(tensor.reshape(-1).view(np.uint8) if tensor.size else b"")
    return b"".join(parts)


def decode_frame(frame: bytes | bytearray | memoryview) -> tuple[dict[str, Any], np.ndarray | None]:
    """Unpack and validate a frame; the tensor is a read-only view of ``frame``."""
    view = memoryview(frame)
    if len(view) < 8 or bytes(view[:4]) != MAGIC:
        raise WireError("not an ncm frame (bad magic)")
    (header_length,) = _LENGTH.unpack(view[4:8])
    if header_length > MAX_HEADER_BYTES or 8 + header_length > len(view):
        raise WireError(f"frame header length {header_length} is out of bounds")
    try:
        header = msgpack.unpackb(view[8 : 8 + header_length], raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError) as error:
        raise WireError(f"frame header is not valid msgpack: {error}") from None
    validate_header(header)
    payload = view[8 + header_length :]
    spec = header.get("tensor")
    if header["kind"] not in TENSOR_KINDS:
        if spec is not None or len(payload):
            raise WireError(f"{header['kind']} frame must not carry a tensor")
        return header, None
    if not isinstance(spec, dict):
        raise WireError(f"{header['kind']} frame is missing its tensor description")
    dtype, shape = spec.get("dtype"), spec.get("shape")
    if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES:
        raise WireError(f"tensor dtype {dtype!r} is not allowed (allowed: {', '.join(sorted(ALLOWED_DTYPES))})")
    if (
        not isinstance(shape, list)
        or not 1 <= len(shape) <= MAX_TENSOR_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise WireError(f"tensor shape {shape!r} is invalid")
    expected = math.prod(shape) * _ITEM_BYTES[dtype]
    if expected != len(payload):
        raise WireError(f"tensor of shape {shape} and dtype {dtype} needs {expected} bytes, frame carries {len(payload)}")
    return header, np.frombuffer(payload, dtype=dtype).reshape(shape)
