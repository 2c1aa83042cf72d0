"""The manifest: what a stored model is (shape, rope, weight format) and which files hold it."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from types import MappingProxyType
from typing import Any

from shards.errors import ModelFormatError

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "gemma3", "granite", "olmo2", "mixtral",
                 "qwen3_moe", "phi3", "gemma2", "olmoe", "qwen2_moe")
ACTIVATIONS = ("silu", "gelu_tanh")  # of the MLP's gate: SiLU (SwiGLU), GELU's tanh approximation (GeGLU)
WEIGHT_FORMATS = ("f32", "f16", "q4", "mixed")
AUTO_WEIGHTS = "auto"  # an import's format that follows the checkpoint (shards.importers.importer.auto_weights)
BLOCK_FORMATS = ("q4", "mixed")  # linear weights in MatMulNBits blocks (4-bit, or 4- and 8-bit)
MANIFEST_VERSION = 1
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


def valid_model_name(name: str) -> bool:
    """True when ``name`` is usable as a model name (and a directory name)."""
    return isinstance(name, str) and bool(_NAME_RE.fullmatch(name)) and ".." not in name


def layer_key(i: int) -> str:
    """Key of layer ``i`` in ``Manifest.files``."""
    return f"layer.{i}"


@dataclass(frozen=True)
class WeightFile:
    """One stored weight file: path relative to the model directory, size and checksum;
    ``memory_bytes``: what its tensors take once loaded where that differs from the size (a
    GGUF file's blocks kept as they are, shuffled into ncm's at load), else 0."""

    path: str
    bytes: int
    sha256: str
    memory_bytes: int = 0

    @property
    def loaded_bytes(self) -> int:
        """Memory its tensors take once loaded (the planner's measure of a layer)."""
        return self.memory_bytes or self.bytes

    def __post_init__(self) -> None:
        p = self.path
        if not isinstance(p, str) or not p or p.startswith("/") or ".." in p.split("/") or "\\" in p:
            raise ModelFormatError(f"bad weight file path {p!r}")
        if not isinstance(self.bytes, int) or self.bytes <= 0:
            raise ModelFormatError(f"bad byte count {self.bytes!r} for {p}")
        if not isinstance(self.sha256, str) or not _SHA_RE.match(self.sha256):
            raise ModelFormatError(f"bad sha256 for {p}")
        if not isinstance(self.memory_bytes, int) or isinstance(self.memory_bytes, bool) or self.memory_bytes < 0:
            raise ModelFormatError(f"bad loaded byte count {self.memory_bytes!r} for {p}")


def _pos_int(name: str, v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ModelFormatError(f"manifest: {name} must be a positive integer, got {v!r}")


def _pos_float(name: str, v: Any) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        raise ModelFormatError(f"manifest: {name} must be a positive number, got {v!r}")


# Written to the manifest only when they differ from these defaults: models without the
# feature keep the manifest (and so the fragment cache keys) of earlier builds, and a peer
# whose build predates a feature refuses only the models that use it.
_OPTIONAL_DEFAULTS: dict[str, Any] = {
    "attention_output_bias": False, "mlp_bias": False, "qk_norm": False, "layers_without_rope": (),
    "post_sublayer_norms": False, "embedding_scale": 1.0, "activation": "silu", "attention_scale": None,
    "sliding_window": 0, "sliding_layers": (), "sliding_rope_theta": None, "residual_scale": 1.0,
    "logit_scale": 1.0, "pre_sublayer_norms": True, "qk_norm_whole": False, "n_experts": 0, "experts_per_token": 0,
    "expert_intermediate_size": 0, "renormalize_experts": False, "attention_softcap": 0.0, "logit_softcap": 0.0,
    "shared_expert_intermediate_size": 0, "shared_table": False, "rotary_dim": 0, "rotary_scale": 1.0,
}


@dataclass(frozen=True)
class Manifest:
    """Description of one stored model; validated on construction (ModelFormatError).

    ``attention_bias``: q/k/v projections have biases (``q_bias``, ``k_bias``, ``v_bias`` in
    the layer files); ``attention_output_bias``: o_proj has one (``o_bias``); ``mlp_bias``:
    gate/up/down have them (``gate_bias``, ``up_bias``, ``down_bias``); ``qk_norm``: each query
    and key head is RMS-normed (weights ``q_norm``, ``k_norm`` [head_dim]) before the rotary;
    ``layers_without_rope``: the layers whose attention has no rotary position (SmolLM3's NoPE);
    ``post_sublayer_norms``: the attention's and the MLP's outputs are RMS-normed before they
    join the residual stream (``attn_out_norm``, ``mlp_out_norm``; Gemma's sandwich);
    ``embedding_scale``: the embedding rows are multiplied by it; ``activation``: of the MLP's
    gate (:data:`ACTIVATIONS`); ``attention_scale``: of the attention scores (None: 1/sqrt(head_dim));
    ``sliding_layers`` attend to the last ``sliding_window`` positions only (the query's own
    included), with rotary base ``sliding_rope_theta`` (None: ``rope_theta``);
    ``residual_scale``: each sublayer's output is multiplied by it before it joins the residual
    stream; ``logit_scale``: the logits are multiplied by it (Granite's multipliers);
    ``pre_sublayer_norms``: the attention and the MLP read their input RMS-normed (``input_norm``,
    ``post_norm``); OLMo 2 reads it as it is and norms only their outputs; ``qk_norm_whole``: the
    query and key norms span the whole projection (``q_norm`` [n_heads * head_dim]), not a head;
    ``n_experts`` > 0: a mixture of experts in every layer instead of the MLP: a ``router``
    [n_experts, hidden] whose softmax picks ``experts_per_token`` of the experts
    (``experts.E.gate_proj`` / ``up_proj`` / ``down_proj``, ``expert_intermediate_size`` wide),
    their outputs weighted by those probabilities (renormalised to sum 1 with
    ``renormalize_experts``), plus, with ``shared_expert_intermediate_size``, a shared expert
    (``shared_expert.gate_proj``...) every row runs, weighted by the sigmoid of
    ``shared_expert_gate`` [1, hidden] (Qwen2-MoE); ``attention_softcap`` / ``logit_softcap`` > 0: the scaled
    attention scores / the logits x become cap * tanh(x / cap) (Gemma 2's soft-capping);
    ``rotary_dim`` > 0: the rotary turns the first ``rotary_dim`` dims of each query and key head
    and passes the rest (Phi-4-mini's partial rotary; ``rope_freq_factors`` then cover those);
    ``rotary_scale``: the rotary's cos and sin are multiplied by it (Phi-3's long-rope attention
    factor, which scales only the turned dims)."""

    name: str
    architecture: str
    n_layers: int
    hidden_size: int
    intermediate_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    tied_embeddings: bool
    attention_bias: bool
    weight_format: str
    files: Mapping[str, WeightFile]
    source_digest: str
    rope_freq_factors: tuple[float, ...] | None = None
    source: str = ""
    version: int = MANIFEST_VERSION
    attention_output_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    layers_without_rope: tuple[int, ...] = ()
    post_sublayer_norms: bool = False
    embedding_scale: float = 1.0
    activation: str = "silu"
    attention_scale: float | None = None
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    sliding_rope_theta: float | None = None
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    pre_sublayer_norms: bool = True
    qk_norm_whole: bool = False
    n_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    renormalize_experts: bool = False
    attention_softcap: float = 0.0
    logit_softcap: float = 0.0
    shared_expert_intermediate_size: int = 0
    shared_table: bool = False
    rotary_dim: int = 0
    rotary_scale: float = 1.0

    def __post_init__(self) -> None:
        if not valid_model_name(self.name):
            raise ModelFormatError(f"manifest: bad model name {self.name!r}")
        if self.architecture not in ARCHITECTURES:
            raise ModelFormatError(f"manifest: unknown architecture {self.architecture!r}")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ModelFormatError(f"manifest: unknown weight format {self.weight_format!r}")
        for n in ("n_layers", "hidden_size", "intermediate_size", "n_heads", "n_kv_heads",
                  "head_dim", "vocab_size", "context_length", "version"):
            _pos_int(n, getattr(self, n))
        _pos_float("rope_theta", self.rope_theta)
        _pos_float("rms_norm_eps", self.rms_norm_eps)
        if self.n_heads % self.n_kv_heads:
            raise ModelFormatError("manifest: n_heads must be a multiple of n_kv_heads")
        if self.head_dim % 2:
            raise ModelFormatError("manifest: head_dim must be even")
        if self.version != MANIFEST_VERSION:
            raise ModelFormatError(f"manifest: unsupported manifest version {self.version}")
        if self.weight_format in BLOCK_FORMATS and (self.hidden_size % 32 or self.intermediate_size % 32
                                           or (self.n_heads * self.head_dim) % 32):
            raise ModelFormatError(f"manifest: {self.weight_format} needs matrix input sizes that are multiples of 32")
        for name in ("layers_without_rope", "sliding_layers"):
            layers = getattr(self, name)
            if not isinstance(layers, (tuple, list)) or any(not isinstance(i, int) or isinstance(i, bool)
                                                             for i in layers) \
                    or list(layers) != sorted(set(layers)) or not all(0 <= i < self.n_layers for i in layers):
                raise ModelFormatError(f"manifest: {name} must be increasing layer indices")
            object.__setattr__(self, name, tuple(layers))
        if not isinstance(self.sliding_window, int) or isinstance(self.sliding_window, bool) or self.sliding_window < 0 \
                or bool(self.sliding_layers) != (self.sliding_window > 0):
            raise ModelFormatError("manifest: sliding_window must be a positive integer exactly when sliding_layers "
                                   "names layers")
        if self.activation not in ACTIVATIONS:
            raise ModelFormatError(f"manifest: unknown activation {self.activation!r}")
        scales = ("embedding_scale", "residual_scale", "logit_scale", "rotary_scale")
        for name in scales:
            _pos_float(name, getattr(self, name))
        for name in ("attention_scale", "sliding_rope_theta"):
            if getattr(self, name) is not None:
                _pos_float(name, getattr(self, name))
        for name in ("attention_softcap", "logit_softcap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ModelFormatError(f"manifest: {name} must be 0 (none) or a positive number, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("n_experts", "experts_per_token", "expert_intermediate_size", "shared_expert_intermediate_size"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool) \
                    or getattr(self, name) < 0:
                raise ModelFormatError(f"manifest: {name} must be a non-negative integer")
        if self.n_experts and not (0 < self.experts_per_token <= self.n_experts and self.expert_intermediate_size):
            raise ModelFormatError("manifest: a mixture of experts needs 0 < experts_per_token <= n_experts "
                                   "and an expert_intermediate_size")
        if self.shared_expert_intermediate_size and not self.n_experts:
            raise ModelFormatError("manifest: a shared expert needs a mixture of experts")
        flags = ("tied_embeddings", "attention_bias", "attention_output_bias", "mlp_bias", "qk_norm",
                 "post_sublayer_norms", "pre_sublayer_norms", "qk_norm_whole", "renormalize_experts", "shared_table")
        if not all(isinstance(getattr(self, f), bool) for f in flags):
            raise ModelFormatError(f"manifest: {' / '.join(flags)} must be booleans")
        if self.shared_table and not self.tied_embeddings:
            raise ModelFormatError("manifest: only a tied table can be shared by the embedding and the output layer")
        if not isinstance(self.source_digest, str) or not _SHA_RE.match(self.source_digest):
            raise ModelFormatError("manifest: source_digest must be a sha256 hex digest")
        if not isinstance(self.rotary_dim, int) or self.rotary_dim % 2 or not 0 <= self.rotary_dim < self.head_dim:
            raise ModelFormatError("manifest: rotary_dim must be 0 (the whole head) or an even width below head_dim")
        if self.rope_freq_factors is not None:
            ff = tuple(float(x) for x in self.rope_freq_factors)
            if len(ff) != self.rotary_width // 2 or not all(math.isfinite(x) and x > 0 for x in ff):
                raise ModelFormatError("manifest: rope_freq_factors must be rotary_width/2 positive numbers")
            object.__setattr__(self, "rope_freq_factors", ff)
        files = dict(self.files)
        expected = {"embed", "head"} | {layer_key(i) for i in range(self.n_layers)}
        if set(files) != expected:
            missing = sorted(expected - set(files))[:3]
            extra = sorted(set(files) - expected)[:3]
            raise ModelFormatError(f"manifest: file table mismatch (missing {missing}, unexpected {extra})")
        if not all(isinstance(f, WeightFile) for f in files.values()):
            raise ModelFormatError("manifest: files must be WeightFile entries")
        object.__setattr__(self, "files", MappingProxyType(files))

    # --- sizes -------------------------------------------------------------------------
    @property
    def rotary_width(self) -> int:
        """How many dims of each query and key head the rotary turns."""
        return self.rotary_dim or self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    def layer_file(self, i: int) -> WeightFile:
        """The weight file of layer ``i``."""
        if not 0 <= i < self.n_layers:
            raise ModelFormatError(f"layer {i} out of range 0..{self.n_layers - 1}")
        return self.files[layer_key(i)]

    def layer_bytes(self, i: int) -> int:
        """Bytes on disk of layer ``i``'s weights."""
        return self.layer_file(i).bytes

    @property
    def embed_bytes(self) -> int:
        return self.files["embed"].bytes

    @property
    def head_bytes(self) -> int:
        return self.files["head"].bytes

    def kv_bytes_per_token(self, n_layers: int = 1) -> int:
        """Float32 KV cache bytes per token for ``n_layers`` layers."""
        return 2 * self.n_kv_heads * self.head_dim * 4 * n_layers

    def fragment_files(self, first_layer: int, last_layer: int) -> list[str]:
        """Keys of the files a fragment for layers [first, last] needs."""
        if not 0 <= first_layer <= last_layer < self.n_layers:
            raise ModelFormatError(f"bad layer range {first_layer}..{last_layer}")
        keys = [layer_key(i) for i in range(first_layer, last_layer + 1)]
        tail = last_layer == self.n_layers - 1
        if first_layer == 0 or tail and self.shared_table:
            keys.insert(0, "embed")
        if tail:
            keys.append("head")
        return keys

    # --- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)
             if f.name not in _OPTIONAL_DEFAULTS or getattr(self, f.name) != _OPTIONAL_DEFAULTS[f.name]}
        # memory_bytes only where set: other stores keep the manifests (and fragment keys) they had
        d["files"] = {k: {f: v for f, v in asdict(w).items() if f != "memory_bytes" or v}
                      for k, w in self.files.items()}
        d["rope_freq_factors"] = list(self.rope_freq_factors) if self.rope_freq_factors else None
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Manifest":
        try:
            d = dict(d)
            d.pop("extra", None)  # written by early development builds; never used
            files = {k: WeightFile(**v) for k, v in dict(d.pop("files")).items()}
            ff = d.pop("rope_freq_factors", None)
            return cls(files=files, rope_freq_factors=tuple(ff) if ff else None, **d)
        except (TypeError, KeyError, ValueError, AttributeError, OverflowError) as e:
            raise ModelFormatError(f"manifest: malformed ({e})") from e

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ModelFormatError(f"manifest: not valid JSON ({e})") from e
        if not isinstance(d, dict):
            raise ModelFormatError("manifest: JSON is not an object")
        return cls.from_dict(d)
