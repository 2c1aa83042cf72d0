"""The tokenizer spec itself (shards.text.tokenizer_spec): what it refuses on construction
(with the reason), what it normalises, and its storage as tokenizer.json +
tokenizer_config.json: read back equal (the default model's, and random specs), readable by
Hugging Face's own loaders, and refused when missing or corrupt."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shards.errors import TokenizerError
from shards.text.tokenizer import Tokenizer
from shards.text.tokenizer_hf import tokenizer_spec_from_hf
from shards.text.tokenizer_spec import (
    TOKENIZER_CONFIG_JSON,
    TOKENIZER_JSON,
    TokenizerSpec,
    load_tokenizer_spec,
    save_tokenizer_spec,
)
from tests.examples import examples
from tests.shards.text.tokenizer_helpers import SAMPLES


def test_save_load_roundtrip(spec: TokenizerSpec, tok: Tokenizer, tmp_path: Path) -> None:
    save_tokenizer_spec(spec, tmp_path)
    loaded = load_tokenizer_spec(tmp_path)
    assert loaded == spec
    assert Tokenizer.from_model_dir(tmp_path).encode(SAMPLES[2]) == tok.encode(SAMPLES[2])


def test_load_missing_or_corrupt_raises(tmp_path: Path, spec: TokenizerSpec) -> None:
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer_spec(tmp_path)
    save_tokenizer_spec(spec, tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError):
        load_tokenizer_spec(tmp_path)


def test_spec_validation() -> None:
    with pytest.raises(TokenizerError):
        TokenizerSpec(tokenizer_json="{}", chat_template=None, bos_token_id=None, eos_token_ids=(1,), add_bos=False)
    with pytest.raises(TokenizerError):
        TokenizerSpec(tokenizer_json='{"model": {}}', chat_template=None, bos_token_id=None, eos_token_ids=(),
                      add_bos=False)
    with pytest.raises(TokenizerError):
        TokenizerSpec(tokenizer_json='{"model": {}}', chat_template=None, bos_token_id=None, eos_token_ids=(1,),
                      add_bos=True)


# --- a small word-level tokenizer made here ---------------------------------------------------

WORDS = ["<unk>", "<s>", "</s>", "<pad>", "<eot>", "hello", "world", "again"]


def word_tokenizer_json() -> str:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    backend = Backend(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(WORDS[:5])
    return backend.to_str()


TOKENIZER_JSON_TEXT = word_tokenizer_json()


def make_spec(**over) -> TokenizerSpec:
    fields = dict(tokenizer_json=TOKENIZER_JSON_TEXT, chat_template="{{ messages[0]['content'] }}", bos_token_id=1,
                  eos_token_ids=(2,), add_bos=True)
    return TokenizerSpec(**(fields | over))


@pytest.mark.parametrize(("change", "message"), [
    ({"tokenizer_json": ""}, "non-empty JSON string"),
    ({"tokenizer_json": "   "}, "non-empty JSON string"),
    ({"tokenizer_json": b'{"model": {}}'}, "non-empty JSON string"),
    ({"tokenizer_json": "{model"}, "not valid JSON"),
    ({"tokenizer_json": "[1, 2]"}, "no 'model' section"),
    ({"tokenizer_json": '{"version": "1.0"}'}, "no 'model' section"),
    ({"chat_template": ["{{ x }}"]}, "chat_template must be a string or None"),
    ({"eos_token_ids": ()}, "at least one end-of-generation token"),
    ({"eos_token_ids": (2, 4, 2)}, "duplicates"),
    ({"eos_token_ids": (2, -1)}, "non-negative ints"),
    ({"eos_token_ids": (True,)}, "non-negative ints"),
    ({"eos_token_ids": ("2",)}, "non-negative ints"),
    ({"bos_token_id": -1}, "bos_token_id must be a non-negative int or None"),
    ({"bos_token_id": False, "add_bos": False}, "bos_token_id must be"),
    ({"pad_token_id": 1.0}, "pad_token_id must be"),
    ({"unk_token_id": "0"}, "unk_token_id must be"),
    ({"bos_token_id": None}, "add_bos is set but bos_token_id is None"),
    ({"special_tokens": {"bos_token": 1}}, "special_tokens must map names"),
    ({"special_tokens": {1: "<s>"}}, "special_tokens must map names"),
])
def test_a_spec_that_cannot_be_used_is_refused_with_the_reason(change: dict, message: str) -> None:
    with pytest.raises(TokenizerError, match=message):
        make_spec(**change)


def test_a_spec_keeps_its_ids_as_a_tuple_and_its_names_read_only() -> None:
    names = {"bos_token": "<s>"}
    spec = make_spec(eos_token_ids=[2, 4], special_tokens=names)
    assert spec.eos_token_ids == (2, 4)
    names["eos_token"] = "</s>"  # the caller's dict is copied, not kept
    assert dict(spec.special_tokens) == {"bos_token": "<s>"}
    with pytest.raises(TypeError):
        spec.special_tokens["eos_token"] = "</s>"  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.add_bos = False  # type: ignore[misc]
    assert spec == make_spec(eos_token_ids=(2, 4), special_tokens={"bos_token": "<s>"})


def test_the_document_is_the_parsed_tokenizer_json_parsed_once() -> None:
    spec = make_spec()
    assert spec.document() == json.loads(TOKENIZER_JSON_TEXT)
    assert spec.document() is spec.document()
    assert spec.document()["model"]["type"] == "WordLevel"


_IDS = st.integers(0, len(WORDS) - 1)
_NAMES = st.dictionaries(st.sampled_from(["bos_token", "eos_token", "unk_token", "pad_token"]),
                         st.sampled_from(WORDS[:5]))


@st.composite
def specs(draw: st.DrawFn) -> TokenizerSpec:
    bos = draw(st.none() | _IDS)
    return make_spec(chat_template=draw(st.none() | st.text(max_size=40)), bos_token_id=bos,
                     eos_token_ids=tuple(draw(st.lists(_IDS, min_size=1, max_size=4, unique=True))),
                     add_bos=bos is not None and draw(st.booleans()), add_eos=draw(st.booleans()),
                     pad_token_id=draw(st.none() | _IDS), unk_token_id=draw(st.none() | _IDS),
                     special_tokens=draw(_NAMES))


@settings(max_examples=examples(80), deadline=None)
@given(spec=specs())
def test_any_spec_reads_back_equal_to_what_was_saved(tmp_path_factory: pytest.TempPathFactory,
                                                      spec: TokenizerSpec) -> None:
    folder = tmp_path_factory.mktemp("spec")
    save_tokenizer_spec(spec, folder)
    assert load_tokenizer_spec(folder) == spec
    assert (folder / TOKENIZER_JSON).read_text(encoding="utf-8") == spec.tokenizer_json


def test_saving_makes_the_folder_and_writes_a_config_hugging_face_reads(tmp_path: Path) -> None:
    spec = make_spec(eos_token_ids=(2,), special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    folder = tmp_path / "models" / "tiny"
    save_tokenizer_spec(spec, folder)
    from tokenizers import Tokenizer as Backend

    assert Backend.from_file(str(folder / TOKENIZER_JSON)).encode("hello world").ids == [5, 6]
    config = json.loads((folder / TOKENIZER_CONFIG_JSON).read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["bos_token"] == "<s>"
    assert config["ncm"]["eos_token_ids"] == [2]
    read = tokenizer_spec_from_hf(folder)  # what a Hugging Face folder reader makes of it
    assert (read.bos_token_id, read.eos_token_ids, read.add_bos, read.chat_template) == (
        1, (2,), True, spec.chat_template)
    assert Tokenizer(read).encode("hello world") == Tokenizer(spec).encode("hello world") == [1, 5, 6]


@pytest.mark.parametrize(("config", "message"), [
    ({"chat_template": None}, "has no 'ncm' section"),
    ({"ncm": "ids"}, "has no 'ncm' section"),
    ({"ncm": {"eos_token_ids": 2}}, "is malformed"),
    ({"ncm": {"eos_token_ids": [2], "bos_token_id": "1"}}, "bos_token_id must be"),
    ({"ncm": {"eos_token_ids": []}}, "at least one end-of-generation token"),
])
def test_a_stored_config_that_does_not_describe_a_spec_is_refused(tmp_path: Path, config: dict, message: str) -> None:
    save_tokenizer_spec(make_spec(), tmp_path)
    (tmp_path / TOKENIZER_CONFIG_JSON).write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer_spec(tmp_path)


@pytest.mark.parametrize(("name", "text", "message"), [
    (TOKENIZER_CONFIG_JSON, "[]", "does not hold a JSON object"),
    (TOKENIZER_CONFIG_JSON, "{", "cannot read tokenizer_config.json"),
    (TOKENIZER_JSON, "{}", "no 'model' section"),
])
def test_a_corrupt_stored_file_is_refused_naming_the_problem(tmp_path: Path, name: str, text: str,
                                                            message: str) -> None:
    save_tokenizer_spec(make_spec(), tmp_path)
    (tmp_path / name).write_text(text, encoding="utf-8")
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer_spec(tmp_path)


def test_a_folder_missing_the_config_is_refused_naming_it(tmp_path: Path) -> None:
    save_tokenizer_spec(make_spec(), tmp_path)
    (tmp_path / TOKENIZER_CONFIG_JSON).unlink()
    with pytest.raises(TokenizerError, match="has no tokenizer_config.json"):
        load_tokenizer_spec(tmp_path)


def test_a_spec_names_only_the_special_tokens_it_stores(tmp_path: Path) -> None:
    spec = make_spec(special_tokens={"bos_token": "<s>", "pad_token": "</s>"})
    save_tokenizer_spec(spec, tmp_path)
    assert load_tokenizer_spec(tmp_path) == spec
    for name in ("sep_token", "chat_template"):  # one it would not read back, one that would overwrite the config
        with pytest.raises(TokenizerError, match="special_tokens must map names"):
            make_spec(special_tokens={name: "</s>"})
