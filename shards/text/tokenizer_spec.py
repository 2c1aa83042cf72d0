"""What a model's tokenizer is, and how it is stored next to its weights.

A :class:`TokenizerSpec` is everything needed to turn text into the model's token ids and
back: a Hugging Face ``tokenizers`` JSON document plus the few facts that document does not
carry (BOS/EOS ids, whether to prepend BOS, the chat template). It is stored next to the
weights as ``tokenizer.json`` + ``tokenizer_config.json`` (a layout HF tools also read).
:mod:`shards.text.tokenizer` runs a spec; :mod:`shards.text.tokenizer_gguf` and
:mod:`shards.text.tokenizer_hf` make one from a GGUF file's metadata or a Hugging Face folder.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from shards.errors import TokenizerError

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG_JSON = "tokenizer_config.json"
SPACE_MARK = "\u2581"  # sentencepiece's visible space

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")  # what a spec names and stores


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
        if not all(k in SPECIAL_TOKEN_NAMES and isinstance(v, str) for k, v in names.items()):
            raise TokenizerError(f"special_tokens must map names ({', '.join(SPECIAL_TOKEN_NAMES)}) to token strings, "
                                 f"got {sorted(map(str, names))}")
        object.__setattr__(self, "special_tokens", MappingProxyType(names))


def read_json(path: Path) -> dict:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path.name}: {exc}") from exc
    if not isinstance(document, dict):
        raise TokenizerError(f"{path.name} does not hold a JSON object")
    return document


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
    config = read_json(config_path)
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
            special_tokens={name: config[name] for name in SPECIAL_TOKEN_NAMES if isinstance(config.get(name), str)},
        )
    except TypeError as exc:
        raise TokenizerError(f"{config_path.name} in {model_dir} is malformed: {exc}") from exc
