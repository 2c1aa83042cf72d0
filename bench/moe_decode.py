"""What a mixture of experts costs per token against a dense model of the same active size,
side by side in one process.

    python bench/moe_decode.py                         # 8 experts, 2 per token, hidden 1024, 8 layers
    python bench/moe_decode.py --experts 16 --per-token 2 --weights q4

Writes two random checkpoints with transformers: a Mixtral (``--experts`` experts of
``--expert-ff`` each, ``--per-token`` of them per token) and a Llama whose MLP is as wide as the
active experts together (``per_token * expert_ff``), the rest alike. Imports both, decodes
``--tokens`` greedy tokens on each, and reports decode tok/s, the active parameters per token
and the decode cost per active parameter of the MoE relative to the dense model (1.0: an
active parameter of the MoE costs what a dense one does; the routing, gathering and scattering
are the difference).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from shards.importers.importer import import_model  # noqa: E402 - after the path
from shards.runtime.chain import chain_forward, open_chain  # noqa: E402
from shards.store.model_store import ModelStore  # noqa: E402

VOCAB = 4096


def write_checkpoint(folder: Path, kind: str, args: argparse.Namespace) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 256,
                  max_position_embeddings=2048, tie_word_embeddings=True, initializer_range=0.02)
    if kind == "moe":
        model = MixtralForCausalLM(MixtralConfig(**common, intermediate_size=args.expert_ff,
                                                 num_local_experts=args.experts, num_experts_per_tok=args.per_token,
                                                 sliding_window=None))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, intermediate_size=args.per_token * args.expert_ff))
    model.save_pretrained(folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def decode_rate(model_dir: Path, n_layers: int, tokens: int, threads: int, cache: Path) -> float:
    runners = open_chain(model_dir, [(0, n_layers - 1)], threads=threads, cache_dir=cache)
    logits = chain_forward(runners, "d", np.arange(3, 35, dtype=np.int64))
    best = 0.0
    for _ in range(2):
        started = time.perf_counter()
        for _ in range(tokens):
            logits = chain_forward(runners, "d", np.array([int(logits[0, -1].argmax())], np.int64))
        best = max(best, tokens / (time.perf_counter() - started))
    for r in runners:
        r.close()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--per-token", type=int, default=2)
    parser.add_argument("--expert-ff", type=int, default=1408)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--weights", default="f32", choices=("f32", "q4"))
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="ncm-bench-") as tmp:
        store = ModelStore(Path(tmp) / "home")
        for kind in ("dense", "moe"):
            write_checkpoint(Path(tmp) / kind, kind, args)
            m = import_model(Path(tmp) / kind, name=kind, weights=args.weights, store=store, progress=False)
            h, ff = m.hidden_size, (m.expert_intermediate_size if m.n_experts else m.intermediate_size)
            attention = h * (m.n_heads + 2 * m.n_kv_heads) * m.head_dim + m.n_heads * m.head_dim * h
            mlp = 3 * h * ff * (m.experts_per_token if m.n_experts else 1) + (m.n_experts * h)
            active = m.n_layers * (attention + mlp) + m.vocab_size * h
            total = sum(f.bytes for f in m.files.values())
            rate = decode_rate(store.model_dir(kind), m.n_layers, args.tokens, args.threads, Path(tmp) / "cache")
            rows[kind] = (rate, active, total)
    for kind, (rate, active, total) in rows.items():
        print(f"{kind:6} {rate:7.1f} tok/s  {active / 1e6:7.1f} M active parameters per token  "
              f"{total / 2**20:7.0f} MiB stored")
    (moe_rate, moe_active, _), (dense_rate, dense_active, _) = rows["moe"], rows["dense"]
    print(f"decode cost per active parameter, MoE / dense: "
          f"{(dense_rate * dense_active) / (moe_rate * moe_active):.2f}")


if __name__ == "__main__":
    main()
