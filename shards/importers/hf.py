"""Read a Hugging Face model folder (config.json + *.safetensors + tokenizer.json).

Supported ``model_type``: ``llama`` (incl. ``rope_scaling`` type "llama3", ``attention_bias``:
q/k/v/o biases, ``mlp_bias``: gate/up/down biases), ``qwen2`` (q/k/v biases, tied
embeddings), ``qwen3`` (a per-head RMS norm of queries and keys, ``attention_bias``: q/k/v/o
biases), ``mistral`` (llama's maths, its sliding window, if any, on every layer)
``smollm3`` (llama's maths, some layers without rotary positions: ``no_rope_layers``),
``granite`` (llama's maths with multipliers of the embedding, the attention scores, the
sublayers' outputs and the logits), ``olmo2`` (norms of the sublayers' outputs instead of
their inputs, query and key norms over the whole projection), ``mixtral``, ``qwen3_moe``,
``qwen2_moe`` and ``olmoe`` (a mixture of experts in every layer; qwen3_moe with qwen3's query
and key norms, qwen2_moe with qwen2's biases and a shared expert, olmoe with query and key norms
over the whole projection) and
``phi3`` (Phi-3, Phi-4: llama's maths with fused query/key/value and gate/up matrices, split at
import; its sliding window on every layer; long rope up to the original context) and
``gemma3_text`` (Gemma 3: norms that scale by 1 + w, stored as the plain weight they amount to,
norms around both sublayers, per-head query/key norms, GeGLU, a scaled embedding, sliding-window
layers with a rotary base of their own). Tensors are read with numpy (see :mod:`shards.store.tensorfile`). Every tensor of the
checkpoint must be one the config calls for, or on :data:`IGNORED_LAYER_TENSORS`; a tied
checkpoint may also store ``lm_head.weight`` if it equals the embedding.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from shards.errors import ModelFormatError, TokenizerError, UnmappedTensorError, UnsupportedArchitectureError
from shards.importers.fused import SPLITS, split_fused
from shards.importers.rotary import rotary_params
from shards.store.tensorfile import read_header, read_tensors
from shards.store.verify import hash_file

log = logging.getLogger(__name__)
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "gemma3_text", "granite", "olmo2", "mixtral",
             "qwen3_moe", "phi3", "gemma2", "olmoe", "qwen2_moe")
# Phi-3 and Phi-4 fuse the query, key and value projections in one matrix, and the MLP's gate
# and up ones in another (gate first): split into llama's at import.
_PHI3_FUSED = {"self_attn.qkv_proj.weight": "qkv_proj", "mlp.gate_up_proj.weight": "gate_up_proj"}
_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_norm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
}
_QKV_BIASES = {"self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias", "self_attn.v_proj.bias": "v_bias"}
_O_BIAS = {"self_attn.o_proj.bias": "o_bias"}
_MLP_BIASES = {"mlp.gate_proj.bias": "gate_bias", "mlp.up_proj.bias": "up_bias", "mlp.down_proj.bias": "down_bias"}
_QK_NORMS = {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}
# Gemma's four norms: before and after the attention, before and after the MLP.
_OLMO2_NORMS = {"post_attention_layernorm.weight": "attn_out_norm", "post_feedforward_layernorm.weight": "mlp_out_norm"}
_GEMMA_NORMS = {"input_layernorm.weight": "input_norm", "post_attention_layernorm.weight": "attn_out_norm",
                "pre_feedforward_layernorm.weight": "post_norm", "post_feedforward_layernorm.weight": "mlp_out_norm"}
GEMMA3, GEMMA2 = "gemma3_text", "gemma2"
GEMMAS = (GEMMA3, GEMMA2)
GELU_TANH_NAMES = ("gelu_pytorch_tanh", "gelu_tanh")
# Per-layer tensors (``model.layers.N.<name>``) skipped by name because they hold nothing the
# model needs: rotary inverse frequencies, a buffer older transformers versions saved, which
# the rope settings of config.json determine.
IGNORED_LAYER_TENSORS = ("self_attn.rotary_emb.inv_freq",)


def llama3_freq_factors(head_dim: int, theta: float, scaling: dict[str, Any]) -> tuple[float, ...]:
    """Per-frequency divisors of Llama 3 rope scaling (inv_freq / scaled inv_freq)."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    out = []
    for i in range(head_dim // 2):
        inv = 1.0 / theta ** (2 * i / head_dim)
        wavelen = 2 * math.pi / inv
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(out)


class HfSource:
    """A Hugging Face checkpoint folder opened for import.

    Over 250 lines: one reader of the config and tensor names per architecture family, all
    over the same opened safetensors files."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise ModelFormatError(f"{self.path}: config.json is missing")
        try:
            self.config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ModelFormatError(f"{cfg_path}: not valid JSON ({e})") from e
        mt = self.config.get("model_type")
        if mt not in SUPPORTED:
            raise UnsupportedArchitectureError(
                f"{self.path.name}: model_type {mt!r} is not supported (supported: {', '.join(SUPPORTED)})")
        self.arch = mt
        if not (self.path / "tokenizer.json").is_file():
            raise TokenizerError(f"{self.path.name}: tokenizer.json is missing")
        index_file = self.path / "model.safetensors.index.json"
        if index_file.is_file():  # sharded checkpoint: only the files the index names
            try:
                names = sorted(set(json.loads(index_file.read_text(encoding="utf-8"))["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ModelFormatError(f"{index_file.name}: malformed ({e})") from e
            files = [self.path / n for n in names]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ModelFormatError(f"{self.path.name}: weight shard(s) missing: {', '.join(missing[:3])}")
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelFormatError(f"{self.path.name}: no *.safetensors weight files")
        self.files = files
        self.index: dict[str, Path] = {}
        for f in files:
            header, _ = read_header(f)
            for name in header:
                self.index[name] = f
        self.prefix = "model."
        self.consumed: set[str] = set()
        self.params = self._params()
        self._layer_map = dict(_LAYER_NAMES)
        if self.params.get("n_experts"):  # the experts and their router instead of the MLP
            moe = "block_sparse_moe" if self.arch == "mixtral" else "mlp"
            names = (("w1", "w3", "w2") if self.arch == "mixtral" else ("gate_proj", "up_proj", "down_proj"))
            self._layer_map = {k: v for k, v in _LAYER_NAMES.items() if not k.startswith("mlp.")}
            self._layer_map[f"{moe}.gate.weight"] = "router"
            for e in range(self.params["n_experts"]):
                for hname, cname in zip(names, ("gate_proj", "up_proj", "down_proj")):
                    self._layer_map[f"{moe}.experts.{e}.{hname}.weight"] = f"experts.{e}.{cname}"
            if self.params.get("shared_expert_intermediate_size"):
                self._layer_map |= {f"mlp.shared_expert.{n}.weight": f"shared_expert.{n}"
                                    for n in ("gate_proj", "up_proj", "down_proj")}
                self._layer_map["mlp.shared_expert_gate.weight"] = "shared_expert_gate"
        if self.arch == "phi3":
            self._layer_map = {k: v for k, v in _LAYER_NAMES.items()
                               if v not in {n for names in SPLITS.values() for n in names}} | _PHI3_FUSED
        if self.arch in (*GEMMAS, "olmo2"):
            self._layer_map = {k: v for k, v in _LAYER_NAMES.items() if not k.endswith("layernorm.weight")} | (
                _GEMMA_NORMS if self.arch in GEMMAS else _OLMO2_NORMS)
        for on, names in ((self.params["attention_bias"], _QKV_BIASES),
                          (self.params["attention_output_bias"], _O_BIAS), (self.params["mlp_bias"], _MLP_BIASES),
                          (self.params["qk_norm"], _QK_NORMS)):
            if on:
                self._layer_map |= names

    def _params(self) -> dict[str, Any]:
        c = self.config
        if self.arch in GEMMAS:
            return self._gemma_params()
        try:
            hidden = int(c["hidden_size"])
            n_heads = int(c["num_attention_heads"])
            head_dim = int(c.get("head_dim") or hidden // n_heads)
            rp = c.get("rope_parameters") or {}  # transformers >= 5 nests rope settings here
            theta = float(c.get("rope_theta", rp.get("rope_theta", 10000.0)))
            rs = c.get("rope_scaling") or rp
            ff, scaled = None, {}
            if c.get("hidden_act", "silu") != "silu":
                raise UnsupportedArchitectureError(f"{self.path.name}: only SiLU MLPs are supported")
            window = c.get("sliding_window") if self.arch in ("mistral", "mixtral", "phi3") else None  # (qwen's: off)
            context = int(c.get("max_position_embeddings", 4096))
            partial = float(c.get("partial_rotary_factor", rp.get("partial_rotary_factor", 1.0)))
            rotary = rotary_params(self.path.name, self.arch, int(head_dim * partial), head_dim)
            width = rotary.get("rotary_dim", head_dim)
            if rs:
                kind = rs.get("rope_type", rs.get("type"))
                if kind == "llama3":
                    ff = llama3_freq_factors(head_dim, theta, rs)
                elif kind == "linear":
                    ff = (float(rs["factor"]),) * (width // 2)
                elif kind in ("longrope", "su") and self.arch == "phi3":
                    ff, context, scaled = self._longrope(rs, width, context)
                elif kind not in (None, "default"):
                    raise UnsupportedArchitectureError(f"{self.path.name}: rope scaling {kind!r} is not supported")
            sliding = window is not None and int(window) < context  # (mistral's, mixtral's, phi3's: every layer's)
            if c.get("use_sliding_window") or any(t != "full_attention" for t in c.get("layer_types") or ()):
                raise UnsupportedArchitectureError(f"{self.path.name}: sliding-window attention is not supported")
            tied = bool(c.get("tie_word_embeddings", False)) or "lm_head.weight" not in self.index
            # as transformers builds them: qwen2 has q/k/v biases only; llama's and qwen3's
            # attention_bias gives q/k/v and o_proj biases, llama's mlp_bias gate/up/down ones
            llama = self.arch in ("llama", "granite")  # (granite: llama's biases)
            qwen2 = self.arch in ("qwen2", "qwen2_moe")  # q/k/v biases (qwen2_moe: unless qkv_bias is false)
            attention_bias = bool(c.get("qkv_bias", True)) if qwen2 else bool(c.get("attention_bias", False))
            return {
                "architecture": self.arch,
                "n_layers": int(c["num_hidden_layers"]),
                "hidden_size": hidden,
                "intermediate_size": int(c["intermediate_size"]),
                "n_heads": n_heads,
                "n_kv_heads": int(c.get("num_key_value_heads") or n_heads),
                "head_dim": head_dim,
                "vocab_size": int(c["vocab_size"]),
                "rope_theta": theta,
                "rms_norm_eps": float(c.get("rms_norm_eps", 1e-6)),
                "context_length": context,
                "tied_embeddings": tied,
                "attention_bias": attention_bias,
                "attention_output_bias": not qwen2 and attention_bias,
                "mlp_bias": llama and bool(c.get("mlp_bias", False)),
                "rope_freq_factors": ff,
                "qk_norm": self.arch in ("qwen3", "olmo2", "qwen3_moe", "olmoe"),
                "qk_norm_whole": self.arch in ("olmo2", "olmoe"),
                "pre_sublayer_norms": self.arch != "olmo2",
                "post_sublayer_norms": self.arch == "olmo2",
                "layers_without_rope": self._layers_without_rope(),
                # a window on every layer (Mistral 7B v0.1: 4096 positions; Phi-3's 4k models: 2047)
                **({"sliding_window": int(window), "sliding_layers": tuple(range(int(c["num_hidden_layers"])))}
                   if sliding else {}),
                **scaled,
                **rotary,
                **self._granite_multipliers(),
                **self._experts(),
            }
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFormatError(f"{self.path.name}: config.json lacks or garbles {e}") from e

    def _longrope(self, rs: dict[str, Any], width: int, context: int) -> tuple[tuple[float, ...], int, dict]:
        """Phi-3's long rope, as transformers computes it up to the original context: the short
        factors divide the rotary frequencies, and the rotation is scaled by an attention factor
        (sqrt(1 + ln(context / original) / ln(original)) unless given) that multiplies its cos and
        sin (so the turned dims' share of the scores by its square). The context is capped at the
        original one: past it transformers turns to the long factors, which ncm does not hold."""
        c = self.config
        original = int(c.get("original_max_position_embeddings") or rs.get("original_max_position_embeddings")
                       or context)
        short = tuple(float(x) for x in rs["short_factor"])
        if len(short) != width // 2:  # one per frequency of the rotated dims
            raise ModelFormatError(f"{self.path.name}: rope short_factor has {len(short)} values, not {width // 2}")
        factor = context / original
        attention = rs.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        scale = {"rotary_scale": float(attention)} if attention != 1.0 else {}
        return short, min(context, original), scale

    def _gemma_params(self) -> dict[str, Any]:
        """Gemma 3 and Gemma 2: Gemma 2 has no query/key norms, a window on every other layer
        (the first included) with the global rotary base, and soft-capped scores and logits."""
        c, name, gemma2 = self.config, self.path.name, self.arch == GEMMA2
        try:
            hidden, n_heads, n_layers = int(c["hidden_size"]), int(c["num_attention_heads"]), int(c["num_hidden_layers"])
            head_dim = int(c.get("head_dim") or hidden // n_heads)
            if not gemma2 and (c.get("final_logit_softcapping") or c.get("attn_logit_softcapping")):
                raise UnsupportedArchitectureError(f"{name}: logit soft-capping is not supported for gemma3")
            if c.get("use_bidirectional_attention"):
                raise UnsupportedArchitectureError(f"{name}: bidirectional attention is not supported")
            if (c.get("hidden_activation") or c.get("hidden_act")) not in GELU_TANH_NAMES:
                raise UnsupportedArchitectureError(f"{name}: only GELU (tanh) MLPs are supported for {self.arch}")
            pattern = 2 if gemma2 else int(c.get("sliding_window_pattern", 6))  # gemma2: layer 0 slides, 1 not...
            kinds = c.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                             for i in range(n_layers)]
            if len(kinds) != n_layers or set(kinds) - {"full_attention", "sliding_attention"}:
                raise ModelFormatError(f"{name}: layer_types must name full_attention or sliding_attention per layer")
            rp = c.get("rope_parameters") or {}
            if "full_attention" in rp:  # transformers >= 5: one set per attention kind
                full, local_theta = rp["full_attention"], float(rp.get("sliding_attention", {}).get("rope_theta", 1e4))
                theta = float(full.get("rope_theta", 1e6))
            else:
                full = c.get("rope_scaling") or rp
                theta = float(c.get("rope_theta", rp.get("rope_theta", 1e4 if gemma2 else 1e6)))
                local_theta = theta if gemma2 else float(c.get("rope_local_base_freq", 1e4))
            kind = full.get("rope_type", full.get("type"))
            if kind not in (None, "default", "linear"):
                raise UnsupportedArchitectureError(f"{name}: rope scaling {kind!r} is not supported")
            sliding = tuple(i for i, k in enumerate(kinds) if k == "sliding_attention")
            return {
                "architecture": "gemma2" if gemma2 else "gemma3", "n_layers": n_layers, "hidden_size": hidden,
                "intermediate_size": int(c["intermediate_size"]), "n_heads": n_heads,
                "n_kv_heads": int(c.get("num_key_value_heads") or n_heads), "head_dim": head_dim,
                "vocab_size": int(c["vocab_size"]), "rope_theta": theta, "rms_norm_eps": float(c.get("rms_norm_eps", 1e-6)),
                "context_length": int(c.get("max_position_embeddings", 32768)), "tied_embeddings": True,
                "attention_bias": False, "attention_output_bias": False, "mlp_bias": False,
                "rope_freq_factors": (float(full["factor"]),) * (head_dim // 2) if kind == "linear" else None,
                "qk_norm": not gemma2, "post_sublayer_norms": True, "embedding_scale": math.sqrt(hidden),
                "activation": "gelu_tanh", "attention_scale": float(c.get("query_pre_attn_scalar", head_dim)) ** -0.5,
                "sliding_window": int(c["sliding_window"]) if sliding else 0, "sliding_layers": sliding,
                "sliding_rope_theta": local_theta if sliding and local_theta != theta else None,
                "attention_softcap": float(c.get("attn_logit_softcapping") or 0.0),
                "logit_softcap": float(c.get("final_logit_softcapping") or 0.0),
            }
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFormatError(f"{name}: config.json lacks or garbles {e}") from e

    def _experts(self) -> dict[str, Any]:
        c = self.config
        if self.arch == "mixtral":  # softmax, top k, renormalised
            return {"n_experts": int(c["num_local_experts"]), "experts_per_token": int(c["num_experts_per_tok"]),
                    "expert_intermediate_size": int(c["intermediate_size"]), "renormalize_experts": True}
        if self.arch == "olmoe":  # softmax, top k, renormalised where norm_topk_prob says so
            if c.get("clip_qkv"):
                raise UnsupportedArchitectureError(f"{self.path.name}: clipped query/key/value (clip_qkv) is not "
                                                   "supported")
            return {"n_experts": int(c["num_experts"]), "experts_per_token": int(c["num_experts_per_tok"]),
                    "expert_intermediate_size": int(c["intermediate_size"]),
                    "renormalize_experts": bool(c.get("norm_topk_prob", False))}
        if self.arch in ("qwen3_moe", "qwen2_moe"):
            if int(c.get("decoder_sparse_step", 1)) != 1 or c.get("mlp_only_layers"):
                raise UnsupportedArchitectureError(f"{self.path.name}: layers without experts (decoder_sparse_step, "
                                                   "mlp_only_layers) are not supported")
            # (transformers >= 5 writes num_local_experts)
            return {"n_experts": int(c.get("num_experts") or c["num_local_experts"]),
                    "experts_per_token": int(c["num_experts_per_tok"]),
                    "expert_intermediate_size": int(c["moe_intermediate_size"]),
                    "renormalize_experts": bool(c.get("norm_topk_prob", False)),
                    # qwen2_moe: a shared expert every row runs, gated by a sigmoid
                    **({"shared_expert_intermediate_size": int(c["shared_expert_intermediate_size"])}
                       if self.arch == "qwen2_moe" else {})}
        return {}

    def _granite_multipliers(self) -> dict[str, Any]:
        c = self.config
        if self.arch != "granite":
            return {}
        return {"embedding_scale": float(c.get("embedding_multiplier", 1.0)),
                "residual_scale": float(c.get("residual_multiplier", 1.0)),
                "attention_scale": float(c.get("attention_multiplier", 1.0)),
                "logit_scale": 1.0 / float(c.get("logits_scaling", 1.0))}

    def _layers_without_rope(self) -> tuple[int, ...]:
        """SmolLM3's ``no_rope_layers`` (1: the layer rotates, 0: it does not), or its interval."""
        c = self.config
        if self.arch != "smollm3":
            return ()
        n = int(c["num_hidden_layers"])
        flags = c.get("no_rope_layers")
        if flags is None:
            interval = int(c.get("no_rope_layer_interval", 4))
            flags = [int((i + 1) % interval != 0) for i in range(n)]
        if len(flags) != n:
            raise ModelFormatError(f"{self.path.name}: no_rope_layers names {len(flags)} layers of {n}")
        return tuple(i for i, rotates in enumerate(flags) if not rotates)

    def tensor_names(self) -> set[str]:
        return set(self.index)

    def planned_names(self) -> set[str]:
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if "lm_head.weight" in self.index:  # read, or (tied) compared with the embedding
            names.add("lm_head.weight")
        for i in range(self.params["n_layers"]):
            names.update(f"model.layers.{i}.{hname}" for hname in self._layer_map)
        return names

    def ignored_names(self) -> set[str]:
        n = self.params["n_layers"]
        return {f"model.layers.{i}.{s}" for i in range(n) for s in IGNORED_LAYER_TENSORS} & set(self.index)

    def _get(self, name: str) -> np.ndarray:
        f = self.index.get(name)
        if f is None:
            raise ModelFormatError(f"{self.path.name}: tensor {name} is missing")
        self.consumed.add(name)
        return read_tensors(f, [name])[name].astype(np.float32, copy=False)

    def layer(self, i: int, blocks: bool = False) -> dict[str, np.ndarray]:
        """Float32 tensors of layer ``i`` (a folder holds no quantised blocks: ``blocks`` changes nothing)."""
        t = {cname: self._get(f"model.layers.{i}.{hname}") for hname, cname in self._layer_map.items()}
        for fused in [name for name in t if name in SPLITS]:  # phi3's
            t |= split_fused(self.params, fused, t.pop(fused))
        if self.arch in GEMMAS:  # x * (1 + w): the plain RMS norm of weight 1 + w
            t = {cname: a + np.float32(1.0) if cname.endswith("norm") else a for cname, a in t.items()}
        return t

    def quantised(self) -> bool:
        """A folder's safetensors hold float weights."""
        return False

    def embed(self, blocks: bool = False) -> np.ndarray:
        return self._get("model.embed_tokens.weight")

    def head(self, blocks: bool = False) -> dict[str, np.ndarray]:
        norm = self._get("model.norm.weight") + np.float32(1.0 if self.arch in GEMMAS else 0.0)
        if not self.params["tied_embeddings"]:
            return {"norm": norm, "lm_head": self._get("lm_head.weight")}
        w = self._get("model.embed_tokens.weight")
        if "lm_head.weight" in self.index:  # a stored copy of the tied matrix is fine, another matrix is not
            copy = self._get("lm_head.weight")
            if copy.shape != w.shape or not np.array_equal(copy, w):
                raise UnmappedTensorError(f"{self.path.name}: lm_head.weight differs from the embedding that "
                                          "config.json ties it to, so the import would drop it", ["lm_head.weight"])
        return {"norm": norm, "lm_head": w}

    def tokenizer_spec(self) -> Any:
        from shards.text.tokenizer_hf import tokenizer_spec_from_hf

        return tokenizer_spec_from_hf(self.path)

    def narrow_tensors(self, i: int) -> frozenset[str]:
        """None: a Hugging Face checkpoint holds floats (a mixed store keeps them in 8 bits)."""
        return frozenset()

    def digest(self) -> str:
        h = hashlib.sha256()
        for f in [self.path / "config.json", *self.files, self.path / "tokenizer.json"]:
            h.update(f.name.encode())
            hash_file(f, h)
        return h.hexdigest()
