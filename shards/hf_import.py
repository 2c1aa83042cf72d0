"""Read a Hugging Face model folder (config.json + *.safetensors + tokenizer.json).

Supported ``model_type``: ``llama`` (incl. ``rope_scaling`` type "llama3") and ``qwen2``
(q/k/v biases, tied embeddings). Tensors are read with numpy (see :mod:`shards.tensorfile`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from shards.errors import ModelFormatError, TokenizerError, UnsupportedArchitectureError
from shards.tensorfile import read_header, read_tensors

log = logging.getLogger(__name__)
SUPPORTED = ("llama", "qwen2")
_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_norm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
}


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
    """A Hugging Face checkpoint folder opened for import."""

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
        self.params = self._params()

    def _params(self) -> dict[str, Any]:
        c = self.config
        try:
            hidden = int(c["hidden_size"])
            n_heads = int(c["num_attention_heads"])
            head_dim = int(c.get("head_dim") or hidden // n_heads)
            rp = c.get("rope_parameters") or {}  # transformers >= 5 nests rope settings here
            theta = float(c.get("rope_theta", rp.get("rope_theta", 10000.0)))
            rs = c.get("rope_scaling") or rp
            ff = None
            if c.get("hidden_act", "silu") != "silu" or c.get("mlp_bias"):
                raise UnsupportedArchitectureError(f"{self.path.name}: only bias-free SiLU MLPs are supported")
            if c.get("use_sliding_window"):
                raise UnsupportedArchitectureError(f"{self.path.name}: sliding-window attention is not supported")
            if rs:
                kind = rs.get("rope_type", rs.get("type"))
                if kind == "llama3":
                    ff = llama3_freq_factors(head_dim, theta, rs)
                elif kind == "linear":
                    ff = (float(rs["factor"]),) * (head_dim // 2)
                elif kind not in (None, "default"):
                    raise UnsupportedArchitectureError(f"{self.path.name}: rope scaling {kind!r} is not supported")
            tied = bool(c.get("tie_word_embeddings", False)) or "lm_head.weight" not in self.index
            bias = self.arch == "qwen2" or bool(c.get("attention_bias", False))
            if bias and "model.layers.0.self_attn.q_proj.bias" not in self.index:
                bias = False
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
                "context_length": int(c.get("max_position_embeddings", 4096)),
                "tied_embeddings": tied,
                "attention_bias": bias,
                "rope_freq_factors": ff,
            }
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFormatError(f"{self.path.name}: config.json lacks or garbles {e}") from e

    def _get(self, name: str) -> np.ndarray:
        f = self.index.get(name)
        if f is None:
            raise ModelFormatError(f"{self.path.name}: tensor {name} is missing")
        return read_tensors(f, [name])[name].astype(np.float32, copy=False)

    def layer(self, i: int) -> dict[str, np.ndarray]:
        out = {}
        for hname, cname in _LAYER_NAMES.items():
            full = f"model.layers.{i}.{hname}"
            if cname.endswith("_bias") and not self.params["attention_bias"]:
                continue
            out[cname] = self._get(full)
        return out

    def embed(self) -> np.ndarray:
        return self._get("model.embed_tokens.weight")

    def head(self) -> dict[str, np.ndarray]:
        w = self._get("model.embed_tokens.weight" if self.params["tied_embeddings"] else "lm_head.weight")
        return {"norm": self._get("model.norm.weight"), "lm_head": w}

    def tokenizer_spec(self) -> Any:
        from shards.tokenizer import tokenizer_spec_from_hf

        return tokenizer_spec_from_hf(self.path)

    def digest(self) -> str:
        h = hashlib.sha256()
        for f in [self.path / "config.json", *self.files, self.path / "tokenizer.json"]:
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                while block := fh.read(1 << 22):
                    h.update(block)
        return h.hexdigest()
