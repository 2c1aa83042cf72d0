"""What the activations' precision costs and buys on a quantised store, side by side in one process.

    python bench/q4_precision.py                  # the default model, pulled as f32 and q4 when missing
    python bench/q4_precision.py --decode-tokens 64 --prompt-tokens 512

MatMulNBits takes its activations as float (accuracy_level 0) or rounds each block of 32 to
int8 (level 4); at level 4 the fragments take each product on x alone (an agent's
``activation_bits = 8``, the default), or on x and on what the rounding left of it, as the rows
of one call (16, about 16 bits). For each choice of the 4-bit layers' and the lm_head's level, of
the least weights of a 4-bit product on int8 (``int8_min_weights``) and of the activation bits, on
the q4 store of the packaged model: how many reference questions are answered word for word as
the float store answers them (greedy), the largest logit gap from the float store over those
answers, and prefill and decode speed relative to the default. As built, every 4-bit product takes
int8 with 8 bits, and with 16 only those of at least 4M weights (none of the packaged model's:
float activations, as the rows "small products float" put them with 8 bits). Both stores hold
the packaged Q4_1 file's weights exactly, so only the activations differ. The last row is
llama.cpp (llama-cpp-python, when installed) on that file itself, with its own 8-bit
activations: the yardstick.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.model_shapes import cache_dir, default_tokenizer_gguf  # noqa: E402 - after the path
from shards.graph import fragment  # noqa: E402
from shards.importers.pull import DEFAULT_MODEL, pull_model  # noqa: E402
from shards.runtime.chain import chain_forward, open_chain  # noqa: E402
from shards.store.model_store import ModelStore  # noqa: E402
from shards.text.tokenizer import Tokenizer  # noqa: E402

QUESTIONS = ["What is the capital of France?", "What is 2+2?", "Write a haiku about the sea.",
             "Name three primary colors.", "Who wrote Romeo and Juliet?", "What is the boiling point of water?",
             "Translate 'good morning' to Spanish.", "What is the largest planet in our solar system?"]
# (label, 4-bit layers' accuracy_level, 8-bit lm_head's, int8_min_weights (None: as built), activation_bits)
AS_BUILT = (fragment.Q4_ACCURACY_LEVEL, fragment.Q8_ACCURACY_LEVEL)
CHOICES = [("as built (default)", *AS_BUILT, None, 8), ("as built, activation_bits 16", *AS_BUILT, None, 16),
           ("small products float, activation_bits 8", *AS_BUILT, fragment.INT8_MIN_WEIGHTS[16], 8),
           ("layers int8, activation_bits 16", *AS_BUILT, 0, 16), ("layers float, lm_head float", 0, 0, None, 8)]


def greedy(runners, ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    logits = chain_forward(runners, "g", np.array(ids, np.int64))[0, -1]
    tokens, rows = [], [logits]
    for _ in range(steps):
        tokens.append(int(rows[-1].argmax()))
        rows.append(chain_forward(runners, "g", np.array(tokens[-1:], np.int64))[0, -1])
    for r in runners:
        r.close_session("g")
    return tokens, np.stack(rows)


def agreement(tokenizer, answers: list[tuple[list[int], np.ndarray]],
              runs: list[tuple[list[int], np.ndarray]]) -> tuple[int, float]:
    """(how many ``runs`` answer word for word as ``answers`` do, the largest logit gap until they part)."""
    same, gap = 0, 0.0
    for (tokens, logits), (ref_tokens, ref_logits) in zip(runs, answers):
        same += tokenizer.decode(tokens) == tokenizer.decode(ref_tokens)
        agree = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
        gap = max(gap, float(np.abs(logits[:agree + 1] - ref_logits[:agree + 1]).max()))
    return same, gap


def llama_cpp_runs(gguf: Path, chats: list[list[int]], steps: int, prompt: list[int], decode_tokens: int,
                   threads: int) -> tuple[list[tuple[list[int], np.ndarray]], float, float]:
    """llama.cpp on the file: each chat's greedy answer and logits (as :func:`greedy`), and
    (prefill tokens/s, decode tokens/s) as :func:`speed` measures them."""
    import llama_cpp

    from bench.generate import llama_cpp_logits

    llm = llama_cpp.Llama(str(gguf), n_threads=threads, n_threads_batch=threads, verbose=False,
                          n_ctx=max(len(prompt) + decode_tokens, max(map(len, chats)) + steps) + 16,
                          n_batch=max(512, len(prompt)))

    def logits() -> np.ndarray:
        return llama_cpp_logits(llm).copy()

    runs = []
    for ids in chats:
        llm.reset()
        llm.eval(ids)
        tokens, rows = [], [logits()]
        for _ in range(steps):
            tokens.append(int(rows[-1].argmax()))
            llm.eval(tokens[-1:])
            rows.append(logits())
        runs.append((tokens, np.stack(rows)))
    best_prefill = best_decode = 0.0
    for _ in range(2):
        llm.reset()
        started = time.perf_counter()
        llm.eval(prompt)
        best_prefill = max(best_prefill, len(prompt) / (time.perf_counter() - started))
        started = time.perf_counter()
        for _ in range(decode_tokens):
            llm.eval([int(logits().argmax())])
        best_decode = max(best_decode, decode_tokens / (time.perf_counter() - started))
    return runs, best_prefill, best_decode


def speed(runners, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s), best of two."""
    best_prefill = best_decode = 0.0
    for _ in range(2):
        started = time.perf_counter()
        logits = chain_forward(runners, "s", np.array(prompt, np.int64))
        best_prefill = max(best_prefill, len(prompt) / (time.perf_counter() - started))
        started = time.perf_counter()
        for _ in range(decode_tokens):
            logits = chain_forward(runners, "s", np.array([int(logits[0, -1].argmax())], np.int64))
        best_decode = max(best_decode, decode_tokens / (time.perf_counter() - started))
        for r in runners:
            r.close_session("s")
    return best_prefill, best_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    store = ModelStore()
    names = {w: pull_model(DEFAULT_MODEL, store, weights=w).name for w in ("f32", "q4")}
    tokenizer = Tokenizer.from_model_dir(store.model_dir(names["f32"]))
    chats = [tokenizer.encode_chat([{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS]
    text = " ".join(QUESTIONS) * 200
    prompt = tokenizer.encode(text)[:args.prompt_tokens]
    n_layers = store.manifest(names["f32"]).n_layers
    cuts = [(0, n_layers - 1)]
    with tempfile.TemporaryDirectory(prefix="ncm-bench-") as cache:
        reference = open_chain(store.model_dir(names["f32"]), cuts, threads=args.threads, cache_dir=Path(cache))
        answers = [greedy(reference, ids, args.answer_tokens) for ids in chats]
        rows = [("f32 store", len(QUESTIONS), 0.0, *speed(reference, prompt, args.decode_tokens))]
        for r in reference:
            r.close()
        for label, q4_level, q8_level, min_weights, bits in CHOICES:
            fragment.Q4_ACCURACY_LEVEL, fragment.Q8_ACCURACY_LEVEL = q4_level, q8_level
            runners = open_chain(store.model_dir(names["q4"]), cuts, threads=args.threads, cache_dir=Path(cache),
                                 activation_bits=bits, int8_min_weights=min_weights)
            runs = [greedy(runners, ids, args.answer_tokens) for ids in chats]
            rows.append((f"q4: {label}", *agreement(tokenizer, answers, runs),
                         *speed(runners, prompt, args.decode_tokens)))
            for r in runners:
                r.close()
    if importlib.util.find_spec("llama_cpp") is not None:
        gguf = default_tokenizer_gguf(cache_dir())  # the packaged file both stores were imported from
        runs, prefill, decode = llama_cpp_runs(gguf, chats, args.answer_tokens, prompt, args.decode_tokens,
                                               args.threads)
        rows.append(("llama.cpp on the Q4_1 file", *agreement(tokenizer, answers, runs), prefill, decode))
    default = next(row for row in rows if "(default)" in row[0])
    print(f"{'store and activations':44} {'same answers':>12} {'max logit gap':>14} "
          f"{'prefill tok/s':>14} {'decode tok/s':>13}")
    for label, same, gap, prefill, decode in rows:
        print(f"{label:44} {f'{same}/{len(QUESTIONS)}':>12} {gap:>14.4f} "
              f"{prefill:>8.0f} ({prefill / default[3]:.2f}x) {decode:>6.1f} ({decode / default[4]:.2f}x)")


if __name__ == "__main__":
    main()
