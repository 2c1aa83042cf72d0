"""Capacity probe: memory, accelerators and load of this device."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from agent.core.capacity import NodeCapacity
from agent.core.npu_table import npu_tops_for
from agent.local.memory_limit import memory_view
from shards.errors import RunnerError
from shards.providers.backends import CPU_BACKEND, Calibration, backend_chain, calibrate, detect_platform, self_test

log = logging.getLogger(__name__)
GIB = 1024**3
ROUND_GIB = 0.25  # report memory in steps, so small changes do not cause re-advertisements


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace").replace("\x00", " ").strip()
    except OSError:
        return ""


def _cpu_model() -> str:
    for line in _read_text("/proc/cpuinfo").splitlines():
        if line.lower().startswith(("model name", "hardware")):
            return line.split(":", 1)[-1].strip()
    return ""


@functools.cache  # fixed while the agent runs; asked on every describe round
def nvml_total_vram_bytes() -> tuple[int, int]:
    """(total VRAM in bytes, number of GPUs) via NVML, (0, 0) without an NVIDIA driver."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0, 0

    class Memory(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    try:
        if nvml.nvmlInit_v2() != 0:
            return 0, 0
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return 0, 0
        total = 0
        for index in range(count.value):
            handle = ctypes.c_void_p()
            memory = Memory()
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) == 0 and nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) == 0:
                total += memory.total  # "Not Supported" on Jetson: unified memory
        return total, count.value
    except (AttributeError, OSError):
        return 0, 0
    finally:
        try:
            nvml.nvmlShutdown()
        except (AttributeError, OSError):
            pass


def _round_gib(value_bytes: float) -> float:
    return round(value_bytes / GIB / ROUND_GIB) * ROUND_GIB


def detect_capacity(node_id: str, *, latency_ms: float = 0.0, held_bytes: int = 0) -> NodeCapacity:
    """What this device has now, as found: the RAM models may use (within the agent's cgroup
    memory limit), NVML's VRAM (on Jetson the unified memory models may use), the board table's
    NPU TOPS. Models may use what is free and what this agent's own models hold (``held_bytes``):
    a plan should not shrink a device's share because it loaded the last one.
    ``latency_ms`` is the median round trip to peers.
    :func:`agent.core.capacity.credited_capacity` decides what of it the score counts."""
    memory = memory_view()
    usable_bytes = min(memory.total_bytes, memory.available_bytes + held_bytes)
    measured_ram_gib = _round_gib(usable_bytes)
    vram_bytes, _ = nvml_total_vram_bytes()
    board = _read_text("/proc/device-tree/model")
    if vram_bytes == 0 and ("jetson" in board.lower() or "nvidia,tegra" in _read_text("/proc/device-tree/compatible")):
        # Jetson: the GPU shares system memory and NVML reports no memory; count what models may use.
        vram_bytes = usable_bytes
        measured_ram_gib = 0.0
    npu_tops, _ = npu_tops_for([board, _read_text("/proc/device-tree/compatible"), _cpu_model(), " ".join(os.listdir("/dev"))])
    try:
        load = min(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    except OSError:
        load = 0.0
    return NodeCapacity(node_id=node_id, vram_gib=_round_gib(vram_bytes), ram_gib=measured_ram_gib,
                        npu_tops=npu_tops, latency_ms=round(latency_ms, 1), load=round(load, 1))


@dataclass(frozen=True)
class Accelerators:
    """The backends this agent can run fragments on: those that passed their self-test, each
    with what it measured on the built-in block, and those that cannot, with why."""

    usable: tuple[Calibration, ...]  # best first
    unusable: tuple[tuple[str, str], ...]  # (backend name, why)

    @property
    def kinds(self) -> frozenset[str]:
        """What the score may credit: "cpu" always, "gpu" / "npu" with a usable backend."""
        return frozenset({"cpu", *(c.kind for c in self.usable)})

    @property
    def npu_tops(self) -> float | None:
        """The TOPS the best usable NPU backend measured (None without one)."""
        measured = [c.tops for c in self.usable if c.kind == "npu"]
        return max(measured) if measured else None

    def to_dict(self) -> dict[str, object]:
        return {"usable": [c.backend for c in self.usable], "measured": [c.to_dict() for c in self.usable],
                "unusable": [{"backend": n, "reason": r} for n, r in self.unusable]}


CPU_ONLY = Accelerators((), ())


def find_accelerators(providers: tuple[str, ...] = (), stop: threading.Event | None = None) -> Accelerators:
    """Self-test and calibrate every backend of this machine: an onnxruntime session or two
    each, so once at start and off the event loop. Once ``stop`` is set it returns at its next
    step with what it has (an agent told to stop meanwhile does not wait for the rest: on a
    slow device that is many seconds)."""
    try:
        chain, unusable = backend_chain(detect_platform(), providers)
    except RunnerError as error:  # the configured providers are not here: the fragments will say so too
        log.error("%s", error)
        chain, unusable = [CPU_BACKEND], []
        unusable_reasons = [("providers", str(error))]
    else:
        unusable_reasons = [(u.name, u.reason) for u in unusable]
    usable: list[Calibration] = []
    for backend in chain:
        if stop is not None and stop.is_set():
            break
        reason = self_test(backend)
        if reason is None:
            try:
                usable.append(calibrate(backend, stop=stop))
                continue
            except RunnerError as error:
                reason = str(error)
        unusable_reasons.append((backend.name, f"self-test failed: {reason}"))
        log.warning("backend %s is not usable: %s", backend.name, reason)
    return Accelerators(tuple(usable), tuple(unusable_reasons))


def device_memory(*, vram_gib: float | None, ram_gib: float | None, held_bytes: int,
                  beside_bytes: int = 0) -> dict[str, int]:
    """The memory fragments live in, for the router's ledger: ``total_bytes`` and
    ``external_bytes`` (what else uses it). A configured ``vram_gib`` / ``ram_gib`` is a
    budget the operator reserved for ncm: its external use is what the agent holds in RAM beside
    its fragments (``beside_bytes``: its embedding and draft models) for a RAM budget, 0 for a VRAM one.
    Otherwise, on GPUs the total VRAM with nothing external known, and on CPUs the RAM (the
    agent's cgroup memory limit where that is smaller), where external = total − available −
    the models this agent holds (``held_bytes``; the agent's own runtime and what it holds
    beside the fragments count as external)."""
    if vram_gib:
        return {"total_bytes": int(vram_gib * GIB), "external_bytes": 0}
    if ram_gib:
        return {"total_bytes": int(ram_gib * GIB), "external_bytes": beside_bytes}
    vram_bytes, _ = nvml_total_vram_bytes()
    if vram_bytes:
        return {"total_bytes": vram_bytes, "external_bytes": 0}
    memory = memory_view()
    external = memory.total_bytes - memory.available_bytes - held_bytes
    return {"total_bytes": memory.total_bytes, "external_bytes": max(0, external)}
