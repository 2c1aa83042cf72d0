"""Helpers shared by the model-layer tests (fragments, runner, import): not a test module."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from shards.runner import FragmentRunner, chain_forward, open_chain

SMOLLM2 = "smollm2-135m"
SMOLLM2_Q4 = "smollm2-135m-q4"
PROMPT_IDS = np.array([1, 504, 3575, 282, 4649, 314, 253, 1345, 28, 198], np.int64)
_CHAINS: dict[tuple, list[FragmentRunner]] = {}


def chain(model_dir: Path, cuts: list[tuple[int, int]], **kw) -> list[FragmentRunner]:
    """A chain of runners, opened once per test session for the same arguments."""
    key = (str(model_dir), tuple(cuts), tuple(sorted(kw.items())))
    if key not in _CHAINS:
        _CHAINS[key] = open_chain(model_dir, cuts, **kw)
    return _CHAINS[key]


def greedy(runners: list[FragmentRunner], session: str, prompt: np.ndarray, steps: int) -> tuple[np.ndarray, list[int]]:
    """Prefill ``prompt`` then decode ``steps`` greedy tokens; returns (last-position logits per step, tokens)."""
    logits = chain_forward(runners, session, prompt)
    rows, tokens = [logits[0, -1]], []
    for _ in range(steps):
        tokens.append(int(rows[-1].argmax()))
        rows.append(chain_forward(runners, session, np.array([tokens[-1]]))[0, -1])
    for r in runners:
        r.close_session(session)
    return np.stack(rows), tokens


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json + tokenizer_config.json with <s>, </s>, <unk> and w3..wN."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}))


def make_hf_checkpoint(folder: Path, arch: str, *, seed: int = 0):
    """Save a tiny random llama / qwen2 checkpoint in ``folder``; returns the torch model (eval, fp32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.15, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)
        model = Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random (non-zero) q/k/v biases
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.3)
    with torch.no_grad():  # non-trivial norm weights
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.uniform_(0.5, 1.5)
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_word_tokenizer(folder, common["vocab_size"])
    return model
