"""Run the default model on OpenVINO's CPU device, in the environment whose onnxruntime is
the OpenVINO build (`.venv-openvino`); the test in `test_openvino.py` compares the result
with the CPU provider in its own environment. Not a test module.

    python tests/shards/openvino_side.py MODEL_DIR FLAVOUR STEPS OUT.npz
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shards.runtime.chain import chain_forward  # noqa: E402
from shards.runtime.ort_runner import OrtFragmentRunner  # noqa: E402
from tests.shards.fragment_helpers import PROMPT_IDS, greedy  # noqa: E402


def main() -> None:
    model_dir, flavour, steps, out = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    runner = OrtFragmentRunner(model_dir, 0, 29, providers=["openvino-cpu"], flavour=flavour, max_context=64,
                               prefill_chunk=16, threads=1)
    prompt_logits = chain_forward([runner], "prompt", PROMPT_IDS)[0]
    rows, tokens = greedy([runner], "greedy", PROMPT_IDS, steps)
    np.savez(out, prompt_logits=prompt_logits, rows=rows, tokens=np.array(tokens),
             describe=np.array(json.dumps(runner.describe())))


if __name__ == "__main__":
    main()
