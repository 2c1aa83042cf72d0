"""Read a GGUF file (llama incl. Mixtral / qwen2 / qwen2moe / qwen3 / qwen3moe / olmoe / smollm3 / gemma3 / gemma2 / granite / olmo2 / phi3) as float32 tensors with ncm's canonical names.

llama.cpp's converter permutes the rows of llama's (smollm3's, granite's) ``attn_q`` / ``attn_k`` so that rotary pairs
are interleaved (GPT-J style); we undo that permutation so stored weights are in the Hugging
Face layout (rotate-half rotary), the layout every ncm fragment uses. qwen2 and qwen3 are not
permuted.

Optional tensors are all-or-nothing per model, decided by layer 0: ``attn_q/k/v.bias``
(q/k/v biases), ``attn_output.bias``, ``ffn_gate/up/down.bias`` and ``attn_q_norm/attn_k_norm``
(qwen3's per-head query and key norms). gemma3 has its four norms per layer (llama.cpp's
converter stores Gemma's 1 + w as the norm weight, which is what ncm stores too). Every tensor of the file
must be one of the model's or on :data:`IGNORED_LAYER_TENSORS`.

For a block store, the linear weights of quantised types, the embedding and the output layer
come as the file's blocks (:class:`~shards.importers.gguf_blocks.QuantBlocks`, ``blocks=True``),
their rows moved as the float ones would be.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from shards.errors import ModelFormatError, UnsupportedArchitectureError
from shards.importers.fused import SPLITS, split_fused
from shards.importers.gguf_blocks import QuantBlocks
from shards.importers.linear import is_linear
from shards.importers.rotary import rotary_params
from shards.store.verify import hash_file

log = logging.getLogger(__name__)
SUPPORTED = ("llama", "qwen2", "qwen3", "smollm3", "gemma3", "granite", "olmo2", "qwen3moe", "phi3", "gemma2",
             "olmoe", "qwen2moe")
# Qwen2-MoE's shared expert, and its gate (a vector in the file: one row of the gate's matrix)
_SHARED_EXPERT = {"ffn_gate_shexp.weight": "shared_expert.gate_proj", "ffn_up_shexp.weight": "shared_expert.up_proj",
                  "ffn_down_shexp.weight": "shared_expert.down_proj", "ffn_gate_inp_shexp.weight": "shared_expert_gate"}
# phi3 fuses the query, key and value projections (attn_qkv) and the gate and up ones (ffn_up,
# gate first): split into llama's at import.
_PHI3_LAYER = {"attn_norm.weight": "input_norm", "ffn_norm.weight": "post_norm", "attn_qkv.weight": "qkv_proj",
               "attn_output.weight": "o_proj", "ffn_up.weight": "gate_up_proj", "ffn_down.weight": "down_proj"}
# A mixture of experts: the router, and each projection of every expert in one 3-D tensor.
_EXPERT_TENSORS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                   "ffn_down_exps.weight": "down_proj"}
# SmolLM3 leaves the rotary out of every 4th layer; llama.cpp fixes the step (no GGUF key holds it).
SMOLLM3_NO_ROPE_STEP = 4
# GGUF tensor types of at most 4 bits (and a bit of scales) per weight: Q4_0, Q4_1, Q4_K, Q3_K,
# Q2_K, the IQ and ternary ones, the FP4 ones.
NARROW_TYPE_PREFIXES = ("Q1", "Q2", "Q3", "Q4", "IQ", "TQ", "MXFP4", "NVFP4")
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# Gemma 3 as llama.cpp runs it (none of it is in the file): every 6th layer global, the others
# sliding with rotary base 10000; scores scaled by 1/sqrt(head_dim), by 1/sqrt(hidden/heads) in
# the 27B (62 layers).
GEMMA3_GLOBAL_STEP = 6
GEMMA3_SLIDING_ROPE_THETA = 10000.0
GEMMA3_27B_LAYERS = 62
# Gemma 2 as llama.cpp runs it: even layers sliding, one rotary base, scores scaled by
# 1/sqrt(hidden/heads) in the 27B (46 layers), by 1/sqrt(head_dim) in the others.
GEMMA2_27B_LAYERS = 46
_LAYER_NAMES = {
    "attn_norm.weight": "input_norm",
    "ffn_norm.weight": "post_norm",
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_output.weight": "o_proj",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
}
_QKV_BIASES = {"attn_q.bias": "q_bias", "attn_k.bias": "k_bias", "attn_v.bias": "v_bias"}
_O_BIAS = {"attn_output.bias": "o_bias"}
_MLP_BIASES = {"ffn_gate.bias": "gate_bias", "ffn_up.bias": "up_bias", "ffn_down.bias": "down_bias"}
_QK_NORMS = {"attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm"}
_POST_NORMS = {"post_attention_norm.weight": "attn_out_norm", "post_ffw_norm.weight": "mlp_out_norm"}
# Per-layer tensors (``blk.N.<name>``) skipped by name because they hold nothing the model
# needs: rotary inverse frequencies (GGUF's name for Hugging Face's ``rotary_emb.inv_freq``
# buffer), which the rope metadata determines.
IGNORED_LAYER_TENSORS = ("attn_rot_embd",)
# Phi-3's long rope past the original context, which the import caps (see ``_phi3_params``).
PHI3_LONG_FACTORS = "rope_factors_long.weight"


def _linear(gname: str, cname: str) -> bool:
    """Whether the file's ``gname`` (ncm's ``cname``) holds linear weights: a projection, the
    experts' ones, or phi3's fused ones."""
    return cname in SPLITS or gname in _EXPERT_TENSORS or is_linear(cname)


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, rows (pair, 2) -> (2, pair)."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gemma3_params(field: Callable[..., Any], n_layers: int, hidden: int, n_heads: int,
                  head_dim: int) -> dict[str, Any]:
    """Gemma 3 as llama.cpp runs it (``field``: the file's metadata by key)."""
    window = int(field("gemma3.attention.sliding_window"))
    sliding = tuple(i for i in range(n_layers) if (i + 1) % GEMMA3_GLOBAL_STEP != 0) if window else ()
    scale_dim = hidden / n_heads if n_layers == GEMMA3_27B_LAYERS else head_dim
    return {"post_sublayer_norms": True, "embedding_scale": math.sqrt(hidden), "activation": "gelu_tanh",
            "attention_scale": float(scale_dim) ** -0.5, "sliding_window": window, "sliding_layers": sliding,
            "sliding_rope_theta": GEMMA3_SLIDING_ROPE_THETA if sliding else None}


def gemma2_params(field: Callable[..., Any], n_layers: int, hidden: int, n_heads: int,
                  head_dim: int) -> dict[str, Any]:
    """Gemma 2 as llama.cpp runs it (``field``: the file's metadata by key)."""
    window = int(field("gemma2.attention.sliding_window", 0))
    scale_dim = hidden / n_heads if n_layers == GEMMA2_27B_LAYERS else head_dim
    return {"post_sublayer_norms": True, "embedding_scale": math.sqrt(hidden), "activation": "gelu_tanh",
            "attention_scale": float(scale_dim) ** -0.5, "sliding_window": window,
            "sliding_layers": tuple(range(0, n_layers, 2)) if window else (),
            "attention_softcap": float(field("gemma2.attn_logit_softcapping", 0.0)),
            "logit_softcap": float(field("gemma2.final_logit_softcapping", 0.0))}


class GgufSource:
    """A GGUF model opened for import: ``params`` (manifest fields) and tensor getters."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as e:  # gguf raises ValueError/struct errors/IndexError on bad files
            raise ModelFormatError(f"{self.path.name}: not a readable GGUF file ({type(e).__name__}: {e})") from e
        arch = self._field("general.architecture")
        if arch not in SUPPORTED:
            raise UnsupportedArchitectureError(
                f"{self.path.name}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED)})")
        self.arch = arch
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.consumed: set[str] = set()
        self._check_sizes()
        self.params = self._params()
        self._layer_map = dict(_PHI3_LAYER if arch == "phi3" else _LAYER_NAMES)
        if self.params.get("n_experts"):  # the router and the experts' 3-D tensors instead of the MLP
            self._layer_map = {k: v for k, v in self._layer_map.items() if v not in ("gate_proj", "up_proj",
                                                                                     "down_proj")}
            self._layer_map |= {"ffn_gate_inp.weight": "router"} | _EXPERT_TENSORS
            if self.params.get("shared_expert_intermediate_size"):
                self._layer_map |= _SHARED_EXPERT
        if not self.params["pre_sublayer_norms"]:  # olmo2: no norms before the sublayers
            self._layer_map = {k: v for k, v in self._layer_map.items() if v not in ("input_norm", "post_norm")}
        for on, names in ((self.params["attention_bias"], _QKV_BIASES),
                          (self.params["attention_output_bias"], _O_BIAS), (self.params["mlp_bias"], _MLP_BIASES),
                          (self.params["qk_norm"], _QK_NORMS), (self.params["post_sublayer_norms"], _POST_NORMS)):
            if on:
                self._layer_map |= names

    def _field(self, key: str, default: Any = ModelFormatError) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            if default is ModelFormatError:
                raise ModelFormatError(f"{self.path.name}: GGUF metadata {key!r} is missing")
            return default
        v = f.contents()
        return v

    def _check_sizes(self) -> None:
        size = self.path.stat().st_size
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ModelFormatError(f"{self.path.name}: tensor {t.name} is truncated")

    def _params(self) -> dict[str, Any]:
        a = self.arch
        n_heads = int(self._field(f"{a}.attention.head_count"))
        hidden = int(self._field(f"{a}.embedding_length"))
        emb = self.tensors.get("token_embd.weight")
        if emb is None:
            raise ModelFormatError(f"{self.path.name}: token_embd.weight is missing")
        vocab = int(self._field(f"{a}.vocab_size", 0)) or int(emb.shape[-1])
        head_dim = int(self._field(f"{a}.attention.key_length", 0)) or hidden // n_heads
        rope_dim = int(self._field(f"{a}.rope.dimension_count", head_dim))
        rotary = rotary_params(self.path.name, a, rope_dim, head_dim)
        ff = None
        if "rope_freqs.weight" in self.tensors:  # llama3-style per-frequency divisors
            ff = tuple(float(x) for x in self._tensor("rope_freqs.weight").reshape(-1))
        kind = self._field(f"{a}.rope.scaling.type", "none")
        if kind == "linear":
            factor = float(self._field(f"{a}.rope.scaling.factor", 1.0))
            ff = tuple(f * factor for f in (ff or (1.0,) * (rope_dim // 2)))
        elif kind not in ("none", "") and not (a == "phi3" and kind in ("longrope", "su")):  # (phi3's: below)
            raise UnsupportedArchitectureError(f"{self.path.name}: rope scaling {kind!r} is not supported")
        kv = self._field(f"{a}.attention.head_count_kv", n_heads)
        n_layers = int(self._field(f"{a}.block_count"))
        phi3 = self._phi3_params(n_layers) if a == "phi3" else {}
        return {
            "architecture": a,
            "n_layers": n_layers,
            "hidden_size": hidden,
            "intermediate_size": int(self._field(f"{a}.feed_forward_length")),
            "n_heads": n_heads,
            "n_kv_heads": int(kv),
            "head_dim": head_dim,
            "vocab_size": vocab,
            "rope_theta": float(self._field(f"{a}.rope.freq_base", 10000.0)),
            "rms_norm_eps": float(self._field(f"{a}.attention.layer_norm_rms_epsilon")),
            "context_length": int(self._field(f"{a}.context_length")),
            "tied_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "attention_output_bias": "blk.0.attn_output.bias" in self.tensors,
            "mlp_bias": "blk.0.ffn_gate.bias" in self.tensors,
            "rope_freq_factors": ff,
            "qk_norm": a in ("qwen3", "gemma3", "olmo2", "qwen3moe", "olmoe"),
            "qk_norm_whole": a in ("olmo2", "olmoe"),
            "pre_sublayer_norms": a != "olmo2",
            "layers_without_rope": tuple(i for i in range(n_layers)
                                         if a == "smollm3" and (i + 1) % SMOLLM3_NO_ROPE_STEP == 0),
            "post_sublayer_norms": a == "olmo2",
            **self._experts(),
            **({"embedding_scale": float(self._field(f"{a}.embedding_scale", 1.0)),
                "residual_scale": float(self._field(f"{a}.residual_scale", 1.0)),
                "attention_scale": float(self._field(f"{a}.attention.scale", 1.0)),
                "logit_scale": 1.0 / float(self._field(f"{a}.logit_scale", 1.0))} if a == "granite" else {}),
            **(gemma3_params(self._field, n_layers, hidden, n_heads, head_dim) if a == "gemma3" else {}),
            **(gemma2_params(self._field, n_layers, hidden, n_heads, head_dim) if a == "gemma2" else {}),
            **phi3,
            **rotary,
        }

    def _phi3_params(self, n_layers: int) -> dict[str, Any]:
        """Phi-3's window on every layer, and its long rope as up to the original context: the
        short factors, the attention factor (the rotary's cos and sin scaled by it), the context
        capped there (past it llama.cpp, like transformers, turns to the long factors)."""
        context = int(self._field("phi3.context_length"))
        params: dict[str, Any] = {}
        if "rope_factors_short.weight" in self.tensors:
            params["rope_freq_factors"] = tuple(float(x) for x in self._tensor("rope_factors_short.weight").reshape(-1))
            context = min(context, int(self._field("phi3.rope.scaling.original_context_length", context)))
            params["context_length"] = context
            attention = float(self._field("phi3.rope.scaling.attn_factor", 1.0))
            if attention != 1.0:
                params["rotary_scale"] = attention
        window = int(self._field("phi3.attention.sliding_window", 0))
        if 0 < window < context:
            params |= {"sliding_window": window, "sliding_layers": tuple(range(n_layers))}
        return params

    def _experts(self) -> dict[str, Any]:
        """A mixture of experts (llama.cpp writes Mixtral as llama with experts): the router's
        top-k probabilities renormalised as llama.cpp runs Mixtral and Qwen3-MoE, as they are
        for OLMoE and Qwen2-MoE (whose shared expert every row runs)."""
        a = self.arch
        n = int(self._field(f"{a}.expert_count", 0))
        if not n:
            return {}
        shared = int(self._field(f"{a}.expert_shared_feed_forward_length", 0))
        return {"architecture": {"llama": "mixtral", "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}.get(a, a),
                "n_experts": n, **({"shared_expert_intermediate_size": shared} if shared else {}),
                "experts_per_token": int(self._field(f"{a}.expert_used_count")),
                "expert_intermediate_size": int(self._field(f"{a}.expert_feed_forward_length", 0))
                or int(self._field(f"{a}.feed_forward_length")),
                "renormalize_experts": a not in ("olmoe", "qwen2moe")}

    def tensor_names(self) -> set[str]:
        return set(self.tensors)

    def planned_names(self) -> set[str]:
        names = {"token_embd.weight", "output_norm.weight"}
        names.update(n for n in ("output.weight", "rope_freqs.weight", "rope_factors_short.weight")
                     if n in self.tensors)
        for i in range(self.params["n_layers"]):
            names.update(f"blk.{i}.{gname}" for gname in self._layer_map)
        return names

    def ignored_names(self) -> set[str]:
        n = self.params["n_layers"]
        names = {f"blk.{i}.{s}" for i in range(n) for s in IGNORED_LAYER_TENSORS} | {PHI3_LONG_FACTORS}
        return names & set(self.tensors)

    def _tensor(self, name: str, blocks: bool = False) -> np.ndarray:
        """Float32 in the checkpoint's shape (reversed GGUF dims); with ``blocks``, a quantised
        type's uint8 rows of blocks as the file holds them ([..., rows, row bytes])."""
        import gguf

        t = self.tensors.get(name)
        if t is None:
            raise ModelFormatError(f"{self.path.name}: tensor {name} is missing")
        self.consumed.add(name)
        if blocks and t.tensor_type.name not in FLOAT_TYPES:
            shape = tuple(int(d) for d in reversed(t.shape))
            return np.asarray(t.data).reshape(*shape[:-1], -1)
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise ModelFormatError(f"{self.path.name}: cannot dequantise {name} ({t.tensor_type.name}): {e}") from e
        arr = np.asarray(arr, dtype=np.float32)
        shape = tuple(int(d) for d in reversed(t.shape))
        return arr.reshape(shape)

    def layer(self, i: int, blocks: bool = False) -> dict[str, np.ndarray | QuantBlocks]:
        """Float32 tensors of layer ``i`` (HF layout, linear weights [out, in]); with ``blocks``,
        the linear weights of quantised types as the file's blocks (:class:`QuantBlocks`)."""
        out: dict[str, Any] = {}
        raw: dict[str, tuple[str, int]] = {}  # canonical name -> (type, cols) of those kept as blocks
        for gname, cname in self._layer_map.items():
            t = self.tensors.get(f"blk.{i}.{gname}")
            arr = self._tensor(f"blk.{i}.{gname}", blocks=blocks and _linear(gname, cname))
            if arr.dtype == np.uint8:
                names = SPLITS.get(cname, (cname,))
                count = int(arr.shape[0]) if gname in _EXPERT_TENSORS else 1
                raw |= {(f"experts.{e}.{n}" if gname in _EXPERT_TENSORS else n): (t.tensor_type.name, int(t.shape[0]))
                        for n in names for e in range(count)}
            if gname in _EXPERT_TENSORS:  # [experts, out, in]: one matrix per expert
                out |= {f"experts.{e}.{cname}": arr[e] for e in range(arr.shape[0])}
            elif cname == "shared_expert_gate":  # [hidden] in the file: the gate's one row
                out[cname] = arr.reshape(1, -1)
            elif cname in SPLITS:  # phi3's fused rows: q, k, v / gate, up
                out |= split_fused(self.params, cname, arr)
            else:
                out[cname] = arr
        if self.arch in ("llama", "smollm3", "granite"):
            out["q_proj"] = unpermute_rope_rows(out["q_proj"], self.params["n_heads"])
            out["k_proj"] = unpermute_rope_rows(out["k_proj"], self.params["n_kv_heads"])
            for b, n in (("q_bias", "n_heads"), ("k_bias", "n_kv_heads")):
                if b in out:
                    out[b] = unpermute_rope_rows(out[b], self.params[n])
        for name, (type_name, cols) in raw.items():
            out[name] = QuantBlocks(type_name, np.ascontiguousarray(out[name]), cols)
        return out

    def narrow_tensors(self, i: int) -> frozenset[str]:
        """Layer ``i``'s linear weights the file holds in at most 4 bits per weight."""
        narrow = {gname: cname for gname, cname in self._layer_map.items()
                  if self.tensors[f"blk.{i}.{gname}"].tensor_type.name.startswith(NARROW_TYPE_PREFIXES)}
        return frozenset(f"experts.{e}.{name}" if gname in _EXPERT_TENSORS else name
                         for gname, cname in narrow.items() for name in SPLITS.get(cname, (cname,))
                         for e in range(self.params.get("n_experts") or 1))

    def quantised(self) -> bool:
        """Whether any of the layers' linear weights is in a quantised type."""
        types = (self.tensors.get(f"blk.{i}.{gname}") for i in range(self.params["n_layers"])
                 for gname, cname in self._layer_map.items() if _linear(gname, cname))
        return any(t is not None and t.tensor_type.name not in FLOAT_TYPES for t in types)  # (missing: refused later)

    def embed(self, blocks: bool = False) -> np.ndarray | QuantBlocks:
        return self._matrix("token_embd.weight", blocks)

    def head(self, blocks: bool = False) -> dict[str, np.ndarray | QuantBlocks]:
        w = self._matrix("token_embd.weight" if self.params["tied_embeddings"] else "output.weight", blocks)
        return {"norm": self._tensor("output_norm.weight"), "lm_head": w}

    def _matrix(self, name: str, blocks: bool) -> np.ndarray | QuantBlocks:
        arr = self._tensor(name, blocks)
        if arr.dtype != np.uint8:
            return arr
        t = self.tensors[name]
        return QuantBlocks(t.tensor_type.name, arr, int(t.shape[0]))

    def tokenizer_spec(self) -> Any:
        from shards.text.tokenizer_gguf import tokenizer_spec_from_gguf

        return tokenizer_spec_from_gguf(self.reader)

    def digest(self) -> str:
        return hash_file(self.path).hexdigest()
