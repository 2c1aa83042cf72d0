"""A stored model against llama.cpp running the GGUF file it was imported from, side by side.

    python bench/gguf_reference.py                       # gemma3-270m, pulled when missing
    python bench/gguf_reference.py --model NAME --gguf FILE --tokens 1536 --text FILE

Reports the perplexity of both on the first ``--tokens`` tokens of a text (default: this
repository's docs/architecture.md; one window, every position after the first scored, so
a text longer than a sliding window exercises it), their ratio, and the greedy continuations
of a few raw prompts by both. llama.cpp runs in-process (llama-cpp-python).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from shards.importers.pull import PULLABLE, fetch_gguf, pull_model  # noqa: E402 - after the path
from shards.runtime.chain import chain_forward, open_chain  # noqa: E402
from shards.store.model_store import ModelStore  # noqa: E402
from shards.text.tokenizer import Tokenizer  # noqa: E402

PROMPTS = ["Question: What is the capital of France?\nAnswer:", "The quick brown fox",
           "def fibonacci(n):", "The three primary colors are", "Water boils at"]
CHUNK_TOKENS = 256  # logits rows held at once (a 262k vocabulary: 268 MB per chunk)


def nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Summed negative log-likelihood of ``targets`` under rows of ``logits``."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(axis=-1))
    return float((log_z - shifted[np.arange(len(targets)), targets]).sum())


def ncm_run(store: ModelStore, name: str, ids: list[int], threads: int) -> tuple[float, list[list[int]], float]:
    tokenizer = Tokenizer.from_model_dir(store.model_dir(name))
    with tempfile.TemporaryDirectory(prefix="ncm-bench-") as cache:
        last = store.manifest(name).n_layers - 1
        runners = open_chain(store.model_dir(name), [(0, last)], threads=threads, cache_dir=Path(cache))
        total = 0.0
        for start in range(0, len(ids) - 1, CHUNK_TOKENS):
            chunk = np.array(ids[start:start + CHUNK_TOKENS], np.int64)
            logits = chain_forward(runners, "ppl", chunk)[0]
            targets = np.array(ids[start + 1:start + 1 + len(chunk)], np.int64)
            total += nll(logits[:len(targets)], targets)
        for r in runners:
            r.close_session("ppl")
        continuations, decode_s = [], 0.0
        for prompt in PROMPTS:
            logits = chain_forward(runners, "g", np.array(tokenizer.encode(prompt), np.int64))[0, -1]
            out = []
            started = time.perf_counter()
            for _ in range(16):
                out.append(int(logits.argmax()))
                logits = chain_forward(runners, "g", np.array(out[-1:], np.int64))[0, -1]
            decode_s += time.perf_counter() - started
            for r in runners:
                r.close_session("g")
            continuations.append(out)
        for r in runners:
            r.close()
    return math.exp(total / (len(ids) - 1)), continuations, 16 * len(PROMPTS) / decode_s


def llama_cpp_run(gguf: Path, ids: list[int], prompts_ids: list[list[int]], threads: int) -> tuple[float, list, float]:
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf), n_ctx=len(ids) + 16, n_batch=512, n_threads=threads, logits_all=True,
                          verbose=False)
    llm.eval(ids)
    total = sum(nll(np.asarray(llm.scores[start:min(start + CHUNK_TOKENS, len(ids) - 1)]),
                    np.array(ids[start + 1:start + 1 + CHUNK_TOKENS], np.int64))
                for start in range(0, len(ids) - 1, CHUNK_TOKENS))
    continuations, decode_s = [], 0.0
    for prompt_ids in prompts_ids:
        llm.reset()
        llm.eval(prompt_ids)
        out = []
        started = time.perf_counter()
        for _ in range(16):
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval(out[-1:])
        decode_s += time.perf_counter() - started
        continuations.append(out)
    return math.exp(total / (len(ids) - 1)), continuations, 16 * len(prompts_ids) / decode_s


def gguf_tensor_bytes(gguf: Path) -> int:
    import gguf as gguf_py

    return sum(int(t.n_bytes) for t in gguf_py.GGUFReader(gguf).tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m", help="stored model (pulled when it is pullable and missing)")
    parser.add_argument("--gguf", type=Path, help="the GGUF it came from (default: the pullable model's, downloaded)")
    parser.add_argument("--text", type=Path, default=REPO_ROOT / "docs" / "architecture.md")
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    store = ModelStore()
    if not store.has(args.model):
        pull_model(args.model, store)
    with tempfile.TemporaryDirectory(prefix="ncm-bench-") as tmp:
        gguf = args.gguf or fetch_gguf(PULLABLE[args.model], Path(tmp), progress=False)
        tokenizer = Tokenizer.from_model_dir(store.model_dir(args.model))
        ids = tokenizer.encode(args.text.read_text(encoding="utf-8"))[:args.tokens]
        ours, ours_text, ours_speed = ncm_run(store, args.model, ids, args.threads)
        theirs, theirs_text, theirs_speed = llama_cpp_run(gguf, ids, [tokenizer.encode(p) for p in PROMPTS],
                                                          args.threads)
    m = store.manifest(args.model)
    print(f"{args.model} ({m.weight_format}, {sum(f.bytes for f in m.files.values()) / 2**20:.0f} MiB stored; the file: "
          f"{gguf_tensor_bytes(gguf) / 2**20:.0f} MiB of tensors)")
    print(f"perplexity over {len(ids)} tokens of {args.text.name}: ncm {ours:.4f}, llama.cpp {theirs:.4f} "
          f"(ratio {ours / theirs:.4f})")
    print(f"greedy decode (with logits of the whole vocabulary): ncm {ours_speed:.1f} tok/s, llama.cpp "
          f"{theirs_speed:.1f} tok/s (ratio {ours_speed / theirs_speed:.2f})")
    for prompt, a, b in zip(PROMPTS, ours_text, theirs_text):
        print(f"{prompt!r}\n  ncm:       {tokenizer.decode(a)!r}\n  llama.cpp: {tokenizer.decode(b)!r}"
              f"{'  (same)' if a == b else ''}")


if __name__ == "__main__":
    main()
