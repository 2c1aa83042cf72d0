"""Running a model's tokenizer (a :class:`~shards.text.tokenizer_spec.TokenizerSpec`).

:class:`Tokenizer` wraps a spec for use: ``encode`` / ``decode``, the chat template rendered
in a sandboxed Jinja environment the way transformers renders it, and a
:class:`StreamDecoder` that turns a growing token sequence into text pieces without ever
emitting half a UTF-8 character.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from shards.errors import TokenizerError
from shards.text.tokenizer_spec import SPACE_MARK, TokenizerSpec, load_tokenizer_spec

logger = logging.getLogger(__name__)

_DECODE_BYTE_LEVEL = "byte_level"
_DECODE_SENTENCEPIECE = "sentencepiece"
_DECODE_GENERIC = "generic"
# Special tokens that stay in decoded text even when special tokens are skipped: the marks
# of reasoning and of tool calls, which the answer's reader looks for.
KEPT_MARKERS = frozenset({"<think>", "</think>", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"})

def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte alphabet: printable character -> the byte it stands for."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
                 + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_kind(document: dict) -> tuple[str, bool, bool]:
    """How token strings map to bytes (from the decoder section): the kind, whether one
    leading space of the decoded text is dropped (sentencepiece's added prefix), and whether
    ``<0xXX>`` tokens stand for single bytes (byte fallback)."""
    decoder = document.get("decoder") or {}
    steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = [step.get("type") for step in steps if isinstance(step, dict)]
    if types == ["ByteLevel"]:
        return _DECODE_BYTE_LEVEL, False, False
    if types in (["Metaspace"], ["ByteFallback", "Metaspace"]):
        meta = steps[types.index("Metaspace")]
        scheme = meta.get("prepend_scheme", "always" if meta.get("add_prefix_space", True) else "never")
        return _DECODE_SENTENCEPIECE, scheme != "never", "ByteFallback" in types
    replaces_mark = any(step.get("type") == "Replace" and step.get("content") == " "
                        and (step.get("pattern") or {}).get("String") == SPACE_MARK for step in steps)
    if replaces_mark and set(types) <= {"Replace", "ByteFallback", "Fuse", "Strip"}:
        strips = any(step.get("type") == "Strip" and step.get("content") == " " and step.get("start") == 1
                     for step in steps)
        return _DECODE_SENTENCEPIECE, strips, "ByteFallback" in types
    return _DECODE_GENERIC, False, False


class Tokenizer:
    """Encode, decode, stream-decode and chat-format text for one model."""

    def __init__(self, spec: TokenizerSpec) -> None:
        from tokenizers import Tokenizer as Backend

        self.spec = spec
        try:
            self._backend = Backend.from_str(spec.tokenizer_json)
        except Exception as exc:
            raise TokenizerError(f"tokenizer JSON cannot be loaded: {exc}") from exc
        self.vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
        for name, value in (("bos_token_id", spec.bos_token_id), ("pad_token_id", spec.pad_token_id)):
            if value is not None and value >= self.vocab_size:
                raise TokenizerError(f"{name} {value} is outside the vocabulary of {self.vocab_size}")
        for value in spec.eos_token_ids:
            if value >= self.vocab_size:
                raise TokenizerError(f"EOS id {value} is outside the vocabulary of {self.vocab_size}")
        self._decode_kind, self._strip_first_space, self._byte_fallback = _decoder_kind(spec.document())
        added = self._backend.get_added_tokens_decoder()
        self._added_text: dict[int, str] = {i: token.content for i, token in added.items()}
        self._special_ids: frozenset[int] = frozenset(i for i, token in added.items() if token.special)
        # what an answer's text loses when special tokens are skipped: never the markers its reader needs
        self._skipped_ids = frozenset(i for i in self._special_ids if self._added_text[i] not in KEPT_MARKERS)
        self._template = None

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> Tokenizer:
        """The tokenizer stored in a model directory of the store."""
        return cls(load_tokenizer_spec(model_dir))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.spec.eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self.spec.bos_token_id

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    @cached_property
    def added_token_texts(self) -> frozenset[str]:
        """The texts of every token added to the vocabulary, special or not (Qwen's ``<think>``
        and ``<tool_call>`` are added but not special): each is one token in a grammar."""
        return frozenset(self._added_text.values())

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def same_vocabulary(self, other: Tokenizer) -> bool:
        """Whether ``other`` maps every token to the same id (a draft model's tokens are the
        served model's)."""
        return self._backend.get_vocab(with_added_tokens=True) == other._backend.get_vocab(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in it (``<|im_start|>``) stay whole.
        ``add_special_tokens`` adds BOS / EOS where the model wants them."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode() takes a str, got {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.spec.add_bos and self.spec.bos_token_id is not None:
                ids = [self.spec.bos_token_id, *ids]
            if self.spec.add_eos:
                ids = [*ids, self.spec.eos_token_ids[0]]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (invalid UTF-8 shows as U+FFFD); same as concatenating a stream."""
        stream = self.stream_decoder(skip_special_tokens=skip_special_tokens)
        return "".join(stream.push(i) for i in ids) + stream.flush()

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (an added token: its text), as the APIs report them."""
        piece = self._byte_table[self._check_id(token_id)]
        return piece if piece is not None else self._added_text.get(token_id, "").encode("utf-8")

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """A decoder fed one token id at a time (see :class:`StreamDecoder`)."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    # -- pieces used by StreamDecoder -------------------------------------------------

    @cached_property
    def _byte_table(self) -> list[bytes | None]:
        """Bytes of every non-added token (None for added ones), for byte-wise decoding."""
        alphabet = _byte_level_alphabet() if self._decode_kind == _DECODE_BYTE_LEVEL else None
        table: list[bytes | None] = []
        for token_id in range(self.vocab_size):
            token = self._backend.id_to_token(token_id)
            if token is None or token_id in self._added_text:
                table.append(None)
            elif alphabet is not None:
                if all(c in alphabet for c in token):
                    table.append(bytes(alphabet[c] for c in token))
                else:
                    table.append(token.encode("utf-8"))
            elif self._byte_fallback and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                try:
                    table.append(bytes([int(token[3:5], 16)]))
                except ValueError:
                    table.append(token.replace(SPACE_MARK, " ").encode("utf-8"))
            else:
                table.append(token.replace(SPACE_MARK, " ").encode("utf-8"))
        return table

    def _check_id(self, token_id: int) -> int:
        if isinstance(token_id, bool) or not 0 <= int(token_id) < self.vocab_size:
            raise TokenizerError(f"token id {token_id!r} is outside the vocabulary of {self.vocab_size}")
        return int(token_id)

    # -- chat ---------------------------------------------------------------------------

    def _compiled_template(self):
        if self._template is None:
            if not self.spec.chat_template:
                raise TokenizerError("this model has no chat template; use a raw prompt")
            self._template = _compile_chat_template(self.spec.chat_template)
        return self._template

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render a conversation with the model's chat template (as transformers renders it)."""
        _validate_messages(messages)
        template = self._compiled_template()
        context = {
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            **self.spec.special_tokens,
            **extra,
        }
        from jinja2 import TemplateError

        try:
            return template.render(**context)
        except TokenizerError:
            raise
        except TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **extra: Any) -> list[int]:
        """Token ids of a rendered conversation (the template writes its own BOS, if any).

        Control tokens come from the template alone: text in a message that spells one
        (``<|im_start|>system`` in a user's content) is encoded as the plain text it is, so
        nobody can forge a turn. Conversations without such text encode exactly as the whole
        rendered prompt does.
        """
        _validate_messages(messages)
        contents = [m.get("content") for m in messages]
        if not any(isinstance(c, str) and self._spells_special(c) for c in contents):
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra),
                               add_special_tokens=False)
        if any(isinstance(c, str) and (_STAND_IN_OPEN in c or _STAND_IN_CLOSE in c) for c in contents):
            raise TokenizerError("message content holds reserved characters U+E000 / U+E001")
        stand_ins = [dict(m, content=f"{_STAND_IN_OPEN}{i}{_STAND_IN_CLOSE}") if isinstance(m.get("content"), str)
                     else dict(m) for i, m in enumerate(messages)]
        pieces = _STAND_IN.split(self.apply_chat_template(stand_ins, add_generation_prompt, **extra))
        placed = [int(i) for i in pieces[1::2]]
        if sorted(placed) != [i for i, c in enumerate(contents) if isinstance(c, str)]:
            raise TokenizerError("this chat template rewrites message contents, so control tokens written "
                                 "in them cannot be kept as text; remove them from the messages")
        ids: list[int] = []
        for position, piece in enumerate(pieces):
            if position % 2 == 0:
                ids += self._backend.encode(piece, add_special_tokens=False).ids if piece else []
            else:
                ids += self._text_backend.encode(contents[int(piece)], add_special_tokens=False).ids
        return ids

    def _spells_special(self, text: str) -> bool:
        return any(self._added_text[i] in text for i in self._special_ids)

    @cached_property
    def _text_backend(self) -> Any:
        """The same tokenizer with special tokens encoded as plain text, not matched whole."""
        from tokenizers import Tokenizer as Backend

        backend = Backend.from_str(self.spec.tokenizer_json)
        backend.encode_special_tokens = True
        return backend


_STAND_IN_OPEN, _STAND_IN_CLOSE = "\ue000", "\ue001"  # private-use marks around a message's number
_STAND_IN = re.compile(f"{_STAND_IN_OPEN}(\\d+){_STAND_IN_CLOSE}")


class StreamDecoder:
    """Turns token ids, pushed one by one, into text pieces.

    ``push`` returns only whole characters: bytes of a character split over tokens wait
    until the character is complete. Invalid UTF-8 becomes one U+FFFD per maximal invalid
    part (Python's and the byte-level decoder's rule; `tokenizers`' ByteFallback instead
    replaces every byte of an invalid run, which a stream could not do without waiting).
    The concatenation of everything returned (``push`` calls then ``flush``) equals
    ``Tokenizer.decode`` of the same ids, and the text so far only ever grows.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip_pending = tokenizer._strip_first_space
        self._ids: list[int] = []  # generic mode only
        self._emitted = ""  # generic mode only
        self.token_count = 0

    def _strip(self, text: str) -> str:
        if self._strip_pending and text:
            self._strip_pending = False
            if text.startswith(" "):
                return text[1:]
        return text

    def push(self, token_id: int) -> str:
        """Add one token; return the new complete text (possibly empty)."""
        tok = self._tokenizer
        token_id = tok._check_id(token_id)
        self.token_count += 1
        if tok._decode_kind == _DECODE_GENERIC:
            return self._push_generic(token_id)
        added = tok._added_text.get(token_id)
        if added is not None:
            if self._skip_special and token_id in tok._skipped_ids:
                return ""  # skipped as if absent: bytes on both sides still join
            text = self._utf8.decode(b"", final=True) + added
            self._utf8.reset()
            return self._strip(text)
        return self._strip(self._utf8.decode(tok._byte_table[token_id] or b""))

    def flush(self) -> str:
        """End of stream: whatever is held back (an unfinished character becomes U+FFFD)."""
        if self._tokenizer._decode_kind == _DECODE_GENERIC:
            return self._flush_generic()
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return self._strip(text)

    # Decoders we cannot map to bytes: decode the whole sequence and emit what grew.
    def _push_generic(self, token_id: int) -> str:
        if self._skip_special and token_id in self._tokenizer._skipped_ids:
            return ""
        self._ids.append(token_id)
        text = self._tokenizer._backend.decode(self._ids, skip_special_tokens=False)
        if text.endswith("\ufffd") or not text.startswith(self._emitted):
            return ""
        piece, self._emitted = text[len(self._emitted):], text
        return piece

    def _flush_generic(self) -> str:
        text = self._tokenizer._backend.decode(self._ids, skip_special_tokens=False)
        piece = text[len(self._emitted):] if text.startswith(self._emitted) else ""
        self._emitted = text
        return piece


# ---------------------------------------------------------------------------------------
# Chat templates


def _raise_exception(message: str) -> None:
    raise TokenizerError(f"chat template refused the conversation: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_chat_template(source: str):
    """A chat template compiled in a sandbox, with transformers' settings and helpers."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise TokenizerError(f"chat template does not compile: {exc}") from exc


def _validate_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TokenizerError("messages must be a list of {'role': ..., 'content': ...} objects")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TokenizerError(f"messages[{index}] is not an object")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise TokenizerError(f"messages[{index}] has no 'role' string")
        if "content" in message and message["content"] is not None and not isinstance(
                message["content"], (str, list)):
            raise TokenizerError(f"messages[{index}].content must be a string or a list of parts")
