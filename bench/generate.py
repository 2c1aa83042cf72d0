"""Single-device generation speed: ncm (f32 and q4 fragments) next to llama.cpp.

Runs each engine in its own child process (so peak RSS is that engine's alone), on the same
GGUF, the same prompt token ids, the same thread count, and reports prefill and decode
tokens/s (best of ``--rounds`` x ``--repeats``, engines taking turns), peak RSS, the ratio
ncm / llama.cpp from this one run, and the bytes a decode step reads (every weight, one row of
an embedding table that is not also the output layer) with the read rate they make at that
speed, to hold against the machine's memory bandwidth.

    python bench/generate.py                      # pulls the default model's GGUF
    python bench/generate.py --gguf model.gguf --threads 4 --prompt-tokens 256
    python bench/generate.py --shape llama-1b     # a random-weight Llama-3.2-1B-shaped Q4_0 GGUF
                                                  # (bench/model_shapes.py, written once, cached)

llama.cpp comes from the ``llama-cpp-python`` package (the ``reference`` extra: ``pip install -e .[reference]``);
without it the llama.cpp column is skipped and the script says so.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.llama_plain import PLAIN_NOTE, apply, crashed, plain_env  # noqa: E402 - after the path

log = logging.getLogger("bench.generate")
llama_plain = False  # llama.cpp crashed with its extra buffer types: its workers run without

PROMPT_TEXT = ("The history of computing is a story of people building machines that extend what we can "
               "calculate, remember and share. ")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process image (VmHWM; getrusage where /proc is absent,
    which may also count the parent's memory at fork time)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def prompt_ids(gguf_path: Path, n_tokens: int) -> list[int]:
    """``n_tokens`` ids of a repeated English paragraph, from the model's own tokenizer."""
    import gguf

    from shards.text.tokenizer import Tokenizer
    from shards.text.tokenizer_gguf import tokenizer_spec_from_gguf

    tokenizer = Tokenizer(tokenizer_spec_from_gguf(gguf.GGUFReader(gguf_path)))
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids += tokenizer.encode(PROMPT_TEXT)
    return ids[:n_tokens]


def run_ncm(model_dir: Path, ids: list[int], decode_tokens: int, threads: int, repeats: int) -> dict:
    """Prefill ``ids`` then decode greedily ``decode_tokens`` tokens through one fragment
    (best of ``repeats``). The prompt goes in ``prefill``'s default chunks, as ``ncm generate``
    and an agent read it (256 tokens; llama.cpp reads in micro-batches of 512)."""
    from shards.runtime.chain import open_chain
    from shards.runtime.generate import decode_step, prefill
    from shards.store.manifest import Manifest

    manifest = Manifest.from_json((model_dir / "manifest.json").read_text(encoding="utf-8"))
    runners = open_chain(model_dir, [(0, manifest.n_layers - 1)], threads=threads)
    # A decode step reads every weight once, but of the embedding table only one row.
    embed_bytes = manifest.vocab_size * manifest.hidden_size * (4 if manifest.weight_format == "f32" else 2)
    bytes_per_token = sum(r.memory_bytes() for r in runners) - embed_bytes  # no session open yet: weights
    prompt = np.asarray(ids, dtype=np.int64)
    # warm-up: a short prefill and a few decode steps
    logits = prefill(runners, "warm", prompt[:16])
    for _ in range(4):
        logits = decode_step(runners, "warm", int(np.argmax(logits)))
    for r in runners:
        r.close_session("warm")

    prefill_seconds, decode_seconds = [], []
    for repeat in range(repeats):
        session = f"bench-{repeat}"
        started = time.perf_counter()
        logits = prefill(runners, session, prompt)
        prefill_seconds.append(time.perf_counter() - started)
        started = time.perf_counter()
        for _ in range(decode_tokens):
            logits = decode_step(runners, session, int(np.argmax(logits)))
        decode_seconds.append(time.perf_counter() - started)
        for r in runners:
            r.close_session(session)
    provider = runners[0].provider
    for r in runners:
        r.close()
    return {"prefill_tokens_per_s": len(ids) / min(prefill_seconds),
            "decode_tokens_per_s": decode_tokens / min(decode_seconds), "provider": provider,
            "decode_bytes_per_token": bytes_per_token}


def gguf_decode_bytes(gguf_path: Path) -> int:
    """Bytes llama.cpp reads per decode step: every tensor, but of an untied model's embedding
    table only one row (a tied one is read whole as the output layer)."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(gguf_path).tensors}
    untied = "output.weight" in tensors
    return sum(tensors.values()) - (tensors.get("token_embd.weight", 0) if untied else 0)


def llama_cpp_logits(llm) -> np.ndarray:
    """The last evaluated token's logits, a view of llama.cpp's context (``llm.scores`` holds
    them only with ``logits_all=True``; without it, it is not filled): the next eval rewrites it."""
    import llama_cpp

    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))


def _next_token(llm) -> int:
    """Greedy: the argmax of the last evaluated token's logits."""
    return int(np.argmax(llama_cpp_logits(llm)))


def run_llama_cpp(gguf_path: Path, ids: list[int], decode_tokens: int, threads: int, repeats: int) -> dict:
    """The same measurement with llama.cpp (llama-cpp-python) on the GGUF as it is."""
    plain = apply()
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf_path), n_threads=threads, n_threads_batch=threads,
                          n_ctx=len(ids) + decode_tokens + 16, n_batch=max(512, len(ids)), verbose=False)
    llm.eval(ids[:16])
    for _ in range(4):
        llm.eval([_next_token(llm)])
    llm.reset()

    prefill_seconds, decode_seconds = [], []
    for _ in range(repeats):
        llm.reset()
        started = time.perf_counter()
        llm.eval(ids)
        prefill_seconds.append(time.perf_counter() - started)
        started = time.perf_counter()
        for _ in range(decode_tokens):
            llm.eval([_next_token(llm)])
        decode_seconds.append(time.perf_counter() - started)
    return {"prefill_tokens_per_s": len(ids) / min(prefill_seconds),
            "decode_tokens_per_s": decode_tokens / min(decode_seconds),
            "provider": f"llama.cpp {llama_cpp.__version__} CPU" + (f" ({PLAIN_NOTE})" if plain else "")}


def worker(args: argparse.Namespace) -> int:
    """Child process: one engine, one measurement, JSON on stdout."""
    ids = json.loads(Path(args.ids_file).read_text())
    if args.worker == "llama.cpp":
        result = run_llama_cpp(Path(args.gguf), ids, args.decode_tokens, args.threads, args.repeats)
    else:
        result = run_ncm(Path(args.worker_model_dir), ids, args.decode_tokens, args.threads, args.repeats)
    result["peak_rss_bytes"] = peak_rss_bytes()
    print(json.dumps(result))
    return 0


def spawn(argv: list[str]) -> dict | None:
    """A worker's result; a llama.cpp worker that crashes is run again with its extra buffer
    types off (bench/llama_plain.py), and so are the later ones."""
    global llama_plain
    llama = argv[:2] == ["--worker", "llama.cpp"]
    env = plain_env() if llama and llama_plain else None
    result = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, env=env)
    if llama and not llama_plain and crashed(result.returncode):
        log.warning("llama.cpp crashed (%s); measuring it with them off", PLAIN_NOTE)
        llama_plain = True
        return spawn(argv)
    if result.returncode != 0:
        log.error("bench worker %s failed:\n%s", argv[:2], result.stderr.strip()[-2000:])
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


def best_of(old: dict | None, new: dict | None) -> dict | None:
    """Merge two measurements of one engine: the higher speeds, the higher peak RSS."""
    if old is None or new is None:
        return new or old
    merged = dict(new)
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "peak_rss_bytes"):
        merged[key] = max(old[key], new[key])
    return merged


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, help="GGUF to benchmark (default: the smollm2-135m wheel's)")
    parser.add_argument("--shape", help="benchmark a random-weight GGUF of this shape instead (bench/model_shapes.py)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for both engines")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="measurements per worker, best kept (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="workers per engine, taking turns (default 2)")
    parser.add_argument("--formats", default="f32,q4", help="ncm weight formats to measure (comma separated; "
                        "q4-lm4: q4 with a 4-bit lm_head)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--ids-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.worker:
        return worker(args)

    from shards.importers.importer import import_model
    from shards.store.model_store import ModelStore

    with tempfile.TemporaryDirectory(prefix="ncm-bench-") as tmp:
        tmp_dir = Path(tmp)
        gguf_path = args.gguf
        if args.shape:
            from bench.model_shapes import shape_gguf

            gguf_path = shape_gguf(args.shape)
        if gguf_path is None:  # the default model's, pulled once into the bench cache
            from bench.model_shapes import cache_dir, default_tokenizer_gguf

            gguf_path = default_tokenizer_gguf(cache_dir())
        ids = prompt_ids(gguf_path, args.prompt_tokens)
        ids_file = tmp_dir / "ids.json"
        ids_file.write_text(json.dumps(ids))
        common = ["--gguf", str(gguf_path), "--ids-file", str(ids_file), "--threads", str(args.threads),
                  "--decode-tokens", str(args.decode_tokens), "--repeats", str(args.repeats)]
        store = ModelStore(tmp_dir / "home")
        workers: dict[str, list[str]] = {}
        for fmt in [f.strip() for f in args.formats.split(",") if f.strip()]:
            name = f"bench-{fmt}"
            weights, _, head = fmt.partition("-lm")  # "q4-lm4": q4 weights, a 4-bit lm_head
            import_model(gguf_path, name=name, weights=weights, store=store, progress=False,
                         lm_head_bits=int(head or 8))
            workers[f"ncm {fmt}"] = ["--worker", "ncm", "--worker-model-dir", str(store.model_dir(name)), *common]
        if llama_cpp_available():
            workers["llama.cpp"] = ["--worker", "llama.cpp", *common]
        else:
            log.warning("llama_cpp is not installed (pip install llama-cpp-python): llama.cpp column skipped")
        # engines take turns, round after round, so a busy moment of the machine hits all of them
        results: dict[str, dict | None] = {engine: None for engine in workers}
        for round_index in range(args.rounds):
            for engine, worker_argv in workers.items():
                log.info("round %d/%d: measuring %s ...", round_index + 1, args.rounds, engine)
                results[engine] = best_of(results[engine], spawn(worker_argv))

    if results.get("llama.cpp"):
        results["llama.cpp"]["decode_bytes_per_token"] = gguf_decode_bytes(gguf_path)
    reference = results.get("llama.cpp")
    report = {"gguf": gguf_path.name, "threads": args.threads, "prompt_tokens": len(ids),
              "decode_tokens": args.decode_tokens, "results": results}
    for engine, r in results.items():
        if r and reference and engine != "llama.cpp":
            r["prefill_vs_llama_cpp"] = r["prefill_tokens_per_s"] / reference["prefill_tokens_per_s"]
            r["decode_vs_llama_cpp"] = r["decode_tokens_per_s"] / reference["decode_tokens_per_s"]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{report['gguf']}: {len(ids)} prompt tokens, {args.decode_tokens} decode tokens, "
              f"{args.threads} threads")
        print(f"{'engine':<12} {'prefill tok/s':>14} {'decode tok/s':>13} {'peak RSS MiB':>13} "
              f"{'prefill ratio':>14} {'decode ratio':>13} {'MB/token':>9} {'GB/s':>6}  provider")
        for engine, r in results.items():
            if r is None:
                print(f"{engine:<12} failed (see the log above)")
                continue
            ratio_p = f"{r['prefill_vs_llama_cpp']:.2f}" if "prefill_vs_llama_cpp" in r else "-"
            ratio_d = f"{r['decode_vs_llama_cpp']:.2f}" if "decode_vs_llama_cpp" in r else "-"
            read = r["decode_bytes_per_token"]  # what one decode step reads: weights, one embedding row
            print(f"{engine:<12} {r['prefill_tokens_per_s']:>14.1f} {r['decode_tokens_per_s']:>13.1f} "
                  f"{r['peak_rss_bytes'] / 2**20:>13.0f} {ratio_p:>14} {ratio_d:>13} {read / 1e6:>9.0f} "
                  f"{read * r['decode_tokens_per_s'] / 1e9:>6.1f}  {r['provider']}")
        if reference is None:
            print("llama.cpp: not measured (llama_cpp is not installed; pip install llama-cpp-python)")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
