"""Fragments on Rockchip NPUs (RK3588, RK3576) through RKNN.

onnxruntime has no execution provider for these NPUs. Their path is Rockchip's own:

- **Conversion** (``rknn-toolkit2``): a fragment's *static* flavour (plain opset-17 ops,
  fixed shapes: ``prefill_chunk`` tokens per run, ``max_context`` KV slots as inputs, the
  chunk's new keys and values as outputs) becomes an ``.rknn`` file in fp16. The static
  flavour is the layout the converter takes whole: it has no GroupQueryAttention or
  MatMulNBits, and with the cache as fixed-shape inputs and only the chunk's keys and values
  as outputs, the runner writes them into its cache itself, so no graph op scatters into a
  cache (a ScatterND the NPU would run on the CPU). The file is cached next to the fragment's
  ONNX file, in the directory keyed by builder version, weights, range, context and chunk, so a
  re-plan reuses it. The toolkit pins old numpy, onnx and protobuf: it runs in an environment
  of its own (``./dev`` makes ``.venv-rknn``), found by :func:`converter_python`, as a
  subprocess running :mod:`shards.providers.rknn_worker`.
- **Running**, on the board: ``rknn-toolkit-lite2`` (``rknnlite``) loads the ``.rknn`` file on
  the NPU through ``librknnrt.so``, on the cores ``core_mask`` names (``auto``, or ``0_1_2``:
  the RK3588's three together). Elsewhere the toolkit's **simulator** runs the converted
  fragment on the CPU of an x86 machine: the tests check the NPU's numerics with it (its
  speed means nothing).

:class:`RknnSession` gives :class:`~shards.runtime.ort_runner.OrtFragmentRunner` what it uses of an
onnxruntime session, so a fragment on an RKNN backend (:mod:`shards.providers.backends`) is run, its
KV cache kept and its chunks padded exactly as on any other static-flavour backend.
"""

from __future__ import annotations

import collections
import ctypes
import importlib.util
import io
import logging
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from shards.errors import RknnConversionError, RknnUnavailableError

log = logging.getLogger(__name__)

RKNN = "RKNN"  # the provider of RKNN backends (not an onnxruntime provider)
TARGETS = ("rk3588", "rk3576")
CONVERTER_PYTHON_ENV = "NCM_RKNN_PYTHON"  # interpreter of an environment with rknn-toolkit2
CONVERTER_VENV_SUFFIX = "-rknn"  # ./dev's converter environment: next to ncm's, this suffix added
WORKER_SCRIPT = Path(__file__).with_name("rknn_worker.py")
RUNTIME_LIBRARY = "librknnrt.so"
CONVERT_TIMEOUT_S = 1800.0
_LENGTH = struct.Struct("<Q")


def converter_python() -> str:
    """The interpreter of the converter's environment: $NCM_RKNN_PYTHON, else the
    environment next to this one named with :data:`CONVERTER_VENV_SUFFIX` (``.venv-rknn``)."""
    configured = os.environ.get(CONVERTER_PYTHON_ENV)
    if configured:
        if not Path(configured).is_file():
            raise RknnUnavailableError(f"{CONVERTER_PYTHON_ENV}={configured} does not exist")
        return configured
    sibling = Path(sys.prefix).with_name(Path(sys.prefix).name + CONVERTER_VENV_SUFFIX) / "bin" / "python"
    if sibling.is_file():
        return str(sibling)
    raise RknnUnavailableError(f"no RKNN converter: set {CONVERTER_PYTHON_ENV} to the Python of an environment "
                               f"with rknn-toolkit2 (`./dev test` makes {sibling.parent.parent.name})")


def has_converter() -> bool:
    """Whether :func:`converter_python` finds the converter's environment."""
    try:
        converter_python()
    except RknnUnavailableError:
        return False
    return True


def _check_target(target: str) -> str:
    if target not in TARGETS:
        raise RknnUnavailableError(f"RKNN target {target!r} is not one ncm converts for ({', '.join(TARGETS)})")
    return target


def rknn_path(onnx_path: Path, target: str) -> Path:
    """Where the ``.rknn`` file of a fragment lives: next to its ONNX file."""
    return Path(onnx_path).with_name(f"{Path(onnx_path).stem}.{_check_target(target)}.rknn")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    tagged = [line for line in lines if line.startswith("rknn: ")]
    return (tagged or lines or ["no message"])[-1]


def convert(onnx_path: Path, target: str = "rk3588", *, python: str | None = None,
            timeout_s: float = CONVERT_TIMEOUT_S) -> Path:
    """The ``.rknn`` file of a static-flavour fragment for ``target`` (converted once, then
    reused); RknnConversionError with the converter's own line when it refuses the graph."""
    out = rknn_path(onnx_path, target)
    if out.is_file():
        return out
    python = python or converter_python()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        result = subprocess.run([python, str(WORKER_SCRIPT), "convert", str(onnx_path), str(tmp), "--target", target],
                                capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0 or not tmp.is_file():
            raise RknnConversionError(f"{Path(onnx_path).parent.name}: {_last_line(result.stderr + result.stdout)}")
        os.replace(tmp, out)
    except subprocess.TimeoutExpired:
        raise RknnConversionError(f"converting {Path(onnx_path).parent.name} took over {timeout_s:g} s") from None
    finally:
        tmp.unlink(missing_ok=True)
    log.info("converted %s for %s", Path(onnx_path).parent.name, target)
    return out


# --- where RKNN can run -----------------------------------------------------------------------
def board_target(compatible_path: Path = Path("/proc/device-tree/compatible")) -> str | None:
    """The RKNN target of this board ("rk3588", "rk3576"), from its device tree; None elsewhere."""
    try:
        compatible = compatible_path.read_bytes().decode("ascii", "replace")
    except OSError:
        return None
    return next((t for t in TARGETS if f"rockchip,{t}" in compatible), None)


def lite_runtime_problem() -> str | None:
    """Why ``rknnlite`` cannot reach the NPU here (one line), None when it can try."""
    if importlib.util.find_spec("rknnlite") is None:
        return "rknn-toolkit-lite2 (rknnlite) is not installed"
    try:
        ctypes.CDLL(RUNTIME_LIBRARY)
    except OSError:
        return f"{RUNTIME_LIBRARY} (Rockchip's RKNN runtime) is not installed: the NPU cannot be reached"
    return None


# --- sessions -------------------------------------------------------------------------------------
class _Name:
    def __init__(self, name: str) -> None:
        self.name = name


class RknnSession:
    """A converted fragment on the NPU (``runtime="npu"``, through ``rknnlite``) or on the
    toolkit's simulator (``runtime="simulator"``), with the run() of an onnxruntime session."""

    def __init__(self, onnx_path: Path, *, runtime: str = "npu", target: str = "rk3588", core_mask: str = "auto",
                 python: str | None = None) -> None:
        import onnx

        graph = onnx.load(str(onnx_path), load_external_data=False).graph
        self._inputs = [i.name for i in graph.input]
        self._outputs = [o.name for o in graph.output]
        self.runtime = runtime
        if runtime == "simulator":
            self._backend: _Simulator | _Lite = _Simulator(onnx_path, _check_target(target), python or converter_python())
        elif runtime == "npu":
            problem = lite_runtime_problem()
            if problem is not None:
                raise RknnUnavailableError(problem)
            self._backend = _Lite(convert(onnx_path, target, python=python), core_mask)
        else:
            raise RknnUnavailableError(f"unknown RKNN runtime {runtime!r} (npu or simulator)")

    def get_outputs(self) -> list[_Name]:
        return [_Name(name) for name in self._outputs]

    def get_providers(self) -> list[str]:
        return [RKNN]

    def run(self, output_names: Sequence[str] | None, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        outputs = self._backend.run([np.ascontiguousarray(feeds[name]) for name in self._inputs])
        if len(outputs) != len(self._outputs):
            raise RknnConversionError(f"the {self.runtime} returned {len(outputs)} outputs, the fragment has "
                                      f"{len(self._outputs)}")
        named = dict(zip(self._outputs, outputs))
        return [named[name] for name in (output_names or self._outputs)]

    def close(self) -> None:
        self._backend.close()


class _Lite:
    def __init__(self, path: Path, core_mask: str) -> None:
        from rknnlite.api import RKNNLite

        self._rknn = RKNNLite(verbose=False)
        if self._rknn.load_rknn(str(path)) != 0:
            raise RknnConversionError(f"rknnlite cannot load {path.name} (converted by another toolkit version?)")
        mask = getattr(RKNNLite, f"NPU_CORE_{core_mask.upper()}", None)
        if mask is None:
            raise RknnUnavailableError(f"unknown NPU core mask {core_mask!r} (auto, 0, 1, 2, 0_1, 0_1_2)")
        if self._rknn.init_runtime(core_mask=mask) != 0:
            raise RknnUnavailableError("the RKNN runtime could not start on the NPU (driver missing or older than "
                                       "the runtime: see `dmesg | grep -i rknpu`)")

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        outputs = self._rknn.inference(inputs=inputs, data_format=["nchw"] * len(inputs))
        if outputs is None:
            raise RknnConversionError("the NPU returned no outputs")
        return [np.asarray(o, dtype=np.float32) for o in outputs]

    def close(self) -> None:
        self._rknn.release()


class _Simulator:
    """The worker process holding the simulator (see :mod:`shards.providers.rknn_worker`)."""

    def __init__(self, onnx_path: Path, target: str, python: str) -> None:
        self._process = subprocess.Popen([python, str(WORKER_SCRIPT), "simulate", str(onnx_path), "--target", target],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # The toolkit's log, drained all along (a full pipe would stall it); the end is kept.
        self._log: collections.deque[bytes] = collections.deque(maxlen=200)
        self._drain = threading.Thread(target=self._drain_log, name="rknn-simulator-log", daemon=True)
        self._drain.start()
        ready = self._read()
        if ready is None or "ready" not in ready:
            self.close()
            raise RknnConversionError(f"{Path(onnx_path).parent.name} on the RKNN simulator: {self._last_log_line()}")

    def _drain_log(self) -> None:
        assert self._process.stderr is not None
        for line in self._process.stderr:
            self._log.append(line)

    def _last_log_line(self) -> str:
        self._drain.join(timeout=10)
        return _last_line(b"".join(self._log).decode(errors="replace"))

    def _read(self) -> dict[str, np.ndarray] | None:
        assert self._process.stdout is not None
        head = self._process.stdout.read(_LENGTH.size)
        if len(head) < _LENGTH.size:
            self._process.wait(timeout=30)
            return None
        (length,) = _LENGTH.unpack(head)
        with np.load(io.BytesIO(self._process.stdout.read(length))) as data:
            return {name: data[name] for name in data.files}

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        assert self._process.stdin is not None
        buffer = io.BytesIO()
        np.savez(buffer, **{str(i): array for i, array in enumerate(inputs)})
        try:
            self._process.stdin.write(_LENGTH.pack(len(buffer.getvalue())) + buffer.getvalue())
            self._process.stdin.flush()
        except (BrokenPipeError, OSError):
            raise RknnConversionError("the RKNN simulator stopped") from None
        answer = self._read()
        if answer is None:
            raise RknnConversionError(f"the RKNN simulator stopped: {self._last_log_line()}")
        if "error" in answer:
            raise RknnConversionError(f"the RKNN simulator failed: {answer['error']}")
        return [answer[str(i)].astype(np.float32, copy=False) for i in range(len(answer))]

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait(timeout=30)
        for stream in (self._process.stdin, self._process.stdout):
            if stream is not None:
                stream.close()

