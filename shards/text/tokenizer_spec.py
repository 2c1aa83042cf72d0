"""Tokenizers that travel with a model, built from GGUF metadata or a Hugging Face folder.

A :class:`TokenizerSpec` is everything needed to turn text into the model's token ids and
back: a Hugging Face ``tokenizers`` JSON document plus the few facts that document does not
carry (BOS/EOS ids, whether to prepend BOS, the chat template). It is stored next to the
weights as ``tokenizer.json`` + ``tokenizer_config.json`` (a layout HF tools also read).
:mod:`shards.text.tokenizer` runs a spec.

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

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from shards.errors import TokenizerError

logger = logging.getLogger(__name__)

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG_JSON = "tokenizer_config.json"

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

SPACE_MARK = "\u2581"  # sentencepiece's visible space

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
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,),
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


@dataclass(frozen=True)
class TokenizerSpec:
    """A model's tokenizer: HF ``tokenizers`` JSON plus the ids and template around it."""

    tokenizer_json: str
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos: bool
    add_eos: bool = False
    pad_token_id: int | None = None
    unk_token_id: int | None = None
    special_tokens: Mapping[str, str] = field(default_factory=dict)

    def document(self) -> dict[str, Any]:
        """``tokenizer_json`` parsed (the same dict each call: read it, do not change it)."""
        return self._document  # type: ignore[attr-defined]

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer_json, str) or not self.tokenizer_json.strip():
            raise TokenizerError("tokenizer_json must be a non-empty JSON string")
        try:
            document = json.loads(self.tokenizer_json)
        except json.JSONDecodeError as exc:
            raise TokenizerError(f"tokenizer_json is not valid JSON: {exc}") from exc
        if not isinstance(document, dict) or "model" not in document:
            raise TokenizerError("tokenizer_json has no 'model' section")
        object.__setattr__(self, "_document", document)  # parsed once: a tokenizer's JSON is MBs
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise TokenizerError("chat_template must be a string or None")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        if not self.eos_token_ids:
            raise TokenizerError("eos_token_ids must name at least one end-of-generation token")
        if len(set(self.eos_token_ids)) != len(self.eos_token_ids):
            raise TokenizerError(f"eos_token_ids has duplicates: {self.eos_token_ids}")
        for name in ("bos_token_id", "pad_token_id", "unk_token_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise TokenizerError(f"{name} must be a non-negative int or None, got {value!r}")
        for value in self.eos_token_ids:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise TokenizerError(f"eos_token_ids must hold non-negative ints, got {value!r}")
        if self.add_bos and self.bos_token_id is None:
            raise TokenizerError("add_bos is set but bos_token_id is None")
        if self.add_eos and not self.eos_token_ids:
            raise TokenizerError("add_eos is set but there is no EOS id")
        names = dict(self.special_tokens)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in names.items()):
            raise TokenizerError("special_tokens must map names (bos_token...) to token strings")
        object.__setattr__(self, "special_tokens", MappingProxyType(names))


# ---------------------------------------------------------------------------------------
# GGUF


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
            splits = PRE_TOKENIZER_SPLITS["default"]
        backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                       ignore_merges=pre in _IGNORE_MERGES_PRE))
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


# ---------------------------------------------------------------------------------------
# Hugging Face folders and the stored form


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken-like dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path.name}: {exc}") from exc
    if not isinstance(document, dict):
        raise TokenizerError(f"{path.name} does not hold a JSON object")
    return document


def _post_processor_adds_bos(document: dict, bos_token: str | None) -> bool:
    """True when tokenizer.json's post-processor puts the BOS token in front of a sequence."""
    processor = document.get("post_processor") or {}
    stack = [processor]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if node.get("type") == "TemplateProcessing":
            single = node.get("single") or []
            first = single[0] if single else {}
            special = first.get("SpecialToken") if isinstance(first, dict) else None
            if not isinstance(special, dict):
                return False
            return bos_token is None or special.get("id") == bos_token
        stack.extend(node.get("processors") or [])
    return False


def tokenizer_spec_from_hf(folder: Path) -> TokenizerSpec:
    """Read a Hugging Face model folder's tokenizer (tokenizer.json is required)."""
    from tokenizers import Tokenizer as Backend

    folder = Path(folder)
    tokenizer_path = folder / TOKENIZER_JSON
    if not tokenizer_path.is_file():
        raise TokenizerError(f"{folder} has no {TOKENIZER_JSON}")
    tokenizer_json = tokenizer_path.read_text(encoding="utf-8")
    try:
        backend = Backend.from_str(tokenizer_json)
    except Exception as exc:  # tokenizers raises plain Exception subclasses
        raise TokenizerError(f"{tokenizer_path.name} cannot be loaded: {exc}") from exc
    document = json.loads(tokenizer_json)
    config_path = folder / TOKENIZER_CONFIG_JSON
    config = _read_json(config_path) if config_path.is_file() else {}
    generation_path = folder / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else {}

    def lookup(name: str) -> tuple[str | None, int | None]:
        content = _token_content(config.get(name))
        return content, (backend.token_to_id(content) if content is not None else None)

    bos_token, bos = lookup("bos_token")
    eos_token, eos = lookup("eos_token")
    unk_token, unk = lookup("unk_token")
    pad_token, pad = lookup("pad_token")
    if bos is None and isinstance(generation.get("bos_token_id"), int):
        bos = generation["bos_token_id"]
    end_ids: list[int] = []
    generation_eos = generation.get("eos_token_id")
    for value in (generation_eos if isinstance(generation_eos, list) else [generation_eos]):
        if isinstance(value, int) and value not in end_ids:
            end_ids.append(value)
    if eos is not None and eos not in end_ids:
        end_ids.insert(0, eos)
    if not end_ids:
        raise TokenizerError(f"{folder} names no EOS token (tokenizer_config.json / generation_config.json)")

    if "add_bos_token" in config:
        add_bos = bool(config["add_bos_token"])
    else:
        add_bos = _post_processor_adds_bos(document, bos_token)
    chat_template = config.get("chat_template")
    if isinstance(chat_template, list):  # several named templates: take the default one
        named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
        chat_template = named.get("default") or next(iter(named.values()), None)
    template_file = folder / "chat_template.jinja"
    if chat_template is None and template_file.is_file():
        chat_template = template_file.read_text(encoding="utf-8")
    special_tokens = {name: value for name, value in (("bos_token", bos_token), ("eos_token", eos_token),
                                                      ("unk_token", unk_token), ("pad_token", pad_token))
                      if value is not None}
    return TokenizerSpec(
        tokenizer_json=tokenizer_json,
        chat_template=chat_template if isinstance(chat_template, str) else None,
        bos_token_id=bos,
        eos_token_ids=tuple(end_ids),
        add_bos=add_bos and bos is not None,
        add_eos=bool(config.get("add_eos_token", False)),
        pad_token_id=pad,
        unk_token_id=unk,
        special_tokens=special_tokens,
    )


def save_tokenizer_spec(spec: TokenizerSpec, model_dir: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``model_dir``."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": spec.add_bos,
        "add_eos_token": spec.add_eos,
        "chat_template": spec.chat_template,
        "clean_up_tokenization_spaces": False,
        **spec.special_tokens,
        "ncm": {
            "bos_token_id": spec.bos_token_id,
            "eos_token_ids": list(spec.eos_token_ids),
            "pad_token_id": spec.pad_token_id,
            "unk_token_id": spec.unk_token_id,
        },
    }
    (model_dir / TOKENIZER_JSON).write_text(spec.tokenizer_json, encoding="utf-8")
    (model_dir / TOKENIZER_CONFIG_JSON).write_text(json.dumps(config, indent=2, ensure_ascii=False),
                                                   encoding="utf-8")


def load_tokenizer_spec(model_dir: Path) -> TokenizerSpec:
    """Read what :func:`save_tokenizer_spec` wrote (TokenizerError when missing or corrupt)."""
    model_dir = Path(model_dir)
    tokenizer_path = model_dir / TOKENIZER_JSON
    config_path = model_dir / TOKENIZER_CONFIG_JSON
    for path in (tokenizer_path, config_path):
        if not path.is_file():
            raise TokenizerError(f"{model_dir} has no {path.name}")
    config = _read_json(config_path)
    ids = config.get("ncm")
    if not isinstance(ids, dict):
        raise TokenizerError(f"{config_path.name} in {model_dir} has no 'ncm' section")
    try:
        return TokenizerSpec(
            tokenizer_json=tokenizer_path.read_text(encoding="utf-8"),
            chat_template=config.get("chat_template"),
            bos_token_id=ids.get("bos_token_id"),
            eos_token_ids=tuple(ids.get("eos_token_ids") or ()),
            add_bos=bool(config.get("add_bos_token", False)),
            add_eos=bool(config.get("add_eos_token", False)),
            pad_token_id=ids.get("pad_token_id"),
            unk_token_id=ids.get("unk_token_id"),
            special_tokens={name: config[name] for name in ("bos_token", "eos_token", "unk_token", "pad_token")
                            if isinstance(config.get(name), str)},
        )
    except TypeError as exc:
        raise TokenizerError(f"{config_path.name} in {model_dir} is malformed: {exc}") from exc
