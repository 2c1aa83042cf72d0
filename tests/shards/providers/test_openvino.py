"""OpenVINO through the real OpenVINO runtime, on its CPU device (the device these machines
have; an NPU or GPU takes the same code path with another `device_type`).

onnxruntime-openvino replaces the stock onnxruntime module, so the OpenVINO side runs in an
environment of its own (`./dev test` makes `.venv-openvino`; `NCM_OPENVINO_PYTHON` names its
interpreter) and the CPU side here; the test compares the two.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.shards.fragment_helpers import PROMPT_IDS, SMOLLM2, chain, greedy

pytestmark = pytest.mark.slow
STEPS = 32
SIDE = Path(__file__).parents[1] / "openvino_side.py"


def openvino_python() -> str:
    python = os.environ.get("NCM_OPENVINO_PYTHON", "")
    if not python or not Path(python).exists():
        pytest.skip("no OpenVINO environment (NCM_OPENVINO_PYTHON; `./dev test` makes .venv-openvino)")
    return python


@pytest.fixture(scope="module")
def model_dir(smollm2_store):
    return smollm2_store.model_dir(SMOLLM2)


@pytest.mark.parametrize("flavour", ["portable", "static"])
def test_openvino_runs_the_default_model_as_the_cpu_provider_does(model_dir, tmp_path, flavour):
    out = tmp_path / "openvino.npz"
    result = subprocess.run([openvino_python(), str(SIDE), str(model_dir), flavour, str(STEPS), str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    side = np.load(out)
    described = json.loads(str(side["describe"]))
    assert described["backend"] == "openvino-cpu" and described["provider"] == "OpenVINOExecutionProvider"
    assert described["options"]["device_type"] == "CPU" and described["flavour"] == flavour
    assert described["fallbacks"] == []

    cpu = chain(model_dir, [(0, 29)], max_context=64, threads=1)
    from shards.runtime.chain import chain_forward

    prompt_logits = chain_forward(cpu, "prompt", PROMPT_IDS)[0]
    cpu[0].close_session("prompt")
    rows, tokens = greedy(cpu, "greedy", PROMPT_IDS, STEPS)
    print(f"{flavour}: prompt logits max |OpenVINO - CPU| = {np.abs(side['prompt_logits'] - prompt_logits).max():.2e}, "
          f"decode rows {np.abs(side['rows'] - rows).max():.2e}")
    np.testing.assert_allclose(side["prompt_logits"], prompt_logits, atol=1e-3, rtol=0)
    np.testing.assert_allclose(side["rows"], rows, atol=1e-3, rtol=0)
    assert side["tokens"].tolist() == tokens
