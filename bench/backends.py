"""Decode and prefill speed of the same fragment on every backend this machine can use, and
the ratio to the CPU provider measured in the same run.

Each backend runs the whole model as one fragment, in its own flavour, with the same
threads; prefill is one prompt of --prompt tokens, decode --decode single-token steps after
it. With --also PYTHON the same measurement also runs under another environment's
interpreter (e.g. .venv-openvino/bin/python, whose onnxruntime is the OpenVINO build) and
its rows join the table; its CPU row is the ratio's base for its own backends. Where the
RKNN converter's environment is set up (`.venv-rknn`, or $NCM_RKNN_PYTHON), the RK3588's
NPU is also run on rknn-toolkit2's simulator: its row is marked "simulator" and its figures
are the simulator's speed on this CPU, not the NPU's; what it shows is the fp16 error.

    python bench/backends.py [--model smollm2-135m] [--threads 2] [--layers 0-3] [--also .venv-openvino/bin/python]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.cli.demo import _ensure_model  # noqa: E402
from shards.graph.fragment import load_manifest  # noqa: E402
from shards.providers.backends import OPENVINO, backend_chain, detect_platform, rknn_backend  # noqa: E402
from shards.runtime.ort_runner import OrtFragmentRunner  # noqa: E402
from shards.store.model_store import ModelStore  # noqa: E402


def measure(model_dir: Path, backend_names: list[str], threads: int, prompt: int, decode: int,
            layers: tuple[int, int] | None = None) -> list[dict]:
    m = load_manifest(model_dir)
    first, last = layers or (0, m.n_layers - 1)
    platform = detect_platform()
    forced = [OPENVINO] if OPENVINO in platform.providers else []
    chain, _ = backend_chain(platform, forced)
    if platform.rknn_converter:
        chain.append(rknn_backend(platform.rknn_target or "rk3588", runtime="simulator"))
    reference = None
    rows = []
    for backend in chain:
        if backend_names and backend.name not in backend_names:
            continue
        runner = OrtFragmentRunner(model_dir, first, last, backends=[backend], threads=threads,
                                   max_context=prompt + decode + 1, prefill_chunk=min(prompt, 64))
        ids = np.random.default_rng(0).integers(0, m.vocab_size, (1, prompt))
        runner.open_session("warm")
        runner.forward("warm", ids[:, :8])  # first run: graph optimisation and allocation
        runner.open_session("s")
        started = time.perf_counter()
        out = runner.forward("s", ids)
        prefill_s = time.perf_counter() - started
        if reference is None:
            reference = out
        error = float(np.abs(out - reference).max() / np.abs(reference).max())
        token = int(out[0, -1].argmax())
        started = time.perf_counter()
        for _ in range(decode):
            token = int(runner.forward("s", np.array([[token]]))[0, -1].argmax())
        decode_s = time.perf_counter() - started
        rows.append({"backend": backend.name, "provider": runner.provider, "flavour": runner.flavour,
                     "prefill_tok_s": prompt / prefill_s, "decode_tok_s": decode / decode_s, "logits_error": error,
                     "simulator": dict(backend.options).get("runtime") == "simulator"})
        runner.close()
    return rows


def report(rows: list[dict], where: str) -> None:
    cpu = next((r for r in rows if r["backend"] == "cpu"), None)
    for r in rows:
        ratio = (f"{r['decode_tok_s'] / cpu['decode_tok_s']:5.2f}x / {r['prefill_tok_s'] / cpu['prefill_tok_s']:5.2f}x"
                 if cpu else "-")
        note = "  simulator: not the NPU's speed" if r.get("simulator") else ""
        print(f"{where:<14} {r['backend']:<14} {r['flavour']:<9} {r['decode_tok_s']:9.1f} {r['prefill_tok_s']:10.1f}   "
              f"{ratio}   {r['logits_error']:.1e}{note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--backend", action="append", default=[], help="only these backends (repeatable)")
    parser.add_argument("--layers", metavar="FIRST-LAST", help="a fragment of these layers (default: the whole model; "
                        "the simulator converts a whole model slowly)")
    parser.add_argument("--also", metavar="PYTHON", help="also measure under this interpreter's environment")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # used by --also
    args = parser.parse_args()
    _ensure_model(args.model)
    model_dir = ModelStore().model_dir(args.model)
    layers = tuple(int(n) for n in args.layers.split("-")) if args.layers else None
    rows = measure(model_dir, args.backend, args.threads, args.prompt, args.decode, layers)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{args.model}{f' layers {args.layers}' if args.layers else ''}, {args.threads} threads, "
          f"prompt {args.prompt}, decode {args.decode}")
    print(f"{'environment':<14} {'backend':<14} {'flavour':<9} {'decode/s':>9} {'prefill/s':>10}   "
          f"vs cpu (decode / prefill)   prefill output vs the first row (relative)")
    report(rows, "this")
    if args.also:
        command = [args.also, __file__, "--json", "--model", args.model, "--threads", str(args.threads),
                   "--prompt", str(args.prompt), "--decode", str(args.decode)] + (["--layers", args.layers] if args.layers else [])
        result = subprocess.run(command, capture_output=True, text=True, check=True)
        report(json.loads(result.stdout.strip().splitlines()[-1]), Path(args.also).parents[1].name)


if __name__ == "__main__":
    main()
