"""Importing an embedding model: a Hugging Face folder of a BERT-family encoder (``BertModel``:
all-MiniLM, bge, e5, gte...; ``NomicBertModel``: nomic-embed-text), as sentence-transformers
saves it or bare.

The weights are stored as float32 in one safetensors file by their Hugging Face names (a
``bert.`` prefix dropped; the pooler, which sentence embeddings do not use, left out; a
nomic-bert checkpoint's own names, ``encoder.layers.N.attn.Wqkv`` and the like, mapped to
transformers' ``NomicBertModel`` ones, its fused query/key/value matrix split); the
pooling and normalisation come from the folder's sentence-transformers modules
(``modules.json``, ``1_Pooling/config.json``), and the most tokens read of a text from its
``sentence_bert_config.json``. A bare folder pools by the mean and normalises, the way
sentence-transformers loads one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from shards.errors import ModelFormatError, UnmappedTensorError, UnsupportedArchitectureError
from shards.importers.fused import split_fused
from shards.store.encoder_manifest import ENCODER_ARCHITECTURES, ENCODER_FILE, WEIGHTS_KEY, EncoderManifest
from shards.store.manifest import WeightFile
from shards.store.model_store import ModelStore
from shards.store.tensorfile import read_tensors, write_tensors
from shards.store.verify import hash_file

WEIGHTS_FILE = "encoder.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_LAYER_TENSORS = (
    "attention.self.query.weight", "attention.self.query.bias", "attention.self.key.weight",
    "attention.self.key.bias", "attention.self.value.weight", "attention.self.value.bias",
    "attention.output.dense.weight", "attention.output.dense.bias", "attention.output.LayerNorm.weight",
    "attention.output.LayerNorm.bias", "intermediate.dense.weight", "intermediate.dense.bias",
    "output.dense.weight", "output.dense.bias", "output.LayerNorm.weight", "output.LayerNorm.bias",
)
_EMBEDDING_TENSORS = ("embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
                      "embeddings.token_type_embeddings.weight", "embeddings.LayerNorm.weight",
                      "embeddings.LayerNorm.bias")
_NOMIC_LAYER_TENSORS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "post_attention_layernorm.weight", "post_attention_layernorm.bias", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "post_mlp_layernorm.weight", "post_mlp_layernorm.bias",
)
# nomic-bert's own checkpoint names (nomic-ai's code, llama.cpp's converter reads them) -> transformers'
_NOMIC_RENAMES = (("encoder.layers.", "layers."), ("emb_ln.", "embeddings.LayerNorm."),
                  (".attn.out_proj.", ".self_attn.o_proj."), (".mlp.fc11.", ".mlp.up_proj."),
                  (".mlp.fc12.", ".mlp.gate_proj."), (".mlp.fc2.", ".mlp.down_proj."),
                  (".norm1.", ".post_attention_layernorm."), (".norm2.", ".post_mlp_layernorm."))
# Tensors a checkpoint may hold that sentence embeddings do not use.
_UNUSED_PREFIXES = ("pooler.", "embeddings.position_ids")


def is_encoder_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a BERT-family encoder (its config.json says so)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") in ENCODER_ARCHITECTURES


def encoder_tensor_names(architecture: str, n_layers: int) -> set[str]:
    """The tensors an encoder of ``architecture`` is stored with, by their Hugging Face names."""
    if architecture == "bert":
        return set(_EMBEDDING_TENSORS) | {f"encoder.layer.{i}.{t}" for i in range(n_layers) for t in _LAYER_TENSORS}
    embeddings = set(_EMBEDDING_TENSORS) - {"embeddings.position_embeddings.weight"}  # rotary positions
    return embeddings | {f"layers.{i}.{t}" for i in range(n_layers) for t in _NOMIC_LAYER_TENSORS}


def nomic_tensors(tensors: dict[str, np.ndarray], n_heads: int, head_dim: int) -> dict[str, np.ndarray]:
    """A nomic-bert checkpoint's tensors by transformers' names (those already so named stay)."""
    out: dict[str, np.ndarray] = {}
    for key, value in tensors.items():
        for old, new in _NOMIC_RENAMES:
            key = key.replace(old, new)
        if key.endswith(".attn.Wqkv.weight"):
            layer = key.removesuffix(".attn.Wqkv.weight")
            params = {"n_heads": n_heads, "n_kv_heads": n_heads, "head_dim": head_dim}
            for part, matrix in split_fused(params, "qkv_proj", value).items():
                out[f"{layer}.self_attn.{part}.weight"] = matrix
        else:
            out[key] = value
    return out


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError:
        return None
    except ValueError as error:
        raise ModelFormatError(f"{path.name} is not JSON: {error}") from None


def _pooling(folder: Path) -> tuple[str, bool]:
    """How the folder's sentence-transformers modules pool, and whether they normalise."""
    modules = _json(folder / "modules.json")
    if not isinstance(modules, list):
        return "mean", True
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling = "mean"
    if "Pooling" in kinds:
        config = _json(folder / str(kinds["Pooling"].get("path", "")) / "config.json") or {}
        modes = [mode for mode in ("mean_tokens", "cls_token", "max_tokens", "mean_sqrt_len_tokens",
                                   "weightedmean_tokens", "lasttoken")
                 if config.get(f"pooling_mode_{mode}")]
        if modes not in (["mean_tokens"], ["cls_token"]):
            raise UnsupportedArchitectureError(f"pooling {modes or 'none'}: ncm pools by the mean or the first token")
        pooling = "mean" if modes == ["mean_tokens"] else "cls"
    unknown = set(kinds) - {"Transformer", "Pooling", "Normalize"}
    if unknown:
        raise UnsupportedArchitectureError(f"sentence-transformers modules {sorted(unknown)} are not supported")
    return pooling, "Normalize" in kinds


def _setting(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of ``keys`` the config sets (transformers' name, then nomic-ai's)."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if default is None:
        raise ModelFormatError(f"config.json lacks {keys[0]}")
    return default


def _bert_shape(config: dict[str, Any]) -> tuple[dict[str, Any], None]:
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedArchitectureError("only absolute position embeddings are supported")
    if config.get("hidden_act", "gelu") != "gelu":
        raise UnsupportedArchitectureError(f"activation {config.get('hidden_act')!r}: ncm runs BERT's exact gelu")
    return {"n_layers": int(config["num_hidden_layers"]), "hidden_size": int(config["hidden_size"]),
            "intermediate_size": int(config["intermediate_size"]), "n_heads": int(config["num_attention_heads"]),
            "max_positions": int(config["max_position_embeddings"]),
            "layer_norm_eps": float(config.get("layer_norm_eps", 1e-12))}, None


def _nomic_shape(config: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """nomic-bert's shape and rotary base, from transformers' config or nomic-ai's own."""
    refused = {"prenorm": True, "rotary_emb_interleaved": True, "qkv_proj_bias": True, "mlp_fc1_bias": True,
               "mlp_fc2_bias": True, "use_rms_norm": True, "causal": True}
    for key, value in refused.items():
        if config.get(key) == value:
            raise UnsupportedArchitectureError(f"nomic-bert with {key}={value} is not supported")
    if float(config.get("rotary_emb_fraction", 1.0)) != 1.0:
        raise UnsupportedArchitectureError("nomic-bert rotating part of each head is not supported")
    if config.get("rotary_scaling_factor") is not None:
        raise UnsupportedArchitectureError("nomic-bert's scaled rotary positions are not supported")
    activation = _setting(config, "hidden_act", "activation_function", default="silu")
    if activation not in ("silu", "swiglu"):
        raise UnsupportedArchitectureError(f"nomic-bert activation {activation!r}: ncm runs SwiGLU")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedArchitectureError(f"rotary positions of type {rope.get('rope_type')!r} are not supported")
    theta = float(rope.get("rope_theta") or _setting(config, "rope_theta", "rotary_emb_base", default=1000.0))
    return {"n_layers": int(_setting(config, "num_hidden_layers", "n_layer")),
            "hidden_size": int(_setting(config, "hidden_size", "n_embd")),
            "intermediate_size": int(_setting(config, "intermediate_size", "n_inner")),
            "n_heads": int(_setting(config, "num_attention_heads", "n_head")),
            # the positions it was trained on: past them its rotation is not what it learned
            "max_positions": int(_setting(config, "max_trained_positions", "max_position_embeddings", "n_positions")),
            "layer_norm_eps": float(_setting(config, "layer_norm_eps", "layer_norm_epsilon", default=1e-12))}, theta


def import_encoder(folder: Path | str, *, name: str, store: ModelStore) -> EncoderManifest:
    """Import the encoder in ``folder`` into ``store`` as embedding model ``name``."""
    folder = Path(folder)
    config = _json(folder / "config.json")
    architecture = config.get("model_type") if isinstance(config, dict) else None
    if architecture not in ENCODER_ARCHITECTURES:
        raise UnsupportedArchitectureError(f"{folder.name}: not a BERT-family encoder (config.json model_type "
                                           f"{architecture!r}; ncm embeds with {', '.join(ENCODER_ARCHITECTURES)})")
    shape, rope_theta = _bert_shape(config) if architecture == "bert" else _nomic_shape(config)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{folder.name}: no .safetensors weights")
    if not (folder / "tokenizer.json").is_file():
        raise ModelFormatError(f"{folder.name}: no tokenizer.json")
    tensors: dict[str, np.ndarray] = {}
    digest = hashlib.sha256()
    for file in files:
        digest.update(hash_file(file).digest())
        for key, value in read_tensors(file).items():
            tensors[key.removeprefix("bert.")] = value
    if architecture == "nomic_bert":
        tensors = nomic_tensors(tensors, shape["n_heads"], shape["hidden_size"] // shape["n_heads"])
    sentence = _json(folder / "sentence_bert_config.json") or {}
    pooling, normalize = _pooling(folder)
    max_positions = shape["max_positions"]
    shape.update(vocab_size=int(config["vocab_size"]),
                 max_tokens=min(int(sentence.get("max_seq_length") or max_positions), max_positions))
    tokenizer = {file: (folder / file).read_text(encoding="utf-8") for file in TOKENIZER_FILES
                 if (folder / file).is_file()}
    return store_encoder(name, store, shape, tensors, tokenizer, pooling, normalize, digest.hexdigest(), folder,
                         architecture=architecture, rope_theta=rope_theta)


def store_encoder(name: str, store: ModelStore, shape: dict[str, Any], tensors: dict[str, np.ndarray],
                  tokenizer: dict[str, str], pooling: str, normalize: bool, digest: str, source: Path, *,
                  architecture: str = "bert", rope_theta: float | None = None) -> EncoderManifest:
    """Write an encoder: ``shape``, the fields of its manifest that describe it (n_layers...),
    its tensors by their Hugging Face names, its tokenizer files' texts."""
    wanted = encoder_tensor_names(architecture, shape["n_layers"])
    missing = sorted(wanted - set(tensors))
    if missing:
        raise ModelFormatError(f"the encoder lacks {len(missing)} tensors, e.g. {missing[:3]}")
    unused = sorted(k for k in set(tensors) - wanted if not k.startswith(_UNUSED_PREFIXES))
    if unused:
        raise UnmappedTensorError(f"the checkpoint holds tensors an encoder does not use: {unused[:5]}", unused)
    with store.staging(name) as staging:
        path = staging / WEIGHTS_FILE
        write_tensors(path, {k: np.asarray(tensors[k], dtype=np.float32) for k in sorted(wanted)})
        for file, text in tokenizer.items():
            (staging / file).write_text(text, encoding="utf-8")
        manifest = EncoderManifest(
            name=name, architecture=architecture, **shape, pooling=pooling, normalize=normalize, rope_theta=rope_theta,
            files={WEIGHTS_KEY: WeightFile(WEIGHTS_FILE, path.stat().st_size, hash_file(path).hexdigest())},
            source_digest=digest, source=str(source))
        (staging / ENCODER_FILE).write_text(manifest.to_json())
    return manifest


__all__ = ["WEIGHTS_FILE", "encoder_tensor_names", "import_encoder", "is_encoder_folder", "nomic_tensors",
           "store_encoder"]
