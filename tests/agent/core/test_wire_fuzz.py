"""Fuzzing of every parser that reads what a peer sends: data-plane frames, describe answers
(node adverts), mDNS TXT records and routing orders. The one invariant: a typed WireError
or a valid value, never another exception."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.core.advert import NodeAdvert, decode_txt
from agent.core.errors import WireError
from agent.core.orders import RoutingOrder
from agent.core.wire import ALLOWED_DTYPES, MAGIC, SCHEMAS, decode_frame
from tests.examples import examples

EXAMPLES = examples(400)
FIELD_NAMES = sorted({name for schema in SCHEMAS.values() for name in schema} | {"tensor", "cid", "params", "plan"})

scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=True)
           | st.text(max_size=12) | st.binary(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                      max_leaves=12)
shapes = st.lists(st.integers(-3, 2**40) | st.booleans() | st.text(max_size=2), max_size=9)
tensor_specs = st.fixed_dictionaries({"dtype": st.sampled_from([*sorted(ALLOWED_DTYPES), "object", "V8", "", 7]) | values,
                                      "shape": shapes | values})
headers = st.dictionaries(
    st.sampled_from(FIELD_NAMES) | st.text(max_size=8),
    values | tensor_specs | st.sampled_from([*SCHEMAS, "launch"]),
    max_size=14,
)


def frame(header: object, payload: bytes, declared_length: int | None = None) -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    length = len(packed) if declared_length is None else declared_length
    return MAGIC + struct.pack("<I", length) + packed + payload


def decodes_or_refuses(data: bytes) -> None:
    try:
        header, tensor = decode_frame(data)
    except WireError:
        return
    assert header["kind"] in SCHEMAS
    if tensor is not None:
        assert tensor.dtype.name in ALLOWED_DTYPES
        assert tensor.nbytes == len(data) - 8 - struct.unpack("<I", data[4:8])[0]


@settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow])
@given(headers, st.binary(max_size=64))
def test_frames_with_any_header_are_decoded_or_refused(header, payload):
    decodes_or_refuses(frame(header, payload))


@settings(max_examples=EXAMPLES)
@given(st.sampled_from(sorted(SCHEMAS)), tensor_specs, st.binary(max_size=64), st.integers(0, 2**32 - 1))
def test_lying_lengths_and_tensor_descriptions_are_refused(kind, spec, payload, declared):
    header = {"kind": kind, "sid": "s", "seq": 1, "layer": 0, "start": 0, "sample": False, "epoch": 1,
              "plan": 1, "token": None, "code": "c", "message": "m", "node": None, "tensor": spec}
    decodes_or_refuses(frame(header, payload))
    decodes_or_refuses(frame(header, payload, declared_length=declared))


def test_a_huge_declared_shape_is_refused_without_allocating():
    header = {"kind": "step", "sid": "s", "seq": 1, "layer": 0, "start": 0, "sample": False, "epoch": 1, "plan": 1,
              "reply": "n", "reply_url": "https://127.0.0.1:1", "tensor": {"dtype": "float32", "shape": [2**31, 2**31, 2**31]}}
    try:
        decode_frame(frame(header, np.zeros(4, np.float32).tobytes()))
    except WireError as error:
        assert "needs" in str(error)
    else:
        raise AssertionError("a frame promising exabytes was accepted")


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=10),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=6),
                           max_leaves=20)
ADVERT_KEYS = ["node_id", "cluster", "api_port", "version", "role", "capacity", "orchestrator", "epoch",
               "configured_orchestrator", "id", "vram_gib", "ram_gib", "npu_tops", "latency_ms", "load"]
advert_like = st.dictionaries(st.sampled_from(ADVERT_KEYS), json_values | st.dictionaries(
    st.sampled_from(ADVERT_KEYS), json_values, max_size=8), max_size=10)


@settings(max_examples=EXAMPLES)
@given(json_values | advert_like)
def test_describe_adverts_parse_or_are_refused(data):
    try:
        NodeAdvert.from_json(data)
    except WireError:
        pass


TXT_KEYS = ["id", "cl", "port", "v", "role", "cap", "cfg", "orc", "ep"]


@settings(max_examples=EXAMPLES)
@given(st.dictionaries(st.sampled_from(TXT_KEYS) | st.binary(max_size=4),
                       st.none() | st.binary(max_size=40) | st.text(max_size=40)))
def test_mdns_txt_records_parse_or_are_refused(properties):
    try:
        decode_txt(properties)
    except WireError:
        pass


ORDER_KEYS = ["epoch", "orchestrator", "plan_version", "model", "total_layers", "route", "addresses",
              "weight_sources", "plan", "degraded", "standby", "name", "max_context", "prefill_chunk"]


@settings(max_examples=EXAMPLES)
@given(st.dictionaries(st.sampled_from(ORDER_KEYS), json_values, max_size=14))
def test_routing_orders_parse_or_are_refused(data):
    try:
        RoutingOrder.from_json(data)
    except WireError:
        pass
