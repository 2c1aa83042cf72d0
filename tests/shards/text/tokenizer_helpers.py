"""Helpers shared by the tokenizer tests (not a test module): sample texts, the Hypothesis
settings and alphabets they use, and a small sentencepiece-style ("llama") vocabulary
written as a GGUF."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from tests.examples import examples

SAMPLES = [
    "Hello world",
    "What is the capital of France?",
    "def fib(n):\n\tif n < 2:\n\t\treturn n\n    return fib(n - 1) + fib(n - 2)  # slow\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
    "東京は日本の首都です。北京是中国的首都。",
    "서울은 한국의 수도입니다",
    "emoji 🤖👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "a    b     c\n\n\n\t\t d  \t \n",
    "   leading spaces",
    "trailing spaces    ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>ncm<file_sep>x",
    "12345 3.14159 2024-01-01 1,000,000 0x1F",
    "Ünïcödé Привет мир مرحبا שלום नमस्ते",
    "don't I'll we're they've she's",
    "mixed: Straße 東京 🤖 ok?!…",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "",
    " ",
    "\n",
]

FAST = settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# SmolLM2's byte alphabet lacks a few bytes (six rare control characters, and the lead
# bytes 0xF1/0xF2 of planes 4-11): text using them cannot be encoded by the model at all.
ENCODABLE = st.characters(codec="utf-8", max_codepoint=0x3FFFF, exclude_characters="\x04\x06\x13\x14\x16\x1d")


# --- a sentencepiece-style ("llama") vocabulary, written as a small GGUF -------------------

SPM_PIECES = ["\u2581", "e", "t", "h", "a", "o", "l", "n", "s", "r", "d", "w", "i", "\u2581t", "he", "\u2581the",
              "\u2581a", "ll", "\u2581he", "llo", "\u2581hello", "\u2581w", "or", "ld", "\u2581wor", "\u2581world",
              "in", "\u2581in", "\u2581s", "er", "is", "\u2581is", "東", "京", "東京", "é"]
SPM_VOCAB_SIZE = 3 + 256 + len(SPM_PIECES)  # <unk> <s> </s>, the 256 byte tokens, the pieces


def tiny_gguf_writer(path: Path, arch: str = "llama") -> Any:
    """A GGUFWriter of ``path`` with a one-layer header of ``arch`` (what a tokenizer needs beside it)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    return writer


def write_spm_gguf(folder: Path) -> Path:
    """``folder/tiny-spm.gguf``: a one-layer llama header and a scored sentencepiece vocabulary
    (<unk>, control <s> and </s>, byte fallback tokens, :data:`SPM_PIECES`)."""

    path = folder / "tiny-spm.gguf"
    writer = tiny_gguf_writer(path)
    tokens, types, scores = ["<unk>", "<s>", "</s>"], [2, 3, 3], [0.0, 0.0, 0.0]
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        types.append(6)
        scores.append(0.0)
    for rank, piece in enumerate(SPM_PIECES):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
