"""The probe on this machine: real onnxruntime self-tests and calibration of its backends."""

from __future__ import annotations

import threading

import pytest

from agent.local.memory_limit import memory_view
from agent.local.probe import detect_capacity, find_accelerators
from shards.errors import RunnerError
from shards.providers.backends import CPU_BACKEND, calibrate


def test_this_machine_has_a_self_tested_and_calibrated_cpu():
    found = find_accelerators()
    assert [c.backend for c in found.usable][-1] == "cpu"
    cpu = found.usable[-1]
    assert cpu.kind == "cpu" and 0 < cpu.decode_ms < cpu.prefill_ms and cpu.tops > 0
    assert "cpu" in found.kinds and found.npu_tops is None  # nothing to credit beyond the CPU
    assert found.to_dict()["measured"][-1]["backend"] == "cpu"


def test_configured_backends_that_are_missing_are_reported_not_fatal():
    found = find_accelerators(("qnn-htp",))
    assert [c.backend for c in found.usable] == ["cpu"]
    (name, reason), = found.unusable
    assert name == "providers" and "'qnn-htp' is not usable here" in reason


def test_a_stopped_probe_returns_at_its_next_step():
    stop = threading.Event()
    stop.set()
    found = find_accelerators(stop=stop)  # the agent stops before the self-test: none runs
    assert found.usable == () and found.unusable == ()
    with pytest.raises(RunnerError, match="stopped"):
        calibrate(CPU_BACKEND, stop=stop)


def test_the_memory_an_agents_models_hold_counts_as_usable():
    """A plan made after a load must not see the loaded device as smaller: what its own models
    hold counts beside what is free, never past what the device (or its cgroup) has."""
    held = 2 * 1024**3
    view = memory_view()
    free_only = detect_capacity("n").ram_gib
    with_held = detect_capacity("n", held_bytes=held).ram_gib
    want = min(view.total_bytes, view.available_bytes + held) / 1024**3
    assert with_held == pytest.approx(want, abs=0.5) and with_held >= free_only
    assert detect_capacity("n", held_bytes=1 << 50).ram_gib == pytest.approx(view.total_bytes / 1024**3, abs=0.5)
