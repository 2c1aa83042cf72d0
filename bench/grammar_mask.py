"""What constrained sampling costs a token: the grammar's mask (and its step past the chosen
token) next to a decode step of the same model, measured side by side in one process.

    python bench/grammar_mask.py                  # the default model (pulled when missing)
    python bench/grammar_mask.py --model NAME --tokens 200

Generates ``--tokens`` tokens twice with the same prompt: free (greedy) and under a JSON
schema's grammar (greedy inside it), and reports the median decode step, the median mask
time and their ratio (the target: under 10 %).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from shards.importers.pull import DEFAULT_MODEL, pull_model  # noqa: E402 - after the path
from shards.runtime import generate as generation  # noqa: E402
from shards.runtime.grammar import TokenMask, json_schema_grammar  # noqa: E402
from shards.runtime.sampling import SamplingParams  # noqa: E402
from shards.store.model_store import ModelStore  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "hobbies": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}}},
    "required": ["name", "age", "hobbies", "address"]}


class TimedMask(TokenMask):
    """A :class:`TokenMask` that records how long each mask and each step took."""

    seconds: list[float] = []

    def mask(self, row):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        try:
            return super().mask(row)
        finally:
            self.seconds.append(time.perf_counter() - started)

    def accept(self, token: int) -> None:
        started = time.perf_counter()
        super().accept(token)
        self.seconds[-1] += time.perf_counter() - started


def decode_steps_s(model: generation.LocalModel, ids: list[int], params: SamplingParams) -> list[float]:
    """The time of each decode step of a generation (the gap between its tokens)."""
    stamps = []
    for _ in model.generate(ids, params):
        stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=120)
    args = parser.parse_args()
    store = ModelStore()
    if not store.has(args.model):
        pull_model(args.model, store)
    with generation.LocalModel.open(args.model, store) as model:
        ids = model.tokenizer.encode_chat([{"role": "user", "content": "Describe a person as JSON."}])
        free = decode_steps_s(model, ids, SamplingParams(max_tokens=args.tokens))
        grammar = json_schema_grammar(SCHEMA)
        generation.TokenMask = TimedMask  # what generate() masks with, timed
        constrained = decode_steps_s(model, ids, SamplingParams(max_tokens=args.tokens, grammar=grammar))
    step_ms = statistics.median(free) * 1e3
    constrained_ms = statistics.median(constrained) * 1e3
    mask_ms = statistics.median(TimedMask.seconds) * 1e3
    print(f"decode step, free:        {step_ms:.3f} ms (median of {len(free)})")
    print(f"decode step, constrained: {constrained_ms:.3f} ms (median of {len(constrained)})")
    print(f"mask + step of the grammar: {mask_ms:.4f} ms median, {max(TimedMask.seconds) * 1e3:.3f} ms max "
          f"({len(TimedMask.seconds)} tokens)")
    print(f"mask / decode step: {100 * mask_ms / step_ms:.2f} % (target: under 10 %)")


if __name__ == "__main__":
    main()
