"""Execution backends: which onnxruntime execution provider runs a fragment, with which
options, on which device, and in which fragment flavour.

A provider's name is not enough: the QNN provider reaches the Hexagon NPU only with the HTP
library as ``backend_path``, and the OpenVINO provider runs on the CPU unless it is given a
``device_type``. :func:`backend_chain` turns what this machine has (a :class:`Platform`,
found by :func:`detect_platform`) into the backends to try, best first, CPU always last, and
says why each accelerator it cannot use is unusable. The runner tries them in order and
falls back, with a warning, when one cannot load a fragment.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from shards.errors import RunnerError
from shards.providers.rknn import RKNN, RknnSession, board_target, has_converter, lite_runtime_problem

log = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"
OPENVINO = "OpenVINOExecutionProvider"
QNN = "QNNExecutionProvider"
KINDS = ("gpu", "npu", "cpu")
FLAVOURS = ("cpu", "gpu", "portable", "static")


@dataclass(frozen=True)
class Backend:
    """One way to run fragments: a provider with its options, on a device kind, in a flavour."""

    name: str  # "cuda", "openvino-npu", "qnn-htp", "cpu", ...
    provider: str  # onnxruntime execution provider
    kind: str  # "gpu", "npu" or "cpu": what the capacity score credits it to
    flavour: str  # fragment flavour: "cpu" (fused), "gpu" (fused, float16), "portable" (plain ops), "static" (fixed shapes)
    options: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.flavour not in FLAVOURS:
            raise ValueError(f"backend {self.name}: kind must be one of {KINDS}, flavour one of {FLAVOURS}")

    def providers(self) -> list[str | tuple[str, dict[str, str]]]:
        """What onnxruntime is given: this provider, then the CPU for the nodes it lacks."""
        if self.provider == CPU:
            return [CPU]
        helper = [(CUDA, dict(self.options))] if self.provider == TENSORRT else []  # the ops TensorRT lacks (attention)
        return [(self.provider, dict(self.options)), *helper, CPU]

    def describe(self) -> dict[str, object]:
        return {"backend": self.name, "provider": self.provider, "kind": self.kind, "options": dict(self.options)}


@dataclass(frozen=True)
class Unusable:
    """An accelerator this machine has a provider for but cannot use, and why."""

    name: str
    provider: str
    reason: str


@dataclass(frozen=True)
class Platform:
    """What the machine offers (pure input of :func:`backend_chain`)."""

    providers: tuple[str, ...]
    openvino_devices: tuple[str, ...] = ()  # as OpenVINO names them: "CPU", "GPU", "GPU.1", "NPU"
    qnn_htp_library: str | None = None
    rknn_target: str | None = None  # a Rockchip board with an NPU: "rk3588", "rk3576"
    rknn_problem: str | None = None  # why its NPU cannot be reached (None: rknnlite can try)
    rknn_converter: bool = False  # an environment with rknn-toolkit2 (conversion, and the simulator)


CPU_BACKEND = Backend("cpu", CPU, "cpu", "cpu")
QNN_LIBRARY = "libQnnHtp.so"


def _openvino(device: str) -> Backend:
    base = device.split(".")[0]
    kind = {"NPU": "npu", "GPU": "gpu"}.get(base, "cpu")
    # ACCURACY keeps float32 inference precision (the CPU plugin otherwise quantizes the
    # activations of 4-bit MatMulNBits to int8, about 5e-2 off); NPUs need fixed shapes.
    return Backend(f"openvino-{device.lower()}", OPENVINO, kind, "static" if kind == "npu" else "portable",
                   (("device_type", device), ("precision", "ACCURACY")))


def rknn_backend(target: str, runtime: str = "npu", core_mask: str = "auto") -> Backend:
    """Rockchip's NPU through RKNN (:mod:`shards.providers.rknn`): the static fragment converted to fp16;
    ``runtime="simulator"`` runs it on the toolkit's simulator instead (x86, for checks)."""
    name = f"rknn-{'sim' if runtime == 'simulator' else 'npu'}"
    return Backend(name, RKNN, "npu", "static", (("runtime", runtime), ("target", target), ("core_mask", core_mask)))


def backend_chain(platform: Platform, forced: Sequence[str] = ()) -> tuple[list[Backend], list[Unusable]]:
    """The backends to try, best first and CPU last, and the accelerators left out with why.

    ``forced`` (the `providers` setting) names backends ("openvino-cpu") or providers
    ("OpenVINOExecutionProvider": each of its usable backends); then only those are tried,
    then the CPU. Without it OpenVINO's CPU device is not used: the CPU provider's fused
    fragments are faster there, and the RKNN simulator ("rknn-sim") is not either.
    """
    available = set(platform.providers)
    usable: list[Backend] = []
    unusable: list[Unusable] = []
    if platform.rknn_target is not None:
        if platform.rknn_problem is None:
            usable.append(rknn_backend(platform.rknn_target))
        else:
            unusable.append(Unusable("rknn-npu", RKNN, platform.rknn_problem))
    for provider, name in ((TENSORRT, "tensorrt"), (CUDA, "cuda")):
        if provider in available:
            usable.append(Backend(name, provider, "gpu", "gpu", (("device_id", "0"),)))
    if QNN in available:
        if platform.qnn_htp_library:
            usable.append(Backend("qnn-htp", QNN, "npu", "static", (("backend_path", platform.qnn_htp_library),)))
        else:
            unusable.append(Unusable("qnn-htp", QNN, f"the QNN provider is installed but {QNN_LIBRARY} (the Hexagon NPU "
                                                 "backend) was not found next to onnxruntime or in $QNN_SDK_ROOT/lib"))
    if OPENVINO in available:
        devices = [d for d in platform.openvino_devices if d.split(".")[0] in ("NPU", "GPU")]
        usable += [_openvino(d) for d in sorted(devices, key=lambda d: (not d.startswith("NPU"), d))]
        for wanted in ("NPU", "GPU"):
            if not any(d.startswith(wanted) for d in platform.openvino_devices):
                unusable.append(Unusable(f"openvino-{wanted.lower()}", OPENVINO, f"OpenVINO reports no {wanted} device "
                                         f"(it sees: {', '.join(platform.openvino_devices) or 'none'})"))
    for provider, name, kind in (("DmlExecutionProvider", "directml", "gpu"), ("CoreMLExecutionProvider", "coreml", "npu")):
        if provider in available:
            usable.append(Backend(name, provider, kind, "portable"))
    if not forced:
        return usable + [CPU_BACKEND], unusable
    extra = [_openvino("CPU")] if OPENVINO in available and "CPU" in platform.openvino_devices else []
    if platform.rknn_converter:
        extra.append(rknn_backend(platform.rknn_target or "rk3588", runtime="simulator"))
    candidates = usable + extra
    chosen: list[Backend] = []
    for wanted in forced:
        matches = [b for b in candidates if wanted in (b.name, b.provider)]
        if not matches and wanted not in (CPU, CPU_BACKEND.name):
            reasons = [u.reason for u in unusable if wanted in (u.name, u.provider)]
            raise RunnerError(f"execution backend {wanted!r} is not usable here"
                              + (f": {'; '.join(reasons)}" if reasons else "")
                              + f" (usable: {', '.join(b.name for b in candidates) or 'none'}, cpu; "
                                f"onnxruntime providers: {', '.join(platform.providers)})")
        chosen += [b for b in matches if b not in chosen]
    return chosen + [CPU_BACKEND], unusable


# --- what this machine has ---------------------------------------------------------------
def _openvino_devices(capi_dir: Path) -> tuple[str, ...]:
    """OpenVINO's devices, asked of the C library that onnxruntime-openvino bundles (or of the
    `openvino` package when that is installed); () when neither answers."""
    try:
        import openvino  # type: ignore[import-not-found]

        return tuple(openvino.Core().available_devices)
    except Exception:  # noqa: BLE001 - optional package; fall back to the bundled C library
        pass
    library = capi_dir / "libopenvino_c.so"
    if not library.exists():
        return ()

    class Devices(ctypes.Structure):
        _fields_ = [("devices", ctypes.POINTER(ctypes.c_char_p)), ("size", ctypes.c_size_t)]

    try:
        lib = ctypes.CDLL(str(library))
        core, devices = ctypes.c_void_p(), Devices()
        if lib.ov_core_create(ctypes.byref(core)) != 0:
            return ()
        try:
            if lib.ov_core_get_available_devices(core, ctypes.byref(devices)) != 0:
                return ()
            found = tuple(devices.devices[i].decode() for i in range(devices.size))
            lib.ov_available_devices_free(ctypes.byref(devices))
            return found
        finally:
            lib.ov_core_free(core)
    except (OSError, AttributeError) as error:
        log.warning("cannot ask OpenVINO for its devices: %s", error)
        return ()


def _qnn_htp_library(capi_dir: Path) -> str | None:
    candidates = [capi_dir / QNN_LIBRARY]
    sdk = os.environ.get("QNN_SDK_ROOT")
    if sdk:
        candidates += sorted(Path(sdk).glob(f"lib/*/{QNN_LIBRARY}"))
    return next((str(p) for p in candidates if p.is_file()), None)


@lru_cache(maxsize=1)
def detect_platform() -> Platform:
    """What this machine's onnxruntime offers (asked once per process)."""
    import onnxruntime as ort

    providers = tuple(ort.get_available_providers())
    capi_dir = Path(ort.__file__).parent / "capi"
    target = board_target()
    return Platform(
        providers=providers,
        openvino_devices=_openvino_devices(capi_dir) if OPENVINO in providers else (),
        qnn_htp_library=_qnn_htp_library(capi_dir) if QNN in providers else None,
        rknn_target=target,
        rknn_problem=lite_runtime_problem() if target else None,
        rknn_converter=has_converter(),
    )


def _session(backend: Backend, model: Any) -> Any:
    """An onnxruntime session of ``model`` on ``backend`` (RunnerError if it cannot start)."""
    import onnxruntime as ort

    if backend.provider == RKNN:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="ncm-rknn-") as folder:  # converted, then opened
            path = Path(folder) / "block.onnx"
            path.write_bytes(model.SerializeToString())
            return RknnSession(path, **dict(backend.options))

    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=backend.providers())
    except Exception as failure:  # noqa: BLE001 - onnxruntime raises its own types
        raise RunnerError(f"{type(failure).__name__}: {str(failure).splitlines()[0] if str(failure) else ''}") from None
    if session.get_providers()[0] != backend.provider:
        raise RunnerError(f"onnxruntime could not start {backend.provider} with {dict(backend.options)}")
    return session


def _mlp(rows: int, weights: tuple[Any, Any]) -> Any:
    """A fixed-shape block Relu(x @ w1) @ w2 (fixed shapes suit NPUs too)."""
    from onnx import TensorProto, helper, numpy_helper

    w1, w2 = weights
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w2"], ["y"])], "ncm_calibration",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, w1.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, w2.shape[1]])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # readable by every onnxruntime ncm supports
    return model


def _weights(hidden: int, ffn: int) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    return ((rng.standard_normal((hidden, ffn)) / np.sqrt(hidden)).astype(np.float32),
            (rng.standard_normal((ffn, hidden)) / np.sqrt(ffn)).astype(np.float32))


def self_test(backend: Backend) -> str | None:
    """Run a small block on ``backend``: None when it runs there and computes right, else why
    not (one line). The capacity score credits an accelerator only after this passes."""
    import numpy as np

    w1, w2 = _weights(64, 128)
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    try:
        y = _session(backend, _mlp(4, (w1, w2))).run(None, {"x": x})[0]
    except RunnerError as error:
        return str(error)
    error_max = float(np.abs(y - np.maximum(x @ w1, 0.0) @ w2).max())
    return None if error_max < 1e-2 else f"wrong results (max error {error_max:.3g})"


@dataclass(frozen=True)
class Calibration:
    """What a backend measured on the built-in block (a layer's MLP of hidden 1024, FFN 4096)."""

    backend: str
    kind: str  # "gpu", "npu" or "cpu", as the backend's
    decode_ms: float  # one token
    prefill_ms: float  # a chunk of CALIBRATION_CHUNK tokens
    tops: float  # tera-operations per second in the prefill chunk (2 per multiply-add)

    def to_dict(self) -> dict[str, object]:
        return {"backend": self.backend, "kind": self.kind, "decode_ms": round(self.decode_ms, 3), "prefill_ms": round(self.prefill_ms, 3),
                "tops": round(self.tops, 4)}


CALIBRATION_SHAPE = (1024, 4096)
CALIBRATION_CHUNK = 64


def calibrate(backend: Backend, *, repeats: int = 5, stop: threading.Event | None = None) -> Calibration:
    """Time the built-in block on ``backend``: best of ``repeats`` runs for one token and for a
    prefill chunk (RunnerError if the backend cannot run it, or once ``stop`` is set: the
    caller no longer waits, and on a slow device the whole takes many seconds)."""
    import time

    import numpy as np

    weights = _weights(*CALIBRATION_SHAPE)
    timings = []
    for rows in (1, CALIBRATION_CHUNK):
        session = _session(backend, _mlp(rows, weights))
        x = np.ones((rows, CALIBRATION_SHAPE[0]), np.float32)
        session.run(None, {"x": x})  # first run: graph compilation and allocation
        best = float("inf")
        for _ in range(repeats):
            if stop is not None and stop.is_set():
                raise RunnerError(f"calibration of {backend.name} stopped")
            started = time.perf_counter()
            session.run(None, {"x": x})
            best = min(best, time.perf_counter() - started)
        timings.append(best)
    operations = 2 * 2 * CALIBRATION_CHUNK * CALIBRATION_SHAPE[0] * CALIBRATION_SHAPE[1]
    return Calibration(backend.name, backend.kind, 1000 * timings[0], 1000 * timings[1], operations / timings[1] / 1e12)
