"""Importing an embedding model from a GGUF file: a BERT-family encoder as llama.cpp's
converter writes one (architecture ``bert``: all-MiniLM, bge, mxbai-embed...; ``nomic-bert``:
nomic-embed-text; the files Ollama keeps for its embedding models).

Its tensors get their Hugging Face names back (nomic-bert's fused query/key/value matrix
split) and are stored as :mod:`shards.importers.encoder` stores a folder's. The tokenizer is
rebuilt from the file's WordPiece vocabulary, which the converter rewrote with a "phantom
space" (``▁word`` for a word's first piece, ``piece`` for ``##piece``, bracketed special tokens
as they are), with BERT's uncased normaliser, as llama.cpp's tokenizer reads such a file. The
pooling is the file's ``pooling_type`` (mean or first token); the vectors are normalised, as
llama.cpp's server and Ollama return them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from shards.errors import ModelFormatError, UnsupportedArchitectureError
from shards.importers.encoder import store_encoder
from shards.importers.fused import split_fused
from shards.store.encoder_manifest import EncoderManifest
from shards.store.model_store import ModelStore
from shards.store.verify import hash_file

PHANTOM_SPACE = "\u2581"
POOLING_TYPES = {1: "mean", 2: "cls"}  # llama.cpp's: 0 none, 1 mean, 2 cls, 3 last, 4 rank
_EMBEDDINGS = {"token_embd.weight": "embeddings.word_embeddings.weight",
               "position_embd.weight": "embeddings.position_embeddings.weight",
               "token_types.weight": "embeddings.token_type_embeddings.weight",
               "token_embd_norm.weight": "embeddings.LayerNorm.weight",
               "token_embd_norm.bias": "embeddings.LayerNorm.bias"}
_LAYER = {"attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
          "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
          "ffn_up": "intermediate.dense", "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"}
_NOMIC_LAYER = {"attn_output": "self_attn.o_proj", "attn_output_norm": "post_attention_layernorm",
                "ffn_up": "mlp.up_proj", "ffn_gate": "mlp.gate_proj", "ffn_down": "mlp.down_proj",
                "layer_output_norm": "post_mlp_layernorm"}
# llama.cpp's architecture names -> ncm's (the manifest's, transformers' model_type)
ARCHITECTURES = {"bert": "bert", "nomic-bert": "nomic_bert"}


def _reader(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as error:  # gguf raises ValueError, struct errors, IndexError on bad files
        raise ModelFormatError(f"{path.name}: not a readable GGUF file ({type(error).__name__}: {error})") from None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def is_encoder_gguf(path: Path) -> bool:
    """Whether ``path`` is a GGUF file of a BERT-family encoder."""
    path = Path(path)
    if not path.is_file() or path.suffix.lower() != ".gguf":
        return False
    try:
        return _field(_reader(path), "general.architecture") in ARCHITECTURES
    except ModelFormatError:
        return False


def wordpiece_tokenizer_json(reader: Any) -> str:
    """The ``tokenizer.json`` of the file's WordPiece vocabulary (BERT's uncased pipeline)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    if _field(reader, "tokenizer.ggml.model") != "bert":
        raise UnsupportedArchitectureError("only WordPiece (bert) tokenizers are supported for GGUF encoders")
    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens")]

    def piece(token: str) -> str:
        if token.startswith("[") and token.endswith("]"):
            return token
        return token[1:] if token.startswith(PHANTOM_SPACE) else "##" + token

    vocab = {piece(token): index for index, token in enumerate(tokens)}

    def special(*keys: str) -> tuple[str, int]:
        for key in keys:
            value = _field(reader, f"tokenizer.ggml.{key}")
            if value is not None:
                return tokens[int(value)], int(value)
        raise ModelFormatError(f"the GGUF tokenizer names no {keys[0].removesuffix('_token_id')} token")

    (cls, cls_id), (sep, sep_id) = special("cls_token_id", "bos_token_id"), special("seperator_token_id", "eos_token_id")
    unk, _ = special("unknown_token_id")
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, cls_id), (sep, sep_id)])
    tokenizer.decoder = decoders.WordPiece()
    names = [_field(reader, f"tokenizer.ggml.{key}") for key in ("padding_token_id", "mask_token_id")]
    specials = {cls, sep, unk} | {tokens[int(i)] for i in names if i is not None}
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in sorted(specials)])
    return tokenizer.to_str()


def import_encoder_gguf(path: Path | str, *, name: str, store: ModelStore) -> EncoderManifest:
    """Import the BERT-family encoder in GGUF file ``path`` into ``store`` as embedding model ``name``."""
    import gguf

    path = Path(path)
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(f"{path.name}: not a BERT-family encoder (architecture {arch!r}; "
                                           f"ncm embeds with {', '.join(ARCHITECTURES)})")
    pooling = POOLING_TYPES.get(int(_field(reader, f"{arch}.pooling_type", 1)))
    if pooling is None:
        raise UnsupportedArchitectureError(f"{path.name}: pooling type {_field(reader, f'{arch}.pooling_type')}: "
                                           "ncm pools by the mean or the first token")
    try:
        positions = int(_field(reader, f"{arch}.context_length"))
        shape = {"n_layers": int(_field(reader, f"{arch}.block_count")),
                 "hidden_size": int(_field(reader, f"{arch}.embedding_length")),
                 "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
                 "n_heads": int(_field(reader, f"{arch}.attention.head_count")),
                 "vocab_size": len(_field(reader, "tokenizer.ggml.tokens")), "max_positions": positions,
                 "max_tokens": positions,
                 "layer_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_epsilon", 1e-12))}
    except TypeError:
        raise ModelFormatError(f"{path.name}: the GGUF metadata lacks the encoder's shape") from None
    rotary = arch == "nomic-bert"
    rope_theta = float(_field(reader, f"{arch}.rope.freq_base", 1000.0)) if rotary else None
    head_dim = shape["hidden_size"] // shape["n_heads"]
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        try:
            array = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        except (NotImplementedError, ValueError) as error:
            raise ModelFormatError(f"{path.name}: cannot dequantise {tensor.name}: {error}") from None
        array = array.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        parts = tensor.name.split(".")
        if rotary and len(parts) == 4 and parts[0] == "blk" and parts[2] == "attn_qkv":
            params = {"n_heads": shape["n_heads"], "n_kv_heads": shape["n_heads"], "head_dim": head_dim}
            for part, matrix in split_fused(params, "qkv_proj", array).items():
                tensors[f"layers.{parts[1]}.self_attn.{part}.{parts[3]}"] = matrix
        else:
            tensors[_hf_name(tensor.name, _NOMIC_LAYER if rotary else _LAYER,
                             "layers" if rotary else "encoder.layer")] = array
    tokenizer = {"tokenizer.json": wordpiece_tokenizer_json(reader),
                 "tokenizer_config.json": json.dumps({"model_max_length": positions})}
    return store_encoder(name, store, shape, tensors, tokenizer, pooling, True, hash_file(path).hexdigest(), path,
                         architecture=ARCHITECTURES[arch], rope_theta=rope_theta)


def _hf_name(name: str, layer: dict[str, str], layers: str) -> str:
    """A GGUF tensor's Hugging Face name (unknown names stay, for the unused-tensor check)."""
    if name in _EMBEDDINGS:
        return _EMBEDDINGS[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer:
        return f"{layers}.{parts[1]}.{layer[parts[2]]}.{parts[3]}"
    return name


__all__ = ["ARCHITECTURES", "import_encoder_gguf", "is_encoder_gguf", "wordpiece_tokenizer_json"]
