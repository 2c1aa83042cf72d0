"""Cold start: from `ncm generate` to its first token, next to llama.cpp's, and where it goes.

Each engine is a fresh process on the same GGUF's model, the same raw prompt and threads:
``ncm generate MODEL PROMPT --raw --max-tokens 1`` (the installed command, fragment already
built: what every start after the first costs) and a llama-cpp-python script that loads the
GGUF and streams one token. Time to first token is from the spawn to the first byte of text on
the process's stdout; engines take turns, best of ``--rounds``. The page cache is warm (each
runs once before, not counted): a cold disk measures the disk, not the engine.

Then one more process walks ncm's path step by step and prints what each step took: the
interpreter, imports, the store's manifest, opening the model (the tokenizer on one thread
while the layers, cut in one range per core, open as onnxruntime sessions side by side: the
sessions repack the 4-bit weights, one core each), the prompt, prefill and first token, and
the chat template that ``ncm generate`` without ``--raw`` adds.

With ``--agent``: one ``ncm serve`` agent started on the same model (its store holds it, the
fragments are built): seconds from the spawn until it serves (membership, the plan, the model's
load: its range opens in one part per core), and from then the first token of a streamed
request.

    python bench/cold_start.py                      # the default model (SmolLM2-135M, q4)
    python bench/cold_start.py --shape llama-1b     # the random-weight Llama-3.2-1B shape (Q4_0)
    python bench/cold_start.py --shape llama-1b --agent
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.llama_plain import PLAIN_NOTE, crashed, plain_env  # noqa: E402 - after the path

PROMPT = "The history of computing is a story of people building machines that"

LLAMA_CPP_SCRIPT = """
import sys, time
from bench.llama_plain import apply
apply()
from llama_cpp import Llama
path, threads, prompt = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llm = Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
for chunk in llm.create_completion(prompt, max_tokens=1, temperature=0.0, stream=True):
    sys.stdout.write(chunk["choices"][0]["text"] or " ")
    sys.stdout.flush()
    break
"""

# One process walking `ncm generate`'s path (shards/cli/commands.py cmd_generate) with a clock at each
# step; times are since the process was spawned (the parent passes its spawn time).
PHASES_SCRIPT = """
import json, sys, time
spawned = float(sys.argv[1]); marks = [("interpreter", time.time())]
from shards.runtime.generate import LocalModel, prompt_ids_for
from shards.runtime.sampling import SamplingParams
from shards.store.model_store import ModelStore
marks.append(("imports", time.time()))
store = ModelStore(sys.argv[2]); name = sys.argv[3]; threads = int(sys.argv[4]); prompt = sys.argv[5]
manifest = store.manifest(name)
marks.append(("manifest", time.time()))
model = LocalModel.open(name, store, threads=threads)
marks.append((f"tokenizer | {len(model.runners)} onnxruntime sessions", time.time()))
ids = prompt_ids_for(model.tokenizer, prompt, raw=True)
marks.append(("prompt (raw)", time.time()))
next(e for e in model.generate(ids, SamplingParams(temperature=0.0, max_tokens=1)) if e.done)
marks.append(("prefill + first token", time.time()))
prompt_ids_for(model.tokenizer, prompt)
marks.append(("chat template (without --raw)", time.time()))
steps, last = [], spawned
for step, at in marks:
    steps.append([step, at - last]); last = at
print(json.dumps({"steps": steps, "prompt_tokens": len(ids)}))
"""


class EngineCrashed(SystemExit):
    """An engine's process died of a segmentation fault."""


def first_output_s(argv: list[str], env: dict[str, str] | None = None) -> float:
    """Seconds from spawning ``argv`` to the first byte on its stdout (it must exit 0)."""
    started = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert process.stdout is not None
    first = process.stdout.read(1)
    elapsed = time.perf_counter() - started
    _, err = process.communicate()
    if process.returncode != 0 or not first:
        failure = EngineCrashed if crashed(process.returncode) else SystemExit
        raise failure(f"{argv[0]} failed ({process.returncode}): {err.decode(errors='replace')[-2000:]}")
    return elapsed


def agent_start(name: str, home: Path, threads: int, port: int = 18650) -> tuple[float, float]:
    """(seconds from spawning one agent until it serves ``name``, seconds from a streamed
    request to its first token); the fragment is built by a first start, not counted."""
    import urllib.error
    import urllib.request

    from agent.cli.demo import start_local_cluster, stop_processes, wait_ready

    url = f"http://127.0.0.1:{port}"
    body = json.dumps({"model": name, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": True}).encode()
    timings = []
    for _ in range(2):  # the first start builds the fragments
        with tempfile.TemporaryDirectory(prefix="ncm-bench-") as base:
            started = time.perf_counter()
            processes = start_local_cluster(1, port, Path(base), name, env={"NCM_THREADS": str(threads)},
                                            node_env=[{"NCM_HOME": str(home)}], log_dir=Path(base) / "logs")
            try:
                while True:  # polled more often than wait_ready does
                    try:
                        with urllib.request.urlopen(url + "/cluster/status", timeout=5) as response:
                            if json.loads(response.read()).get("state") == "ok":
                                break
                    except (urllib.error.URLError, ConnectionError):
                        pass
                    if time.perf_counter() - started > 600:
                        wait_ready(url, processes, 1)  # raises with the cluster's own message
                    time.sleep(0.02)
                ready = time.perf_counter()
                request = urllib.request.Request(url + "/v1/completions", data=body,
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=600) as response:
                    next(line for line in response if line.startswith(b"data: {"))
                timings.append((ready - started, time.perf_counter() - ready))
            finally:
                stop_processes(processes)
    return timings[-1]


def model_store(args: argparse.Namespace) -> tuple[str, Path, Path]:
    """(model name, store root, GGUF path): the bench model imported once into the bench cache."""
    from bench.model_shapes import cache_dir, default_tokenizer_gguf, shape_gguf
    from shards.importers.importer import import_model
    from shards.store.model_store import ModelStore

    if args.shape:
        gguf_path, name = shape_gguf(args.shape), f"bench-{args.shape}"
    else:
        gguf_path, name = default_tokenizer_gguf(cache_dir()), "bench-smollm2-q4"
    home = cache_dir() / "home"
    store = ModelStore(home)
    if not store.has(name):
        import_model(gguf_path, name=name, weights="q4", store=store, progress=False)
    return name, home, gguf_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", help="a random-weight GGUF of this shape (bench/model_shapes.py)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3, help="starts per engine, best kept (default 3)")
    parser.add_argument("--agent", action="store_true", help="also time an agent's start and its first token")
    args = parser.parse_args(argv)

    name, home, gguf_path = model_store(args)
    agent = agent_start(name, home, args.threads) if args.agent else None
    ncm = shutil.which("ncm", path=str(Path(sys.executable).parent)) or shutil.which("ncm")
    if ncm is None:
        raise SystemExit("the ncm command is not installed (pip install -e .)")
    engines = {"ncm generate": [ncm, "generate", name, PROMPT, "--raw", "--max-tokens", "1", "--home", str(home),
                                "--threads", str(args.threads)]}
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama.cpp: not measured (pip install llama-cpp-python)")
    else:
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
            script.write(LLAMA_CPP_SCRIPT)
        engines["llama.cpp"] = [sys.executable, script.name, str(gguf_path), str(args.threads), PROMPT]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    envs = {engine: env for engine in engines}
    for engine, argv_ in engines.items():
        try:
            first_output_s(argv_, env)  # warms the page cache and builds the fragment once
        except EngineCrashed:
            if engine != "llama.cpp":
                raise
            print(f"llama.cpp: {PLAIN_NOTE}; measured with them off")
            envs[engine] = plain_env(env)
            first_output_s(argv_, envs[engine])
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for engine, argv_ in engines.items():
            best[engine] = min(best.get(engine, float("inf")), first_output_s(argv_, envs[engine]))
    if "llama.cpp" in engines:
        os.unlink(engines["llama.cpp"][1])  # the script written above

    spawned = time.time()
    walk = subprocess.run([sys.executable, "-c", PHASES_SCRIPT, str(spawned), str(home), name, str(args.threads),
                           PROMPT], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    if walk.returncode != 0:
        raise SystemExit(f"the step-by-step walk failed: {walk.stderr[-2000:]}")
    phases = json.loads(walk.stdout.strip().splitlines()[-1])

    print(f"{gguf_path.name}: time to first token from a fresh process, {args.threads} threads, "
          f"best of {args.rounds} (warm page cache)")
    for engine, seconds in best.items():
        print(f"  {engine:<14} {seconds:6.2f} s")
    if "llama.cpp" in best:
        print(f"  ratio ncm / llama.cpp: {best['ncm generate'] / best['llama.cpp']:.2f}")
    if agent is not None:
        print(f"  ncm serve: serving {agent[0]:.2f} s after the spawn, then the first token of a request "
              f"in {agent[1]:.2f} s")
    print(f"where ncm's goes ({phases['prompt_tokens']} prompt tokens):")
    for step, seconds in phases["steps"]:
        print(f"  {step:<32} {seconds:6.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
