import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from agent.core.errors import WireError
from agent.core.wire import ALLOWED_DTYPES, decode_frame, encode_frame

STEP = {"kind": "step", "sid": "s1", "seq": 3, "layer": 0, "start": 7, "sample": True, "epoch": 1, "plan": 2,
        "reply": "node-0", "reply_url": "https://127.0.0.1:7000"}


@given(hnp.arrays(st.sampled_from(sorted(ALLOWED_DTYPES)), hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=6)))
def test_tensor_round_trip_is_exact(array):
    header, tensor = decode_frame(encode_frame(STEP, array))
    assert header["sid"] == "s1" and tensor.dtype == array.dtype and tensor.shape == array.shape
    assert np.array_equal(tensor, array, equal_nan=array.dtype.kind == "f")


def test_decoded_tensor_is_a_view_of_the_frame():
    frame = encode_frame(STEP, np.arange(12, dtype=np.float32).reshape(1, 3, 4))
    _, tensor = decode_frame(frame)
    assert not tensor.flags.owndata


def test_messages_without_tensor():
    header, tensor = decode_frame(encode_frame({"kind": "result", "sid": "s", "seq": 1, "token": 42}))
    assert header["token"] == 42 and tensor is None
    header, _ = decode_frame(encode_frame({"kind": "error", "sid": "s", "seq": 1, "code": "x", "message": "m", "node": None}))
    assert header["node"] is None


def test_length_mismatch_is_rejected():
    frame = encode_frame(STEP, np.zeros((1, 4), dtype=np.float32))
    with pytest.raises(WireError, match="needs 16 bytes, frame carries 12"):
        decode_frame(frame[:-4])
    with pytest.raises(WireError, match="needs 16 bytes, frame carries 20"):
        decode_frame(frame + b"\0" * 4)


def test_disallowed_dtype_and_bad_headers():
    with pytest.raises(WireError, match="not allowed"):
        encode_frame(STEP, np.zeros(3, dtype=np.complex64))
    with pytest.raises(WireError, match="not allowed"):  # its bytes would be read back little-endian
        encode_frame(STEP, np.zeros(3, dtype=">f4"))
    with pytest.raises(WireError, match="bad magic"):
        decode_frame(b"HTTP/1.1 200 OK")
    with pytest.raises(WireError, match="missing 'reply'"):  # a step's outcome must have somewhere to go
        encode_frame({k: v for k, v in STEP.items() if k != "reply"}, np.zeros(3, dtype=np.float32))
    with pytest.raises(WireError, match="missing 'seq'"):
        encode_frame({"kind": "result", "sid": "s"})
    with pytest.raises(WireError, match="unknown frame kind"):
        encode_frame({"kind": "launch"})
    with pytest.raises(WireError, match="needs tensor"):
        encode_frame(STEP)
    with pytest.raises(WireError, match="field 'seq' must be int"):
        encode_frame({"kind": "result", "sid": "s", "seq": "1", "token": None})


@given(st.binary(max_size=256))
def test_garbage_never_crashes_the_decoder(data):
    try:
        decode_frame(b"NCM1" + data)
    except WireError:
        pass


def test_forged_tensor_description_is_rejected():
    import struct

    import msgpack

    header = dict(STEP, tensor={"dtype": "object", "shape": [1]})
    packed = msgpack.packb(header)
    with pytest.raises(WireError, match="dtype 'object' is not allowed"):
        decode_frame(b"NCM1" + struct.pack("<I", len(packed)) + packed + b"\0" * 8)
    header = dict(STEP, tensor={"dtype": "float32", "shape": [-1]})
    packed = msgpack.packb(header)
    with pytest.raises(WireError, match="shape"):
        decode_frame(b"NCM1" + struct.pack("<I", len(packed)) + packed)
    header = dict(STEP, tensor={"dtype": ["float32"], "shape": [1]})  # not even a name
    packed = msgpack.packb(header)
    with pytest.raises(WireError, match="is not allowed"):
        decode_frame(b"NCM1" + struct.pack("<I", len(packed)) + packed + b"\0" * 4)


def test_a_step_reusing_a_kept_session_and_a_close_that_keeps_one_read_back():
    from agent.core.protocol import CloseFrame, StepFrame

    step = StepFrame("s2", 0, 0, 40, 1, 2, False, reuse="s1").replying_to("node-0", "https://127.0.0.1:7000")
    header, _ = decode_frame(encode_frame(step.header(), np.zeros((1, 3), np.int64)))
    assert StepFrame.from_header(header) == step
    header, _ = decode_frame(encode_frame(CloseFrame("s1", 0, 2, keep=True).header()))
    assert header["keep"] is True and "keep" not in CloseFrame("s1", 0, 2).header()
    with pytest.raises(WireError):
        decode_frame(encode_frame({**CloseFrame("s1", 0, 2).header(), "keep": "yes"}))


def test_the_other_data_plane_frames_read_back():
    from agent.core.protocol import ErrorFrame, PingFrame, PongFrame

    error = ErrorFrame("s1", 4, "stage_faulty", "layers 2-3 computed NaN", "node-2")
    assert ErrorFrame.from_header(decode_frame(encode_frame(error.header()))[0]) == error
    ping = PingFrame(7)
    assert PingFrame.from_header(decode_frame(encode_frame(ping.header()))[0]).pong() == PongFrame(7)
    assert PongFrame.from_header(decode_frame(encode_frame(PongFrame(7).header()))[0]).cid == 7


def test_an_embedding_step_and_its_result_read_back():
    from agent.core.protocol import ResultFrame, StepFrame

    step = StepFrame("s3", 1, 0, 64, 1, 2, False, embed=True).replying_to("node-0", "https://127.0.0.1:7000")
    header, _ = decode_frame(encode_frame(step.header(), np.zeros((1, 3), np.int64)))
    assert StepFrame.from_header(header) == step and "embed" not in StepFrame("s3", 1, 0, 64, 1, 2, True).header()
    vector = np.linspace(-1, 1, 576, dtype=np.float32)
    result = ResultFrame.from_header(decode_frame(encode_frame(ResultFrame("s3", 1, None, embedding=vector).header()))[0])
    assert result.token is None and np.array_equal(result.embedding, vector)
    for bad in (b"\0" * 6, b"\0" * (4 * 65536 + 4), [1.0, 2.0]):
        with pytest.raises(WireError, match="embedding"):
            decode_frame(encode_frame({**ResultFrame("s3", 1, None).header(), "embedding": bad}))
