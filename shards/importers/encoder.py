"""Importing an embedding model: a Hugging Face folder of a BERT-family encoder (``BertModel``:
all-MiniLM, bge, e5, gte...), as sentence-transformers saves it or bare.

The weights are stored as float32 in one safetensors file by their Hugging Face names (a
``bert.`` prefix dropped; the pooler, which sentence embeddings do not use, left out); the
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
from shards.store.encoder_manifest import ENCODER_FILE, WEIGHTS_KEY, EncoderManifest
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
# Tensors a checkpoint may hold that sentence embeddings do not use.
_UNUSED_PREFIXES = ("pooler.", "embeddings.position_ids")


def is_encoder_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a BERT-family encoder (its config.json says so)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") == "bert"


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


def import_encoder(folder: Path | str, *, name: str, store: ModelStore) -> EncoderManifest:
    """Import the encoder in ``folder`` into ``store`` as embedding model ``name``."""
    folder = Path(folder)
    config = _json(folder / "config.json")
    if not isinstance(config, dict) or config.get("model_type") != "bert":
        raise UnsupportedArchitectureError(f"{folder.name}: not a BERT-family encoder (config.json model_type)")
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedArchitectureError("only absolute position embeddings are supported")
    if config.get("hidden_act", "gelu") != "gelu":
        raise UnsupportedArchitectureError(f"activation {config.get('hidden_act')!r}: ncm runs BERT's exact gelu")
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
    sentence = _json(folder / "sentence_bert_config.json") or {}
    max_positions = int(config["max_position_embeddings"])
    pooling, normalize = _pooling(folder)
    shape = {"n_layers": int(config["num_hidden_layers"]), "hidden_size": int(config["hidden_size"]),
             "intermediate_size": int(config["intermediate_size"]), "n_heads": int(config["num_attention_heads"]),
             "vocab_size": int(config["vocab_size"]), "max_positions": max_positions,
             "max_tokens": min(int(sentence.get("max_seq_length") or max_positions), max_positions),
             "layer_norm_eps": float(config.get("layer_norm_eps", 1e-12))}
    tokenizer = {file: (folder / file).read_text(encoding="utf-8") for file in TOKENIZER_FILES
                 if (folder / file).is_file()}
    return store_encoder(name, store, shape, tensors, tokenizer, pooling, normalize, digest.hexdigest(), folder)


def store_encoder(name: str, store: ModelStore, shape: dict[str, Any], tensors: dict[str, np.ndarray],
                   tokenizer: dict[str, str], pooling: str, normalize: bool, digest: str,
                   source: Path) -> EncoderManifest:
    """Write an encoder: ``shape``, the fields of its manifest that describe it (n_layers...),
    its tensors by their Hugging Face names, its tokenizer files' texts."""
    wanted = set(_EMBEDDING_TENSORS) | {f"encoder.layer.{i}.{t}" for i in range(shape["n_layers"])
                                        for t in _LAYER_TENSORS}
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
            name=name, architecture="bert", **shape, pooling=pooling, normalize=normalize,
            files={WEIGHTS_KEY: WeightFile(WEIGHTS_FILE, path.stat().st_size, hash_file(path).hexdigest())},
            source_digest=digest, source=str(source))
        (staging / ENCODER_FILE).write_text(manifest.to_json())
    return manifest


__all__ = ["WEIGHTS_FILE", "import_encoder", "is_encoder_folder", "store_encoder"]
