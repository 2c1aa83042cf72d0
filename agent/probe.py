"""Capacity probe: memory, accelerators and load of this device."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import psutil

from agent.core.capacity import NodeCapacity
from agent.core.npu_table import npu_tops_for

log = logging.getLogger(__name__)
GIB = 1024**3
ROUND_GIB = 0.25  # report memory in steps, so small changes do not cause re-advertisements


@dataclass(frozen=True)
class DeviceFacts:
    """What was found on this device, for logs and `GET /cluster/nodes`."""

    board: str | None
    jetson: bool
    accelerator: str | None
    nvidia_gpus: int


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


def detect_device() -> DeviceFacts:
    board = _read_text("/proc/device-tree/model") or None
    compatible = _read_text("/proc/device-tree/compatible")
    jetson = bool(board and "jetson" in board.lower()) or "nvidia,tegra" in compatible
    _, accelerator = npu_tops_for([board or "", compatible, _cpu_model(), " ".join(os.listdir("/dev")) if os.path.isdir("/dev") else ""])
    _, gpus = nvml_total_vram_bytes()
    return DeviceFacts(board=board, jetson=jetson, accelerator=accelerator, nvidia_gpus=gpus)


def probe_capacity(node_id: str, *, npu_tops: float | None = None, vram_gib: float | None = None,
                   ram_gib: float | None = None, latency_ms: float = 0.0) -> NodeCapacity:
    """Measure this device now; configured figures replace measured ones.

    ``latency_ms`` is the measured median round trip to peers.
    """
    memory = psutil.virtual_memory()
    measured_ram_gib = _round_gib(memory.available)
    vram_bytes, _ = nvml_total_vram_bytes()
    board = _read_text("/proc/device-tree/model")
    if vram_bytes == 0 and ("jetson" in board.lower() or "nvidia,tegra" in _read_text("/proc/device-tree/compatible")):
        # Jetson: the GPU shares system memory and NVML reports no memory; count what is free.
        vram_bytes = memory.available
        measured_ram_gib = 0.0
    if npu_tops is None:
        npu_tops, _ = npu_tops_for([board, _read_text("/proc/device-tree/compatible"), _cpu_model(), " ".join(os.listdir("/dev"))])
    try:
        load = min(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    except OSError:
        load = 0.0
    return NodeCapacity(
        node_id=node_id,
        vram_gib=_round_gib(vram_bytes) if vram_gib is None else vram_gib,
        ram_gib=measured_ram_gib if ram_gib is None else ram_gib,
        npu_tops=npu_tops,
        latency_ms=round(latency_ms, 1),
        load=round(load, 1),
    )


def device_memory(*, vram_gib: float | None, ram_gib: float | None, held_bytes: int) -> dict[str, int]:
    """The memory fragments live in, for the router's ledger: ``total_bytes`` and
    ``external_bytes`` (what other programs use). A configured ``vram_gib`` / ``ram_gib`` is a
    budget the operator reserved for ncm: its external use is 0. Otherwise, on GPUs the total
    VRAM with nothing external known, and on CPUs the RAM, where external = total − available
    − the models this agent holds (``held_bytes``; the agent's own runtime counts as external)."""
    if vram_gib:
        return {"total_bytes": int(vram_gib * GIB), "external_bytes": 0}
    if ram_gib:
        return {"total_bytes": int(ram_gib * GIB), "external_bytes": 0}
    vram_bytes, _ = nvml_total_vram_bytes()
    if vram_bytes:
        return {"total_bytes": vram_bytes, "external_bytes": 0}
    memory = psutil.virtual_memory()
    external = memory.total - memory.available - held_bytes
    return {"total_bytes": memory.total, "external_bytes": max(0, external)}
