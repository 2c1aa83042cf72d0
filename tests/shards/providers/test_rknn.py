"""Rockchip's NPU through RKNN, checked on rknn-toolkit2's simulator (x86): SmolLM2 fragments
converted to fp16 .rknn and run there agree with the CPU provider within fp16's tolerance,
and a whole model whose middle stage runs on the simulator gives the same greedy tokens.
Without the converter's environment (`./dev test` makes `.venv-rknn`; NCM_RKNN_PYTHON names
it) the simulator tests are skipped with the reason; CI installs it. The bad cases (a graph
the converter refuses, a board without the runtime) are one clear line each."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from shards.errors import RknnConversionError, RknnUnavailableError
from shards.graph.fragment import build_fragment
from shards.providers.backends import CPU_BACKEND, Platform, backend_chain, rknn_backend, self_test
from shards.providers.rknn import RKNN, board_target, convert, converter_python, lite_runtime_problem, rknn_path
from shards.runtime.ort_runner import OrtFragmentRunner
from tests.shards.fragment_helpers import PROMPT_IDS, SMOLLM2, greedy

SIMULATOR = rknn_backend("rk3588", runtime="simulator")
CONTEXT, CHUNK = 64, 8
# fp16 on the NPU: what the simulator reaches against float32 on the CPU, relative to the
# largest magnitude of the output (measured: about 7e-4 on hidden states, 2e-3 on logits).
RELATIVE_TOLERANCE = 5e-3


def _converter() -> str | None:
    try:
        return converter_python()
    except RknnUnavailableError as error:
        if os.environ.get("CI") and sys.version_info[:2] <= (3, 12):  # rknn-toolkit2's wheels stop at 3.12
            pytest.fail(f"CI must set up the RKNN converter: {error}")
        return None


needs_converter = pytest.mark.skipif(_converter() is None, reason="no RKNN converter environment (rknn-toolkit2): "
                                                                   "`./dev test` makes .venv-rknn")


# --- pure: where RKNN is offered ---------------------------------------------------------------
def test_a_board_with_the_runtime_puts_its_npu_first():
    chain, unusable = backend_chain(Platform(("CPUExecutionProvider",), rknn_target="rk3588"))
    assert [b.name for b in chain] == ["rknn-npu", "cpu"] and unusable == []
    assert chain[0].provider == RKNN and chain[0].kind == "npu" and chain[0].flavour == "static"


def test_a_board_without_the_runtime_serves_on_the_cpu_and_says_why():
    reason = "librknnrt.so (Rockchip's RKNN runtime) is not installed: the NPU cannot be reached"
    chain, unusable = backend_chain(Platform(("CPUExecutionProvider",), rknn_target="rk3588", rknn_problem=reason))
    assert chain == [CPU_BACKEND]
    assert [(u.name, u.reason) for u in unusable] == [("rknn-npu", reason)]


def test_the_simulator_runs_only_when_asked_for():
    platform = Platform(("CPUExecutionProvider",), rknn_converter=True)
    assert backend_chain(platform)[0] == [CPU_BACKEND]
    assert [b.name for b in backend_chain(platform, ["rknn-sim"])[0]] == ["rknn-sim", "cpu"]


def test_this_machine_is_no_rockchip_board(tmp_path):
    assert board_target(tmp_path / "missing") is None
    (tmp_path / "compatible").write_bytes(b"radxa,rock-5b\0rockchip,rk3588\0")
    assert board_target(tmp_path / "compatible") == "rk3588"
    problem = lite_runtime_problem()  # x86: no lite runtime, or at least no librknnrt.so
    assert problem is not None and ("rknnlite" in problem or "librknnrt.so" in problem) and "\n" not in problem


def test_an_unknown_target_is_refused(tmp_path):
    with pytest.raises(RknnUnavailableError, match="rk9999"):
        rknn_path(tmp_path / "fragment.onnx", "rk9999")


# --- on the simulator --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(smollm2_store):
    return smollm2_store.model_dir(SMOLLM2)


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.slow
@needs_converter
@pytest.mark.parametrize("first, last", [(1, 2), (28, 29)])  # hidden states out; the tail's logits
def test_a_fragment_on_the_simulator_matches_the_cpu_within_fp16(model_dir, first, last):
    cpu = OrtFragmentRunner(model_dir, first, last, backends=[CPU_BACKEND], flavour="static", max_context=CONTEXT,
                            prefill_chunk=CHUNK, threads=1)
    npu = OrtFragmentRunner(model_dir, first, last, backends=[SIMULATOR], max_context=CONTEXT, prefill_chunk=CHUNK)
    try:
        assert npu.provider == RKNN and npu.describe()["backend"] == "rknn-sim" and npu.fallbacks == ()
        x = np.random.default_rng(first).normal(0, 1, (1, 11, 576)).astype(np.float32)  # 2 chunks, the 2nd padded
        errors = []
        cpu.open_session("s")
        npu.open_session("s")
        for step in (x, x[:, :1], x[:, 1:2]):  # a prefill, then two decode steps over the cache
            want, got = cpu.forward("s", step), npu.forward("s", step)
            assert got.shape == want.shape and got.dtype == np.float32
            errors.append(_relative_error(got, want))
        print(f"layers {first}-{last}: relative error {', '.join(f'{e:.2e}' for e in errors)}")
        assert max(errors) < RELATIVE_TOLERANCE, errors
        assert rknn_path(npu.path, "rk3588").parent == npu.path.parent
    finally:
        cpu.close()
        npu.close()


@pytest.mark.slow
@needs_converter
def test_a_whole_model_with_a_stage_on_the_simulator_gives_the_same_greedy_tokens(model_dir):
    cuts = [(0, 9), (10, 12), (13, 29)]
    reference = [OrtFragmentRunner(model_dir, a, b, backends=[CPU_BACKEND], max_context=CONTEXT, threads=1)
                 for a, b in cuts]
    mixed = [reference[0],
             OrtFragmentRunner(model_dir, 10, 12, backends=[SIMULATOR], max_context=CONTEXT, prefill_chunk=CHUNK),
             reference[2]]
    try:
        _, want = greedy(reference, "a", PROMPT_IDS[None, :], 12)
        _, got = greedy(mixed, "b", PROMPT_IDS[None, :], 12)
        assert got == want
    finally:
        for runner in {id(r): r for r in reference + mixed}.values():
            runner.close()


@pytest.mark.slow
@needs_converter
def test_a_graph_the_converter_refuses_is_one_line_and_the_runner_falls_back_to_the_cpu(model_dir, tmp_path):
    """The fused "cpu" flavour (GroupQueryAttention, com.microsoft ops) is what RKNN cannot take."""
    fused = build_fragment(model_dir, 3, 3, flavour="cpu", max_context=CONTEXT, cache_dir=tmp_path)
    with pytest.raises(RknnConversionError) as refused:
        convert(fused, "rk3588")
    assert "\n" not in str(refused.value) and "rknn" in str(refused.value).lower()
    assert not rknn_path(fused, "rk3588").exists()
    runner = OrtFragmentRunner(model_dir, 3, 3, backends=[rknn_backend("rk3588"), CPU_BACKEND], max_context=CONTEXT,
                               threads=1)
    try:  # the board's backend here: no lite runtime on this machine, so the CPU serves, saying why
        assert runner.backend == CPU_BACKEND and runner.fallbacks[0].startswith("rknn-npu: ")
        runner.open_session("s")
        assert runner.forward("s", np.zeros((1, 1, 576), np.float32)).shape == (1, 1, 576)
    finally:
        runner.close()


def test_the_converter_environment_must_exist(monkeypatch, tmp_path):
    monkeypatch.setenv("NCM_RKNN_PYTHON", str(tmp_path / "nope" / "python"))
    with pytest.raises(RknnUnavailableError, match="does not exist"):
        converter_python()


@pytest.mark.slow
@needs_converter
def test_the_rk3576_takes_the_same_fragment_and_the_self_test_passes_on_the_simulator(model_dir, tmp_path):
    """What the capacity score needs of an NPU backend (the self-test block, then the
    calibration) runs through RKNN too; the RK3576's conversion costs nothing more."""
    static = build_fragment(model_dir, 4, 4, flavour="static", max_context=CONTEXT, prefill_chunk=CHUNK,
                            cache_dir=tmp_path)
    converted = convert(static, "rk3576")
    assert converted == rknn_path(static, "rk3576") and converted.stat().st_size > 0
    assert convert(static, "rk3576") == converted  # cached: not converted again
    assert self_test(SIMULATOR) is None
