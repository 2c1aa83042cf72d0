"""A model's tokenizer from a GGUF file's metadata (:func:`tokenizer_spec_from_gguf`).

GGUF conventions followed (those of llama.cpp, which writes these files):

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE. Tokens are already spelled in the
  GPT-2 byte alphabet; merges are ``"left right"`` strings in rank order. The text is split
  by the regular expressions llama.cpp uses for ``tokenizer.ggml.pre`` before BPE.
* ``tokenizer.ggml.model == "llama"``: sentencepiece-style BPE. Merges are implied by the
  token scores (a merge ranks by the score of the token it produces), spaces are spelled
  ``"\u2581"``, unknown bytes fall back to ``<0xXX>`` tokens, and a space is put in front of
  the text, and after every special token, when ``tokenizer.ggml.add_space_prefix`` says so
  (the default). Like llama.cpp, and unlike transformers' reading of such a GGUF, text that
  already starts with a space still gets one more.
* ``token_type`` 3 (control) tokens become special added tokens, 4 (user defined) plain
  added tokens: both are matched whole in the input text.
* End-of-generation ids are the EOS id, the EOT id, and control tokens llama.cpp also
  treats as end-of-generation by name (``<|im_end|>``, ``<|endoftext|>``, ``<|eot_id|>``...).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from shards.errors import TokenizerError
from shards.text.tokenizer_spec import SPACE_MARK, TokenizerSpec

logger = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# The turn format of architectures whose files may come without a chat template (a base
# model's), as llama.cpp applies it for them: Gemma's turns, the system text opening the
# first user turn, contents trimmed, the assistant called "model".
GEMMA_TURNS = (
    "{{ bos_token }}{% set system = namespace(text='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set system.text = system.text + message['content'] | trim + '\n\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{% if message['role'] == 'user' %}{{ system.text }}{% set system.text = '' %}{% endif %}"
    "{{ message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
FALLBACK_CHAT_TEMPLATES = {"gemma3": GEMMA_TURNS, "gemma2": GEMMA_TURNS}

# Control tokens that end a generation whatever the EOS id says (llama.cpp's list).
END_OF_GENERATION_TOKENS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>",
    "<|eom_id|>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "</s>",
})

# Pre-tokenizer splits, by tokenizer.ggml.pre. Each entry is a list of regular expressions
# applied one after the other; every piece of text (match or gap) becomes its own chunk.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's default (a file naming no pre-tokenizer): punctuation runs first, then GPT-2's
# split, then digit runs, cut in threes.
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                   r"\p{N}+", r"[0-9][0-9][0-9]")
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": _DEFAULT_SPLITS,
    "gpt2": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),
    # SmolLM and the StarCoder family isolate every digit first.
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT),
    "codeshell": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "falcon3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "qwen2.5": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}
# Pre-tokenizer types whose BPE looks a whole chunk up in the vocabulary before merging.
_IGNORE_MERGES_PRE = frozenset({"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3"})


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """A scalar, string or array metadata value of a ``gguf.GGUFReader`` (arrays as lists)."""
    import gguf

    fld = reader.fields.get(key)
    if fld is None:
        return default
    kind = fld.types[0] if fld.types else None
    if kind == gguf.GGUFValueType.ARRAY:
        item_kind = fld.types[-1]
        if item_kind == gguf.GGUFValueType.STRING:
            return [bytes(fld.parts[i]).decode("utf-8", errors="replace") for i in fld.data]
        return [fld.parts[i].tolist()[0] for i in fld.data]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(fld.parts[fld.data[0]]).decode("utf-8", errors="replace")
    value = fld.parts[fld.data[0]].tolist()[0]
    if kind == gguf.GGUFValueType.BOOL:
        return bool(value)
    return value


def _sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float],
                          skip: set[int]) -> list[tuple[str, str]]:
    """Merges implied by a scored vocabulary: a pair ranks by the score of what it makes."""
    index = {token: i for i, token in enumerate(tokens) if i not in skip}
    candidates: list[tuple[float, int, int, str, str]] = []
    for token, token_id in index.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            left_id, right_id = index.get(left), index.get(right)
            if left_id is not None and right_id is not None:
                candidates.append((-float(scores[token_id]), left_id, right_id, left, right))
    candidates.sort()
    return [(left, right) for _, _, _, left, right in candidates]


def _gguf_backend(model: str, pre: str, tokens: list[str], token_types: list[int],
                  merges: list[str] | None, scores: list[float] | None,
                  add_space_prefix: bool, unk_token_id: int | None):
    """A ``tokenizers.Tokenizer`` for GGUF vocabulary arrays."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    # control tokens, and sentencepiece's <unk>, are matched whole and count as special
    special = {i for i, t in enumerate(token_types)
               if t == TOKEN_TYPE_CONTROL or (t == TOKEN_TYPE_UNKNOWN and model == "llama")}
    user_defined = {i for i, t in enumerate(token_types) if t == TOKEN_TYPE_USER_DEFINED}
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    if len(vocab) != len(tokens):
        logger.warning("GGUF vocabulary has %d duplicate tokens; the first of each wins",
                       len(tokens) - len(vocab))

    if model == "gpt2":
        if not merges:
            raise TokenizerError("GGUF gpt2 tokenizer has no tokenizer.ggml.merges")
        pairs = []
        for merge in merges:
            left, sep, right = merge.partition(" ")
            if not sep:
                raise TokenizerError(f"GGUF merge {merge!r} is not 'left right'")
            pairs.append((left, right))
        splits = PRE_TOKENIZER_SPLITS.get(pre)
        if splits is None:
            logger.warning("unknown tokenizer.ggml.pre %r: using the GPT-2 split", pre)
            splits = PRE_TOKENIZER_SPLITS["gpt2"]
        try:
            bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES_PRE)
        except Exception as error:  # noqa: BLE001 - the tokenizers library raises a plain Exception
            raise TokenizerError(f"GGUF BPE tokenizer cannot be built: {error}") from None
        backend = Tokenizer(bpe)
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(expr), behavior="isolated") for expr in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        backend.decoder = decoders.ByteLevel()
    elif model == "llama":
        if scores is None:
            raise TokenizerError("GGUF llama tokenizer has no tokenizer.ggml.scores")
        skip = special | user_defined | {i for i, t in enumerate(token_types)
                                         if t in (TOKEN_TYPE_BYTE, TOKEN_TYPE_UNUSED, TOKEN_TYPE_UNKNOWN)}
        pairs = _sentencepiece_merges(tokens, scores, skip)
        unk = tokens[unk_token_id] if unk_token_id is not None and unk_token_id < len(tokens) else None
        backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk,
                                       fuse_unk=True, byte_fallback=True))
        # llama.cpp puts a space in front of every stretch of text that starts the input or
        # follows a special token, even one that already starts with a space.
        spaces = [normalizers.Replace(" ", SPACE_MARK)]
        backend.normalizer = normalizers.Sequence(
            ([normalizers.Prepend(SPACE_MARK)] if add_space_prefix else []) + spaces)
        steps = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_space_prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        backend.decoder = decoders.Sequence(steps)
    else:
        raise TokenizerError(
            f"GGUF tokenizer model {model!r} is not supported (supported: 'gpt2', 'llama')")

    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i in sorted(special)])
    if user_defined:
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                            for i in sorted(user_defined)])
    return backend


def tokenizer_spec_from_gguf(reader: Any) -> TokenizerSpec:
    """Build the tokenizer a GGUF file describes (``reader`` is a ``gguf.GGUFReader``)."""
    model = _gguf_field(reader, "tokenizer.ggml.model")
    tokens = _gguf_field(reader, "tokenizer.ggml.tokens")
    if model is None or not tokens:
        raise TokenizerError("GGUF file has no tokenizer (tokenizer.ggml.model / tokens missing)")
    token_types = _gguf_field(reader, "tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens)
    if len(token_types) != len(tokens):
        raise TokenizerError(f"GGUF token_type has {len(token_types)} entries for {len(tokens)} tokens")
    pre = _gguf_field(reader, "tokenizer.ggml.pre", "default")
    merges = _gguf_field(reader, "tokenizer.ggml.merges")
    scores = _gguf_field(reader, "tokenizer.ggml.scores")
    add_space_prefix = bool(_gguf_field(reader, "tokenizer.ggml.add_space_prefix", model == "llama"))

    def token_id(key: str) -> int | None:
        value = _gguf_field(reader, f"tokenizer.ggml.{key}")
        if value is None:
            return None
        if not 0 <= int(value) < len(tokens):
            logger.warning("GGUF tokenizer.ggml.%s = %s is outside the vocabulary; ignored", key, value)
            return None
        return int(value)

    bos, eos, eot = token_id("bos_token_id"), token_id("eos_token_id"), token_id("eot_token_id")
    unk, pad = token_id("unknown_token_id"), token_id("padding_token_id")
    # llama.cpp adds BOS for sentencepiece vocabularies unless the file says otherwise.
    add_bos = bool(_gguf_field(reader, "tokenizer.ggml.add_bos_token", model == "llama"))
    add_eos = bool(_gguf_field(reader, "tokenizer.ggml.add_eos_token", False))
    if bos is None:
        add_bos = False

    end_ids: list[int] = [i for i in (eos, eot) if i is not None]
    for i, (token, kind) in enumerate(zip(tokens, token_types, strict=True)):
        if kind == TOKEN_TYPE_CONTROL and token in END_OF_GENERATION_TOKENS and i not in end_ids:
            end_ids.append(i)
    if not end_ids:
        raise TokenizerError("GGUF tokenizer names no EOS token and has no known end-of-turn token")

    backend = _gguf_backend(model, pre, tokens, token_types, merges, scores, add_space_prefix, unk)
    special_tokens = {name: tokens[i] for name, i in
                      (("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad))
                      if i is not None}
    return TokenizerSpec(
        tokenizer_json=backend.to_str(),
        chat_template=_gguf_field(reader, "tokenizer.chat_template")
        or FALLBACK_CHAT_TEMPLATES.get(_gguf_field(reader, "general.architecture")),
        bos_token_id=bos,
        eos_token_ids=tuple(end_ids),
        add_bos=add_bos,
        add_eos=add_eos and eos is not None,
        pad_token_id=pad,
        unk_token_id=unk,
        special_tokens=special_tokens,
    )
