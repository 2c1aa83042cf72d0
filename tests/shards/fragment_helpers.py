"""Helpers shared by the model-layer tests (fragments, runner, import): not a test module."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import numpy as np

from shards.runtime.chain import chain_forward, open_chain
from shards.runtime.runner import FragmentRunner
from shards.store.tensorfile import write_tensors

SMOLLM2 = "smollm2-135m"
SMOLLM2_Q4 = "smollm2-135m-q4"
PROMPT_IDS = np.array([1, 504, 3575, 282, 4649, 314, 253, 1345, 28, 198], np.int64)
_CHAINS: OrderedDict[tuple, list[FragmentRunner]] = OrderedDict()
_KEEP_CHAINS = 3  # each chain of the real model holds ~650 MB of fp32 weights


def chain(model_dir: Path, cuts: list[tuple[int, int]], **kw) -> list[FragmentRunner]:
    """A chain of runners, reused across tests for the same arguments (the least recently
    used ones are closed so the suite's memory stays bounded)."""
    key = (str(model_dir), tuple(cuts), tuple(sorted(kw.items())))
    if key in _CHAINS:
        _CHAINS.move_to_end(key)
        return _CHAINS[key]
    while len(_CHAINS) >= _KEEP_CHAINS:
        for r in _CHAINS.popitem(last=False)[1]:
            r.close()
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


VOCAB = 96
# Turns as words of the vocabulary: w3 opens a system turn, w4 a user one, w5 an assistant one.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ {'system': 'w3', 'user': 'w4'}.get(m['role'], 'w5') }} "
                 "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w5 {% endif %}")


CHATML_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>")


def write_chatml_tokenizer(folder: Path, chat_template: str) -> int:
    """A byte-level tokenizer (a token per byte, no merges: it spells any text) with Qwen's
    ChatML tokens after the 256 bytes, every one of them special (so the reasoning and
    tool-call marks must stay in decoded text on their own); returns the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({char: i for i, char in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in CHATML_TOKENS])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "add_bos_token": False,
         "chat_template": chat_template}))
    return len(alphabet) + len(CHATML_TOKENS)


def write_tiny_checkpoint(folder: Path, *, seed: int = 0, layers: int = 2, q4_0_grid: bool = False,
                          chat_template: str | None = None) -> Path:
    """A random llama checkpoint (config.json, model.safetensors, a word-level tokenizer with a
    chat template) made with numpy alone: no torch, so it is written in milliseconds.
    ``q4_0_grid``: the weights lie on GGUF Q4_0 grids, as a Q4_0 file's dequantised weights do.
    ``chat_template``: a real template instead, with the byte-level ChatML tokenizer it needs
    (:func:`write_chatml_tokenizer`)."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = VOCAB if chat_template is None else write_chatml_tokenizer(folder, chat_template)
    rng = np.random.default_rng(seed)
    hidden, inter, heads, kv_heads = 64, 160, 4, 2
    head_dim = hidden // heads

    def weight(*shape: int) -> np.ndarray:
        w = rng.normal(0.0, 0.15, shape).astype(np.float32)
        if q4_0_grid:
            import gguf

            q4_0 = gguf.GGMLQuantizationType.Q4_0
            w = gguf.quants.dequantize(gguf.quants.quantize(w, q4_0), q4_0).reshape(shape).astype(np.float32)
        return w

    tensors = {"model.embed_tokens.weight": weight(vocab, hidden), "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        prefix = f"model.layers.{i}."
        tensors.update({
            prefix + "input_layernorm.weight": np.ones(hidden, np.float32),
            prefix + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
            prefix + "self_attn.q_proj.weight": weight(heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
            prefix + "mlp.gate_proj.weight": weight(inter, hidden),
            prefix + "mlp.up_proj.weight": weight(inter, hidden),
            prefix + "mlp.down_proj.weight": weight(hidden, inter),
        })
    write_tensors(folder / "model.safetensors", tensors)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
        "max_position_embeddings": 256 if chat_template is None else 1024, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True, **({"bos_token_id": 1, "eos_token_id": 2} if chat_template is None else {})}))
    if chat_template is not None:
        return folder
    write_word_tokenizer(folder, VOCAB)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def make_hf_checkpoint(folder: Path, arch: str, *, seed: int = 0, attention_bias: bool = False,
                       mlp_bias: bool = False, rope: dict | None = None):
    """Save a tiny random llama / mistral / qwen2 / qwen3 / smollm3 / gemma3 / granite / olmo2 / phi3 checkpoint in ``folder``; returns the torch model
    (eval, fp32).

    ``attention_bias`` (llama, qwen3) gives q/k/v/o biases and ``mlp_bias`` (llama) gate/up/down
    ones, as the config options of those names do. The qwen3 one has heads wider than
    hidden_size / n_heads, as Qwen3's have. ``rope``: more of phi3's config (a long rope, a
    partial rotary, its own shape)."""
    import torch
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GraniteConfig,
        GraniteForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Olmo2Config,
        Olmo2ForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        SmolLM3Config,
        SmolLM3ForCausalLM,
    )

    torch.manual_seed(seed)
    rope = rope or {}
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.15, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0,
                          attention_bias=attention_bias, mlp_bias=mlp_bias,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = LlamaForCausalLM(cfg)
    elif arch == "mistral":
        cfg = MistralConfig(**common, tie_word_embeddings=False, rope_theta=1000000.0, sliding_window=None)
        model = MistralForCausalLM(cfg)
    elif arch == "gemma3":  # layers 0-4 slide over 16 positions, layer 5 is global (as llama.cpp reads a GGUF)
        cfg = Gemma3TextConfig(**(common | {"num_hidden_layers": 6}), head_dim=32, sliding_window=16,
                               query_pre_attn_scalar=32, tie_word_embeddings=True, pad_token_id=0)
        model = Gemma3ForCausalLM(cfg)
    elif arch == "gemma2":  # layers 0 and 2 slide over 16 positions; scores and logits soft-capped hard
        cfg = Gemma2Config(**(common | {"num_hidden_layers": 4}), head_dim=32, sliding_window=16,
                           query_pre_attn_scalar=32, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                           tie_word_embeddings=True, pad_token_id=0)
        model = Gemma2ForCausalLM(cfg)
    elif arch == "mixtral":  # 4 experts, 2 per token
        cfg = MixtralConfig(**common, tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                            rope_theta=1000000.0, sliding_window=None)
        model = MixtralForCausalLM(cfg)
    elif arch == "qwen3_moe":  # 6 experts, 2 per token, renormalised (as Qwen3's MoE models are, and llama.cpp's)
        cfg = Qwen3MoeConfig(**common, tie_word_embeddings=True, num_experts=6, num_experts_per_tok=2,
                             moe_intermediate_size=48, norm_topk_prob=True, rope_theta=1000000.0)
        model = Qwen3MoeForCausalLM(cfg)
    elif arch == "phi3":  # every layer slides over 16 positions (Phi-3's 4k models: 2047)
        cfg = Phi3Config(**(common | {"tie_word_embeddings": False, "sliding_window": 16, "pad_token_id": 0} | rope))
        model = Phi3ForCausalLM(cfg)
    elif arch == "qwen2_moe":  # 4 experts, 2 per token, not renormalised, and a shared expert
        cfg = Qwen2MoeConfig(**common, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=48, shared_expert_intermediate_size=96, norm_topk_prob=False,
                             rope_theta=1000000.0, pad_token_id=0)
        model = Qwen2MoeForCausalLM(cfg)
    elif arch == "olmoe":  # 6 experts, 2 per token, not renormalised (as OLMoE's are)
        cfg = OlmoeConfig(**(common | {"intermediate_size": 48}), tie_word_embeddings=False, num_experts=6,
                          num_experts_per_tok=2, norm_topk_prob=False, pad_token_id=0)
        model = OlmoeForCausalLM(cfg)
    elif arch == "olmo2":
        cfg = Olmo2Config(**common, tie_word_embeddings=False, rope_theta=500000.0, pad_token_id=0)
        model = Olmo2ForCausalLM(cfg)
    elif arch == "granite":
        cfg = GraniteConfig(**common, tie_word_embeddings=True, embedding_multiplier=3.0, residual_multiplier=0.4,
                            attention_multiplier=0.05, logits_scaling=2.5)
        model = GraniteForCausalLM(cfg)
    elif arch == "smollm3":  # layer 3 of 5 without rope
        cfg = SmolLM3Config(**(common | {"num_hidden_layers": 5}), tie_word_embeddings=True, rope_theta=50000.0,
                            pad_token_id=None)
        model = SmolLM3ForCausalLM(cfg)
    elif arch == "qwen3":
        assert not mlp_bias, "qwen3 has no MLP biases"
        cfg = Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0,
                          attention_bias=attention_bias)
        model = Qwen3ForCausalLM(cfg)
    else:
        assert not (attention_bias or mlp_bias), "qwen2 has q/k/v biases and no others"
        cfg = Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)
        model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # random (non-zero) biases, non-trivial norm weights
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.3)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_word_tokenizer(folder, common["vocab_size"])
    return model


def write_gguf_from_hf(model, path: Path, arch: str, extra: dict[str, np.ndarray] | None = None,
                       types: dict[str, str] | None = None) -> Path:
    """Write ``model`` (a tiny transformers llama / qwen2 / qwen3 / smollm3 / gemma3 / phi3...) as a
    GGUF the way llama.cpp's converter does: llama Q/K rows permuted for interleaved rotary, tied
    lm_head omitted, llama3 rope factors as ``rope_freqs.weight``, phi3's fused matrices as they
    are and its long rope's factors, plus a small gpt2-style tokenizer.
    ``types``: the GGUF type of layer tensors by name (``{"attn_v": "Q8_0"}``; float32 otherwise).
    Every tensor of the model is written (AssertionError otherwise), then the ``extra`` ones."""
    import gguf

    from shards.importers.hf import llama3_freq_factors

    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if arch in ("gemma3", "gemma2"):  # the converter stores each of Gemma's norms as 1 + w
        sd = {k: v + 1.0 if k.endswith("norm.weight") else v for k, v in sd.items()}
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads

    def permute(w: np.ndarray, heads: int) -> np.ndarray:
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    moe = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if moe:  # experts fused as transformers holds them: [experts, gate + up, hidden], [experts, hidden, ff]
        for key in [k for k in sd if k.endswith("mlp.experts.gate_up_proj")]:
            gate_up = sd.pop(key)
            half = gate_up.shape[1] // 2
            sd[key.replace("gate_up_proj", "gate_proj")], sd[key.replace("gate_up_proj", "up_proj")] = \
                gate_up[:, :half], gate_up[:, half:]
    gguf_arch = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}.get(arch, arch)
    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if hd != cfg.hidden_size // n_heads:
        w.add_key_length(hd)
        w.add_value_length(hd)
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # gemma3: one set per attention kind, the global one in the file
    theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    w.add_rope_freq_base(theta)
    if moe:
        w.add_expert_count(moe)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
            for key in [k for k in sd if k.endswith("mlp.shared_expert_gate.weight")]:
                sd[key] = sd[key].reshape(-1)  # llama.cpp writes the gate's one row as a vector
    if arch in ("gemma3", "gemma2") or (arch == "phi3" and cfg.sliding_window):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "phi3":  # (Phi-4-mini's partial rotary: fewer dims than the head's)
        w.add_rope_dimension_count(int(hd * cfg.rope_parameters.get("partial_rotary_factor", 1.0)))
    if rope.get("rope_type") == "longrope":  # phi3's, as llama.cpp's converter writes it
        original = cfg.original_max_position_embeddings
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))) if scale > 1 else 1.0)
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    if arch == "granite":
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    w.add_vocab_size(cfg.vocab_size)
    tokens = ["<unk>", "<s>", "</s>", "ab"] + [chr(c) for c in range(33, 33 + cfg.vocab_size - 4)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", np.array(llama3_freq_factors(hd, theta, rope), np.float32))
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
             "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate_proj.bias": "ffn_gate.bias",
             "mlp.up_proj.bias": "ffn_up.bias", "mlp.down_proj.bias": "ffn_down.bias",
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
             "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.experts.gate_proj": "ffn_gate_exps.weight",
             "mlp.experts.up_proj": "ffn_up_exps.weight", "mlp.experts.down_proj": "ffn_down_exps.weight",
             "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",
             "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
             "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
             "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
             "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"}
    if arch == "olmo2":  # norms of the sublayers' outputs only
        names = {k: v for k, v in names.items() if not k.endswith("layernorm.weight")}
        names |= {"post_attention_layernorm.weight": "post_attention_norm.weight",
                  "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
    if arch in ("gemma3", "gemma2"):  # Gemma's four norms
        names |= {"post_attention_layernorm.weight": "post_attention_norm.weight",
                  "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                  "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
    written = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            key = f"model.layers.{i}.{hf}"
            if key not in sd:
                continue
            written.add(key)
            t = sd[key]
            if arch in ("llama", "smollm3", "granite", "mixtral") and gg.startswith("attn_q."):
                t = permute(t, n_heads)
            elif arch in ("llama", "smollm3", "granite", "mixtral") and gg.startswith("attn_k."):
                t = permute(t, n_kv)
            qtype = (types or {}).get(gg.removesuffix(".weight"))
            if qtype:
                quantised = gguf.quants.quantize(np.ascontiguousarray(t), gguf.GGMLQuantizationType[qtype])
                w.add_tensor(f"blk.{i}.{gg}", quantised, raw_dtype=gguf.GGMLQuantizationType[qtype])
            else:
                w.add_tensor(f"blk.{i}.{gg}", np.ascontiguousarray(t))
    assert set(sd) <= written, f"not written to the GGUF: {sorted(set(sd) - written)}"
    for name, t in (extra or {}).items():
        w.add_tensor(name, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_tensors(checkpoint: Path, extra: dict[str, np.ndarray]) -> None:
    """Add ``extra`` tensors to a one-file Hugging Face checkpoint's ``model.safetensors``."""
    from shards.store.tensorfile import read_tensors, write_tensors

    path = checkpoint / "model.safetensors"
    write_tensors(path, read_tensors(path) | extra)


def load_dequantised(model, model_dir: Path, manifest) -> None:
    """Replace ``model``'s (a tiny transformers llama / qwen2 / mixtral...) linear weights, embedding and lm_head
    by those a q4 import stored, dequantised (the lm_head untied; biases are stored as they are)."""
    import torch

    from shards.importers.quant import dequantize
    from shards.importers.stored_form import load_stored

    def deq(t: dict, name: str) -> torch.Tensor:
        return torch.from_numpy(dequantize({k[len(name) + 1:]: v for k, v in t.items() if k.startswith(name + ".")}))

    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            t = load_stored(model_dir, manifest, f"layer.{i}")
            fused = hasattr(layer.self_attn, "qkv_proj")  # phi3: q, k, v and gate, up in one matrix each
            if fused:
                layer.self_attn.qkv_proj.weight.copy_(torch.cat([deq(t, p) for p in ("q_proj", "k_proj", "v_proj")]))
                layer.mlp.gate_up_proj.weight.copy_(torch.cat([deq(t, "gate_proj"), deq(t, "up_proj")]))
            for proj in ("o_proj",) if fused else ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, proj).weight.copy_(deq(t, proj))
            if manifest.n_experts:  # transformers holds them fused: [experts, gate + up, hidden], [experts, hidden, ff]
                for e in range(manifest.n_experts):
                    layer.mlp.experts.gate_up_proj[e].copy_(torch.cat([deq(t, f"experts.{e}.gate_proj"),
                                                                       deq(t, f"experts.{e}.up_proj")]))
                    layer.mlp.experts.down_proj[e].copy_(deq(t, f"experts.{e}.down_proj"))
                continue
            for proj in ("down_proj",) if fused else ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, proj).weight.copy_(deq(t, proj))
        head, table = load_stored(model_dir, manifest, "head"), load_stored(model_dir, manifest, "embed")
        emb = table["embed"] if "embed" in table else deq(table, "embed").numpy()  # float16, or 8-bit
        hidden, vocab = model.config.hidden_size, model.config.vocab_size
        model.lm_head = torch.nn.Linear(hidden, vocab, bias=False)  # untie: the q4 head is 8-bit, the table f16
        model.lm_head.weight.copy_(deq(table, "embed") if manifest.shared_table else deq(head, "lm_head"))
        model.model.embed_tokens.weight.copy_(torch.from_numpy(emb.astype(np.float32)))
