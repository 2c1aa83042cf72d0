"""Execution backends: the chain built from what a machine has, provider options, and the
fallback when a backend cannot load a fragment (real onnxruntime sessions)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shards.errors import RunnerError
from shards.providers.backends import CPU, CPU_BACKEND, OPENVINO, QNN, Backend, Platform, backend_chain, detect_platform
from shards.runtime.chain import chain_forward
from shards.runtime.ort_runner import OrtFragmentRunner
from tests.shards.fragment_helpers import PROMPT_IDS, SMOLLM2

ALL = ("TensorrtExecutionProvider", "CUDAExecutionProvider", QNN, OPENVINO, "DmlExecutionProvider", CPU)


def names(chain):
    return [b.name for b in chain]


def test_a_cpu_only_machine_runs_the_fused_flavour_on_the_cpu():
    chain, unusable = backend_chain(Platform((CPU,)))
    assert chain == [CPU_BACKEND] and CPU_BACKEND.flavour == "cpu" and unusable == []


def test_accelerators_come_first_with_the_options_that_reach_their_device():
    platform = Platform(ALL, openvino_devices=("CPU", "GPU", "NPU"), qnn_htp_library="/opt/qnn/libQnnHtp.so")
    chain, unusable = backend_chain(platform)
    assert names(chain) == ["tensorrt", "cuda", "qnn-htp", "openvino-npu", "openvino-gpu", "directml", "cpu"]
    by_name = {b.name: b for b in chain}
    assert dict(by_name["qnn-htp"].options) == {"backend_path": "/opt/qnn/libQnnHtp.so"}
    assert by_name["qnn-htp"].flavour == "static" and by_name["qnn-htp"].kind == "npu"
    assert dict(by_name["openvino-npu"].options)["device_type"] == "NPU" and by_name["openvino-npu"].flavour == "static"
    assert dict(by_name["openvino-gpu"].options)["device_type"] == "GPU" and by_name["openvino-gpu"].kind == "gpu"
    assert by_name["cuda"].providers() == [("CUDAExecutionProvider", {"device_id": "0"}), CPU]
    assert by_name["cuda"].flavour == by_name["tensorrt"].flavour == "gpu"  # fused, float16: CUDA's attention kernel
    assert [p[0] for p in by_name["tensorrt"].providers()[:2]] == ["TensorrtExecutionProvider", "CUDAExecutionProvider"]
    assert unusable == []


def test_a_provider_that_cannot_reach_its_device_is_left_out_with_the_reason():
    chain, unusable = backend_chain(Platform((QNN, OPENVINO, CPU), openvino_devices=("CPU",)))
    assert names(chain) == ["cpu"]  # OpenVINO's CPU device is no accelerator; QNN lacks its HTP library
    reasons = {u.name: u.reason for u in unusable}
    assert "libQnnHtp.so" in reasons["qnn-htp"]
    assert "no NPU device" in reasons["openvino-npu"] and "it sees: CPU" in reasons["openvino-npu"]


def test_a_forced_backend_is_tried_alone_before_the_cpu():
    platform = Platform((OPENVINO, CPU), openvino_devices=("CPU",))
    chain, _ = backend_chain(platform, [OPENVINO])
    assert names(chain) == ["openvino-cpu", "cpu"]
    assert dict(chain[0].options) == {"device_type": "CPU", "precision": "ACCURACY"}
    assert chain[0].flavour == "portable"
    assert names(backend_chain(platform, ["openvino-cpu"])[0]) == ["openvino-cpu", "cpu"]
    assert names(backend_chain(platform, [CPU])[0]) == ["cpu"]


def test_forcing_what_is_missing_is_one_clear_line():
    with pytest.raises(RunnerError, match="'qnn-htp' is not usable here: the QNN provider is installed but libQnnHtp.so"):
        backend_chain(Platform((QNN, CPU)), ["qnn-htp"])
    with pytest.raises(RunnerError, match="'CUDAExecutionProvider' is not usable here .*onnxruntime providers: CPU"):
        backend_chain(Platform((CPU,)), ["CUDAExecutionProvider"])


@given(st.sets(st.sampled_from(ALL)), st.sets(st.sampled_from(["CPU", "GPU", "GPU.1", "NPU"])), st.booleans())
def test_the_chain_always_ends_on_the_cpu_and_uses_only_what_is_there(providers, devices, qnn_library):
    platform = Platform(tuple(providers | {CPU}), openvino_devices=tuple(sorted(devices)),
                        qnn_htp_library="/x/libQnnHtp.so" if qnn_library else None)
    chain, unusable = backend_chain(platform)
    assert chain[-1] == CPU_BACKEND and names(chain).count("cpu") == 1
    assert all(b.provider in platform.providers for b in chain)
    assert not {b.name for b in chain} & {u.name for u in unusable}
    for backend in chain:
        if backend.provider == OPENVINO:
            assert dict(backend.options)["device_type"] in devices
    assert ("qnn-htp" in names(chain)) == (QNN in providers and qnn_library)


def test_this_machine_is_detected():
    platform = detect_platform()
    assert CPU in platform.providers
    chain, _ = backend_chain(platform)
    assert chain[-1] == CPU_BACKEND


@pytest.fixture(scope="module")
def model_dir(smollm2_store):
    return smollm2_store.model_dir(SMOLLM2)


def test_a_backend_that_cannot_load_the_fragment_falls_back_to_the_next_with_a_warning(model_dir, caplog):
    """A QNN backend on a machine without QNN: onnxruntime quietly starts the CPU instead,
    which the runner does not take for the backend it asked for."""
    qnn = Backend("qnn-htp", QNN, "npu", "static", (("backend_path", "/nonexistent/libQnnHtp.so"),))
    with caplog.at_level(logging.WARNING, logger="shards.runtime.ort_runner"):
        runner = OrtFragmentRunner(model_dir, 0, 1, backends=[qnn, CPU_BACKEND], max_context=32, threads=1)
    try:
        assert runner.backend == CPU_BACKEND and runner.provider == CPU and runner.flavour == "cpu"
        assert len(runner.fallbacks) == 1 and runner.fallbacks[0].startswith("qnn-htp: ")
        assert "could not start QNNExecutionProvider" in runner.fallbacks[0]
        assert "cannot run on qnn-htp" in caplog.text
        described = runner.describe()
        assert described["backend"] == "cpu" and described["fallbacks"] == list(runner.fallbacks)
        reference = OrtFragmentRunner(model_dir, 0, 1, max_context=32, threads=1)
        assert np.array_equal(chain_forward([runner], "s", PROMPT_IDS), chain_forward([reference], "s", PROMPT_IDS))
    finally:
        runner.close()


def test_when_no_backend_loads_the_error_names_each_reason(model_dir):
    broken = [Backend("qnn-htp", QNN, "npu", "static", (("backend_path", "/nope"),)),
              Backend("cuda", "CUDAExecutionProvider", "gpu", "portable", (("device_id", "0"),))]
    with pytest.raises(RunnerError, match="no backend could load fragment 2-2: qnn-htp: .*; cuda: "):
        OrtFragmentRunner(model_dir, 2, 2, backends=broken, max_context=16, threads=1)
