"""A model's tokenizer from a Hugging Face folder (:func:`tokenizer_spec_from_hf`): its
``tokenizer.json``, and from ``tokenizer_config.json`` the chat template, the special tokens and
whether BOS and EOS are added."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shards.errors import TokenizerError
from shards.text.tokenizer_spec import TOKENIZER_CONFIG_JSON, TOKENIZER_JSON, TokenizerSpec, read_json


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken-like dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


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
    config = read_json(config_path) if config_path.is_file() else {}
    generation_path = folder / "generation_config.json"
    generation = read_json(generation_path) if generation_path.is_file() else {}

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
    if eos is not None:  # the config's own EOS first: the one add_eos appends
        end_ids = [eos, *(i for i in end_ids if i != eos)]
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
