"""The GPU check: run it on a machine with an NVIDIA GPU and onnxruntime-gpu (a few minutes).

1. Fidelity: the default model on the GPU backend against the CPU provider: last-position
   logits of a prompt (within --tolerance) and --tokens greedy tokens. CUDA runs the "gpu"
   flavour (float16 weights and products): on the CPU provider's float16 kernels the same
   graph is 2.2e-2 from the float32 logits of SmolLM2 (whose logits span about 38), so the
   default tolerance is 5e-2.
2. Speed: decode and prefill tokens/s of the same fragment on the GPU backend and the CPU
   (bench/backends.py's measurement); llama.cpp on the same GGUF when llama-cpp-python is
   installed (bench/generate.py), else it says so.
3. A 2-agent loopback cluster, one agent on the GPU backend and one on the CPU: the answer
   must be the single-device text, and each agent must report the backend it was given.

It exits 2 at once, with the reason, when the backend is not usable here.

    python bench/gpu_check.py                  # CUDA (TensorRT: --backend tensorrt)
    python bench/gpu_check.py --backend cpu    # the same steps on the CPU, to check the script
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent.cli.demo import _ensure_model, start_local_cluster, stop_processes, wait_ready  # noqa: E402
from agent.local.probe import find_accelerators  # noqa: E402
from bench.backends import measure  # noqa: E402
from shards.errors import RunnerError  # noqa: E402
from shards.providers.backends import CPU_BACKEND, backend_chain, detect_platform  # noqa: E402
from shards.runtime.chain import chain_forward  # noqa: E402
from shards.runtime.generate import LocalModel  # noqa: E402
from shards.runtime.ort_runner import OrtFragmentRunner  # noqa: E402
from shards.store.model_store import ModelStore  # noqa: E402

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def greedy(runner: OrtFragmentRunner, ids: np.ndarray, steps: int) -> tuple[np.ndarray, list[int]]:
    logits = chain_forward([runner], "check", ids)[0, -1]
    first, tokens = logits.copy(), []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = chain_forward([runner], "check", np.array([[tokens[-1]]]))[0, -1]
    runner.close_session("check")
    return first, tokens


def fidelity(model_dir: Path, backend_name: str, tokens: int, tolerance: float) -> bool:
    (backend, *_), _ = backend_chain(detect_platform(), [backend_name])
    n_layers = json.loads((model_dir / "manifest.json").read_text())["n_layers"]
    ids = np.array([[1, 504, 3575, 282, 4649, 314, 253, 1345, 28, 198]])
    results = {}
    for chosen in (backend, CPU_BACKEND):
        runner = OrtFragmentRunner(model_dir, 0, n_layers - 1, backends=[chosen], max_context=128)
        results[chosen.name] = greedy(runner, ids, tokens)
        print(f"  {chosen.name}: {runner.describe()}")
        runner.close()
    (logits, got), (reference, expected) = results[backend.name], results[CPU_BACKEND.name]
    error = float(np.abs(logits - reference).max())
    ok = error <= tolerance and got == expected
    print(f"  logits max |{backend.name} - cpu| = {error:.2e} (tolerance {tolerance:g}); "
          f"{tokens} greedy tokens {'identical' if got == expected else 'DIFFER'}: {'ok' if ok else 'FAILED'}")
    return ok


def speed(model_dir: Path, backend_name: str, threads: int) -> None:
    for row in measure(model_dir, [backend_name, "cpu"], threads, prompt=128, decode=64):
        print(f"  {row['backend']:<10} {row['flavour']:<9} decode {row['decode_tok_s']:8.1f} tok/s   "
              f"prefill {row['prefill_tok_s']:9.1f} tok/s")
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("  llama.cpp: not measured (llama-cpp-python is not installed here)")
        return
    result = subprocess.run([sys.executable, str(REPO / "bench" / "generate.py"), "--threads", str(threads)],
                            capture_output=True, text=True)
    print("  " + "\n  ".join(result.stdout.strip().splitlines()[-6:]))


def cluster(backend_name: str, port: int) -> bool:
    with LocalModel.open(MODEL, store=ModelStore()) as model:
        reference = model.greedy_chat(QUESTION, 24)
    with tempfile.TemporaryDirectory(prefix="ncm-gpu-check-") as tmp:
        processes = start_local_cluster(2, port, Path(tmp), MODEL, log_dir=Path(tmp) / "logs",
                                        env={"NCM_DEFAULT_PLACEMENT": "split"},  # a fragment on each device
                                        node_env=[{"NCM_PROVIDERS": backend_name}, {"NCM_PROVIDERS": "cpu"}])
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, processes, 300)
            body = json.dumps({"messages": QUESTION, "temperature": 0, "max_tokens": 24}).encode()
            request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            started = time.perf_counter()
            with urllib.request.urlopen(request, timeout=300) as response:
                answer = json.loads(response.read())["choices"][0]["message"]["content"]
            print(f"  answer in {time.perf_counter() - started:.2f} s: {answer!r}")
            deadline = time.monotonic() + 30  # peers' worker status comes with their next describe
            while True:
                with urllib.request.urlopen(url + "/cluster/nodes", timeout=30) as response:
                    nodes = json.loads(response.read())["nodes"]
                backends = [sorted({f["backend"] for f in (n.get("worker") or {}).get("fragments", [])})
                            for n in nodes]
                if all(backends) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            print(f"  fragments' backends per node: {backends}")
            ok = answer == reference and sorted(map(tuple, backends)) == sorted([(backend_name,), ("cpu",)])
            print(f"  {'ok' if ok else 'FAILED'}: the single-device text is {reference!r}")
            return ok
        finally:
            stop_processes(processes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--tolerance", type=float, default=5e-2)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--port", type=int, default=18900)
    args = parser.parse_args()
    try:
        backend_chain(detect_platform(), [args.backend])
    except RunnerError as error:
        print(f"gpu_check: {error}", file=sys.stderr)
        return 2
    found = find_accelerators((args.backend,))
    print(f"backends: {json.dumps(found.to_dict())}")
    if args.backend not in [c.backend for c in found.usable]:
        print(f"gpu_check: {args.backend} failed its self-test: {found.unusable}", file=sys.stderr)
        return 2
    _ensure_model(MODEL)
    model_dir = ModelStore().model_dir(MODEL)
    print("1. fidelity")
    ok = fidelity(model_dir, args.backend, args.tokens, args.tolerance)
    print("2. speed")
    speed(model_dir, args.backend, args.threads)
    print("3. a 2-agent cluster, one agent on", args.backend)
    ok = cluster(args.backend, args.port) and ok
    print("gpu_check:", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
