"""The RKNN worker (shards/providers/rknn_worker.py), the script ncm runs in the converter's
environment: its frames (an 8-byte little-endian length, then an .npz; a property), its
one-line failures, its command line, and, run as a process by the real client
(shards.providers.rknn: convert, RknnSession on the simulator):

- without rknn-toolkit2 (this environment): one line naming the missing toolkit, not ncm's own
  rknn.py, which the worker keeps off its import path;
- with a stand-in toolkit written here (the RKNN class's calls the worker makes, logged; its
  "simulator" runs the graph with onnxruntime, and it chatters on standard output from Python
  and through the file descriptor, as the real one does): what the worker asks of the toolkit
  (fp16, no quantisation, the target), each refusal as one tagged line, frames kept apart from
  the chatter, requests answered in order, a failed one answered with its error while the
  worker goes on, and the end of input ending it;
- with the real toolkit (the `.venv-rknn` `./dev test` makes; skipped with the reason
  without it): a tiny graph converted, and run on its simulator within fp16's precision.
"""

from __future__ import annotations

import importlib.util
import io
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from onnx import TensorProto, helper, numpy_helper

from shards.errors import RknnConversionError, RknnUnavailableError
from shards.providers import rknn_worker
from shards.providers.rknn import WORKER_SCRIPT, RknnSession, convert, converter_python, rknn_path
from tests.examples import examples

_PROPS = settings(max_examples=examples(100), deadline=None)
NOT_INSTALLED = "rknn: rknn-toolkit2 is not installed in this environment: No module named 'rknn'"
RUN_TIMEOUT_S = 60
without_toolkit = pytest.mark.skipif(importlib.util.find_spec("rknn") is not None,
                                     reason="rknn-toolkit2 is installed in ncm's own environment")

# A stand-in for rknn-toolkit2's rknn.api.RKNN: the calls the worker makes, logged as JSON lines
# to $FAKE_RKNN_LOG; $FAKE_RKNN_FAIL names the one that fails; its simulator is onnxruntime.
FAKE_TOOLKIT = '''
import json, os, sys

import numpy as np

_FAIL = os.environ.get("FAKE_RKNN_FAIL", "")


def _record(call, **args):
    with open(os.environ["FAKE_RKNN_LOG"], "a") as log:
        log.write(json.dumps({"call": call, **args}) + "\\n")


def _chatter(what):
    sys.stdout.write(f"I RKNN: {what}\\n")  # the toolkit's progress, on standard output
    sys.stdout.flush()
    os.write(1, f"D RKNN: {what} (from C)\\n".encode())


class RKNN:
    def __init__(self, verbose=False):
        _record("RKNN", verbose=verbose)
        _chatter("toolkit loaded")

    def config(self, target_platform=None, float_dtype=None, **kwargs):
        _record("config", target_platform=target_platform, float_dtype=float_dtype)
        return -1 if _FAIL == "config" else 0

    def load_onnx(self, model):
        _record("load_onnx", model=model)
        self._model = model
        return -1 if _FAIL == "load_onnx" else 0

    def build(self, do_quantization=True, **kwargs):
        _record("build", do_quantization=do_quantization)
        sys.stderr.write("E RKNN: Unsupported op GroupQueryAttention\\n")
        return -1 if _FAIL == "build" else 0

    def export_rknn(self, path):
        _record("export_rknn", path=path)
        if _FAIL == "export_rknn":
            return -1
        with open(self._model, "rb") as graph, open(path, "wb") as out:
            out.write(b"FAKE-RKNN" + graph.read())
        return 0

    def init_runtime(self, target=None, **kwargs):
        _record("init_runtime", target=target)
        if _FAIL == "init_runtime":
            return -1
        import onnxruntime

        self._session = onnxruntime.InferenceSession(self._model, providers=["CPUExecutionProvider"])
        return 0

    def inference(self, inputs=None, data_format=None):
        _record("inference", shapes=[list(i.shape) for i in inputs], data_format=data_format)
        _chatter("inference")
        if _FAIL == "inference":
            return None
        names = [i.name for i in self._session.get_inputs()]
        return self._session.run(None, dict(zip(names, inputs)))

    def release(self):
        _record("release")
'''


# --- frames -------------------------------------------------------------------------------------
_arrays = st.lists(st.sampled_from([np.float32, np.float16, np.int64, np.uint8]).flatmap(
    lambda dtype: arrays(dtype, st.lists(st.integers(0, 5), max_size=4).map(tuple))), max_size=4)


@_PROPS
@given(frames=st.lists(_arrays, min_size=1, max_size=3))
def test_frames_are_a_little_endian_length_then_an_npz_read_back_in_order(frames) -> None:
    stream = io.BytesIO()
    for inputs in frames:
        rknn_worker._write_frame(stream, {str(i): a for i, a in enumerate(inputs)})
    raw = stream.getvalue()
    stream.seek(0)
    offset = 0
    for inputs in frames:
        (length,) = struct.unpack_from("<Q", raw, offset)
        payload = rknn_worker._read_frame(stream)
        assert payload == raw[offset + 8:offset + 8 + length]
        offset += 8 + length
        with np.load(io.BytesIO(payload)) as data:
            assert data.files == [str(i) for i in range(len(inputs))]
            for i, want in enumerate(inputs):
                got = data[str(i)]
                assert got.dtype == want.dtype and got.shape == want.shape
                np.testing.assert_array_equal(got, want)
    assert offset == len(raw) and rknn_worker._read_frame(stream) is None


@pytest.mark.parametrize("cut", range(8))
def test_a_header_cut_short_reads_as_the_end_of_input(cut) -> None:
    assert rknn_worker._read_frame(io.BytesIO(struct.pack("<Q", 3)[:cut])) is None


# --- failures and the command line -------------------------------------------------------------------
@pytest.mark.parametrize("detail, line", [
    (None, "rknn: cannot write out.rknn"),
    ("   \n", "rknn: cannot write out.rknn"),
    (OSError("disk full"), "rknn: cannot write out.rknn: disk full"),
    ("Traceback (most recent call last):\n  File x\nValueError: no space\n\n",
     "rknn: cannot write out.rknn: ValueError: no space"),
])
def test_a_failure_is_one_tagged_line_on_stderr_and_exit_status_1(capsys, detail, line) -> None:
    with pytest.raises(SystemExit) as exited:
        rknn_worker._fail("cannot write out.rknn", detail)
    captured = capsys.readouterr()
    assert exited.value.code == 1 and captured.err == line + "\n" and captured.out == ""


@pytest.mark.parametrize("argv", [[], ["convert", "fragment.onnx"], ["simulate"], ["export", "a", "b"]])
def test_a_command_line_without_its_arguments_is_a_usage_error(capsys, argv) -> None:
    with pytest.raises(SystemExit) as exited:
        rknn_worker.main(argv)
    assert exited.value.code == 2 and "usage: rknn_worker" in capsys.readouterr().err


@without_toolkit
def test_a_command_without_the_toolkit_fails_in_one_line(capsys, tmp_path) -> None:
    with pytest.raises(SystemExit) as exited:
        rknn_worker.main(["convert", str(tmp_path / "fragment.onnx"), str(tmp_path / "out.rknn")])
    assert exited.value.code == 1 and capsys.readouterr().err == NOT_INSTALLED + "\n"
    assert not (tmp_path / "out.rknn").exists()


# --- the worker as a process ------------------------------------------------------------------------
@pytest.fixture
def graph(tmp_path) -> Path:
    """A static graph of two inputs and two outputs: z = x @ w + b, y = x @ w."""
    w = numpy_helper.from_array(np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32), "w")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["z"])], "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [1, 3, 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 3, 4]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 4])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder = tmp_path / "fragment-dir"
    folder.mkdir()
    onnx.save(model, folder / "fragment.onnx")
    return folder / "fragment.onnx"


def feeds(seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"b": rng.normal(size=(1, 3, 4)).astype(np.float32), "x": rng.normal(size=(1, 3, 8)).astype(np.float32)}


def onnxruntime_outputs(graph: Path, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"]).run(None, inputs)


def worker(*args: str, env: dict[str, str] | None = None, stdin: bytes = b"") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WORKER_SCRIPT), *args], input=stdin, capture_output=True,
                          env=env, timeout=RUN_TIMEOUT_S)


@without_toolkit
def test_without_the_toolkit_the_worker_names_it_and_not_ncms_own_rknn_module(graph) -> None:
    """Run from its folder, the worker would otherwise import shards/providers/rknn.py as
    ``rknn`` and fail on ``rknn.api`` instead."""
    done = worker("convert", str(graph), str(graph.with_suffix(".rknn")))
    assert done.returncode == 1 and done.stderr.decode().splitlines()[-1] == NOT_INSTALLED
    assert done.stdout == b"" and not graph.with_suffix(".rknn").exists()
    with pytest.raises(RknnConversionError) as refused:
        convert(graph, "rk3588", python=sys.executable)
    assert str(refused.value) == f"fragment-dir: {NOT_INSTALLED}"
    assert list(graph.parent.iterdir()) == [graph]  # no .rknn, no temporary file left


@without_toolkit
def test_without_the_toolkit_the_simulator_does_not_start_and_says_why(graph) -> None:
    done = worker("simulate", str(graph))
    assert done.returncode == 1 and done.stdout == b"" and done.stderr.decode().splitlines()[-1] == NOT_INSTALLED
    with pytest.raises(RknnConversionError) as refused:
        RknnSession(graph, runtime="simulator", python=sys.executable)
    assert str(refused.value) == f"fragment-dir on the RKNN simulator: {NOT_INSTALLED}"


@pytest.fixture
def toolkit(tmp_path, monkeypatch) -> Path:
    """The stand-in toolkit on the import path of the processes started from here; returns its log."""
    package = tmp_path / "fake-toolkit" / "rknn" / "api"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text(FAKE_TOOLKIT)
    log = tmp_path / "toolkit.log"
    log.touch()
    monkeypatch.setenv("PYTHONPATH", str(package.parent.parent))
    monkeypatch.setenv("FAKE_RKNN_LOG", str(log))
    monkeypatch.delenv("FAKE_RKNN_FAIL", raising=False)
    return log


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_convert_asks_the_toolkit_for_fp16_without_quantisation_and_writes_its_file(graph, toolkit) -> None:
    out = convert(graph, "rk3576", python=sys.executable)
    assert out == rknn_path(graph, "rk3576") and out.read_bytes() == b"FAKE-RKNN" + graph.read_bytes()
    made = calls(toolkit)
    assert [c["call"] for c in made] == ["RKNN", "config", "load_onnx", "build", "export_rknn", "release"]
    assert made[0]["verbose"] is False
    assert (made[1]["target_platform"], made[1]["float_dtype"]) == ("rk3576", "float16")
    assert made[2]["model"] == str(graph) and made[3]["do_quantization"] is False
    assert Path(made[4]["path"]).parent == graph.parent and made[4]["path"] != str(out)  # written aside, then moved
    assert sorted(p.name for p in graph.parent.iterdir()) == ["fragment.onnx", "fragment.rk3576.rknn"]
    assert convert(graph, "rk3576", python=sys.executable) == out and len(calls(toolkit)) == len(made)  # cached


@pytest.mark.parametrize("failing, line", [
    ("config", "rknn: the toolkit does not take target 'rk3588'"),
    ("load_onnx", "rknn: the converter cannot load fragment.onnx (the toolkit's log above says why)"),
    ("build", "rknn: the converter refused fragment.onnx for rk3588 (the toolkit's log above says why)"),
    ("export_rknn", "rknn: cannot write "),
])
def test_each_refusal_of_the_toolkit_is_one_tagged_line(graph, toolkit, monkeypatch, failing, line) -> None:
    monkeypatch.setenv("FAKE_RKNN_FAIL", failing)
    done = worker("convert", str(graph), str(graph.parent / "out.rknn"))
    tagged = [x for x in done.stderr.decode().splitlines() if x.startswith("rknn: ")]
    assert done.returncode == 1 and len(tagged) == 1 and tagged[0].startswith(line)
    assert calls(toolkit)[-1]["call"] == failing  # nothing asked of the toolkit after it refused
    with pytest.raises(RknnConversionError) as refused:
        convert(graph, "rk3588", python=sys.executable)
    assert str(refused.value).startswith(f"fragment-dir: {line}") and "\n" not in str(refused.value)
    assert sorted(p.name for p in graph.parent.iterdir()) == ["fragment.onnx"]


def frames(raw: bytes) -> list[dict[str, np.ndarray]]:
    """Every frame of a worker's standard output (AssertionError on anything else in it)."""
    stream, out = io.BytesIO(raw), []
    while (payload := rknn_worker._read_frame(stream)) is not None:
        assert len(payload) == struct.unpack("<Q", raw[stream.tell() - len(payload) - 8:][:8])[0]
        with np.load(io.BytesIO(payload)) as data:
            out.append({name: data[name] for name in data.files})
    assert stream.tell() == len(raw), "bytes other than frames on the worker's standard output"
    return out


def request(inputs: list[np.ndarray]) -> bytes:
    stream = io.BytesIO()
    rknn_worker._write_frame(stream, {str(i): a for i, a in enumerate(inputs)})
    return stream.getvalue()


def test_the_simulator_answers_each_request_in_order_and_ends_with_its_input(graph, toolkit) -> None:
    good, other = feeds(1), feeds(2)
    bad = [np.zeros((1, 2, 8), np.float32), good["b"]]  # a shape the graph does not take
    stdin = request([good["x"], good["b"]]) + request(bad) + request([other["x"], other["b"]])
    done = worker("simulate", str(graph), "--target", "rk3576", stdin=stdin)
    assert done.returncode == 0, done.stderr.decode()
    answers = frames(done.stdout)  # the toolkit's chatter went to standard error
    assert "I RKNN: inference" in done.stderr.decode() and "D RKNN: inference (from C)" in done.stderr.decode()
    assert [sorted(a) for a in answers] == [["ready"], ["0", "1"], ["error"], ["0", "1"]]
    for answer, inputs in ((answers[1], good), (answers[3], other)):
        for i, want in enumerate(onnxruntime_outputs(graph, inputs)):  # in the graph's output order: z, y
            np.testing.assert_array_equal(answer[str(i)], want)
    assert answers[2]["error"].shape == () and str(answers[2]["error"]).startswith(
        "InvalidArgument: [ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions for input: x")
    made = calls(toolkit)
    assert [c["call"] for c in made] == ["RKNN", "config", "load_onnx", "build", "init_runtime", "inference",
                                         "inference", "inference", "release"]
    assert made[1]["target_platform"] == "rk3576" and made[4]["target"] is None  # no board: the simulator
    assert made[5] == {"call": "inference", "shapes": [[1, 3, 8], [1, 3, 4]], "data_format": ["nchw", "nchw"]}


def test_a_session_on_the_simulator_runs_like_onnxruntime_and_survives_a_failed_request(graph, toolkit) -> None:
    session = RknnSession(graph, runtime="simulator", python=sys.executable)
    try:
        assert [o.name for o in session.get_outputs()] == ["z", "y"] and session.get_providers() == ["RKNN"]
        inputs = feeds(3)
        z, y = onnxruntime_outputs(graph, inputs)
        got = session.run(None, inputs)
        np.testing.assert_array_equal(got[0], z)
        np.testing.assert_array_equal(got[1], y)
        with pytest.raises(RknnConversionError, match=r"^the RKNN simulator failed: InvalidArgument: "):
            session.run(None, {"x": np.zeros((1, 5, 8), np.float32), "b": inputs["b"]})
        (only_y,) = session.run(["y"], inputs)  # the worker went on
        np.testing.assert_array_equal(only_y, y)
    finally:
        session.close()
    assert session._backend._process.returncode is not None


@pytest.mark.parametrize("failing, message", [
    ("init_runtime", "fragment-dir on the RKNN simulator: rknn: the simulator did not start"),
    ("inference", "the RKNN simulator failed: RuntimeError: the simulator returned no outputs (see its log)"),
])
def test_a_simulator_that_fails_says_so_in_one_line(graph, toolkit, monkeypatch, failing, message) -> None:
    monkeypatch.setenv("FAKE_RKNN_FAIL", failing)
    if failing == "init_runtime":
        with pytest.raises(RknnConversionError) as refused:
            RknnSession(graph, runtime="simulator", python=sys.executable)
    else:
        session = RknnSession(graph, runtime="simulator", python=sys.executable)
        try:
            with pytest.raises(RknnConversionError) as refused:
                session.run(None, feeds())
        finally:
            session.close()
    assert str(refused.value) == message


# --- with the real toolkit ------------------------------------------------------------------------------
def _converter() -> str | None:
    try:
        return converter_python()
    except RknnUnavailableError:
        return None


@pytest.mark.skipif(_converter() is None, reason="no RKNN converter environment (rknn-toolkit2): "
                                                 "`./dev test` makes .venv-rknn")
def test_the_real_toolkit_converts_a_graph_and_its_simulator_runs_it_within_fp16(graph, monkeypatch) -> None:
    for name in ("PYTHONPATH", "FAKE_RKNN_LOG", "FAKE_RKNN_FAIL"):
        monkeypatch.delenv(name, raising=False)
    converted = convert(graph, "rk3588")
    assert converted == rknn_path(graph, "rk3588") and converted.stat().st_size > 0
    session = RknnSession(graph, runtime="simulator")
    try:
        inputs = feeds(4)
        for got, want in zip(session.run(None, inputs), onnxruntime_outputs(graph, inputs)):
            assert got.dtype == np.float32 and got.shape == want.shape
            assert np.abs(got - want).max() <= 5e-3 * np.abs(want).max()
    finally:
        session.close()
