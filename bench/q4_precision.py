"""What the activations' precision costs and buys on a quantised store, side by side in one process.

    python bench/q4_precision.py                  # the default model, pulled as f32 and q4 when missing
    python bench/q4_precision.py --decode-tokens 64 --prompt-tokens 512

MatMulNBits takes its activations as float (accuracy_level 0) or rounds each block of 32 to
int8 (level 4); at level 4 the fragments take each product on x and on what the rounding left
of it, as the rows of one call (about 16 bits), or on x alone with an agent's
``activation_bits = 8``. For each choice of the 4-bit layers' and the lm_head's level and of the
activation bits, on the q4 store of the packaged model: how many reference questions are
answered word for word as the float store answers them (greedy), the largest logit gap from
the float store over those answers, and prefill and decode speed relative to the default. The
packaged model's 4-bit products are below ``INT8_MIN_WEIGHTS`` (float activations as built);
the rows that say "layers int8" put them on int8, as a model of about 1B and up has them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from shards.graph import fragment  # noqa: E402 - after the path
from shards.importers.pull import DEFAULT_MODEL, pull_model  # noqa: E402
from shards.runtime.chain import chain_forward, open_chain  # noqa: E402
from shards.store.model_store import ModelStore  # noqa: E402
from shards.text.tokenizer import Tokenizer  # noqa: E402

QUESTIONS = ["What is the capital of France?", "What is 2+2?", "Write a haiku about the sea.",
             "Name three primary colors.", "Who wrote Romeo and Juliet?", "What is the boiling point of water?",
             "Translate 'good morning' to Spanish.", "What is the largest planet in our solar system?"]
# (label, 4-bit layers' accuracy_level, 8-bit lm_head's, INT8_MIN_WEIGHTS, activation_bits)
AS_BUILT = (fragment.Q4_ACCURACY_LEVEL, fragment.Q8_ACCURACY_LEVEL, fragment.INT8_MIN_WEIGHTS)
CHOICES = [("as built (default)", *AS_BUILT, 16), ("as built, activation_bits 8", *AS_BUILT, 8),
           ("layers int8, activation_bits 16", 4, 4, 0, 16), ("layers int8, activation_bits 8", 4, 4, 0, 8),
           ("layers float, lm_head float", 0, 0, 0, 16)]


def greedy(runners, ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    logits = chain_forward(runners, "g", np.array(ids, np.int64))[0, -1]
    tokens, rows = [], [logits]
    for _ in range(steps):
        tokens.append(int(rows[-1].argmax()))
        rows.append(chain_forward(runners, "g", np.array(tokens[-1:], np.int64))[0, -1])
    for r in runners:
        r.close_session("g")
    return tokens, np.stack(rows)


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
            fragment.INT8_MIN_WEIGHTS = min_weights
            runners = open_chain(store.model_dir(names["q4"]), cuts, threads=args.threads, cache_dir=Path(cache),
                                 activation_bits=bits)
            same, gap = 0, 0.0
            for ids, (ref_tokens, ref_logits) in zip(chats, answers):
                tokens, logits = greedy(runners, ids, args.answer_tokens)
                same += tokenizer.decode(tokens) == tokenizer.decode(ref_tokens)
                agree = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
                gap = max(gap, float(np.abs(logits[:agree + 1] - ref_logits[:agree + 1]).max()))
            rows.append((f"q4: {label}", same, gap, *speed(runners, prompt, args.decode_tokens)))
            for r in runners:
                r.close()
    default = next(row for row in rows if "(default)" in row[0])
    print(f"{'store and activations':44} {'same answers':>12} {'max logit gap':>14} "
          f"{'prefill tok/s':>14} {'decode tok/s':>13}")
    for label, same, gap, prefill, decode in rows:
        print(f"{label:44} {f'{same}/{len(QUESTIONS)}':>12} {gap:>14.4f} "
              f"{prefill:>8.0f} ({prefill / default[3]:.2f}x) {decode:>6.1f} ({decode / default[4]:.2f}x)")


if __name__ == "__main__":
    main()
