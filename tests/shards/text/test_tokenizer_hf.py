"""Building a tokenizer spec from a Hugging Face folder (shards.text.tokenizer_hf): the
tokenizer.json as it is, and from tokenizer_config.json / generation_config.json /
chat_template.jinja the BOS and EOS ids (several end ids merged, the config's EOS put in
front when the generation config does not list it), whether BOS is added (the config's flag,
else the post-processor's template), the chat template (a named list's default, or the
separate file), and the folders that are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shards.errors import TokenizerError
from shards.text.tokenizer import Tokenizer
from shards.text.tokenizer_hf import tokenizer_spec_from_hf
from shards.text.tokenizer_spec import TokenizerSpec
from tests.examples import examples
from tests.shards.text.tokenizer_helpers import SAMPLES


def test_spec_from_hf_folder(spec: TokenizerSpec, tok: Tokenizer, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(spec.tokenizer_json, encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "special": True},
        "chat_template": spec.chat_template, "add_bos_token": False}), encoding="utf-8")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}), encoding="utf-8")
    hf_spec = tokenizer_spec_from_hf(tmp_path)
    assert hf_spec.bos_token_id == 1 and hf_spec.eos_token_ids == (2, 0) and hf_spec.add_bos is False
    assert hf_spec.chat_template == spec.chat_template
    assert Tokenizer(hf_spec).encode(SAMPLES[4]) == tok.encode(SAMPLES[4])


def test_spec_from_hf_folder_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        tokenizer_spec_from_hf(tmp_path)


def test_spec_from_hf_reads_bos_from_the_post_processor(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3, "there": 4}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>", "</s>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    spec = tokenizer_spec_from_hf(tmp_path)
    assert spec.add_bos and spec.bos_token_id == 1 and spec.eos_token_ids == (2,)
    tok = Tokenizer(spec)
    assert tok.encode("hi there") == [1, 3, 4]  # BOS once, not twice
    assert tok.encode("hi there", add_special_tokens=False) == [3, 4]


# --- small folders made here -----------------------------------------------------------------

VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "<|eot|>": 4, "hi": 5, "there": 6}


def write_folder(folder: Path, config: dict | None = None, generation: dict | None = None,
                 post_processor: object = None) -> Path:
    """A word-level tokenizer.json over VOCAB (its specials added), and the configs given."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    backend = Backend(models.WordLevel(VOCAB, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<unk>", "<s>", "</s>", "<pad>", "<|eot|>"])
    if post_processor is not None:
        backend.post_processor = post_processor
    backend.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_the_tokenizer_json_is_kept_as_it_is_written(tmp_path: Path) -> None:
    write_folder(tmp_path, {"eos_token": "</s>"})
    assert tokenizer_spec_from_hf(tmp_path).tokenizer_json == (tmp_path / "tokenizer.json").read_text()


def test_special_tokens_written_as_added_token_dicts_are_read_by_their_content(tmp_path: Path) -> None:
    def added(text: str) -> dict:
        return {"__type": "AddedToken", "content": text, "lstrip": False, "special": True}

    write_folder(tmp_path, {"bos_token": added("<s>"), "eos_token": added("</s>"), "unk_token": added("<unk>"),
                            "pad_token": "<pad>", "add_bos_token": True})
    spec = tokenizer_spec_from_hf(tmp_path)
    assert (spec.bos_token_id, spec.eos_token_ids, spec.unk_token_id, spec.pad_token_id) == (1, (2,), 0, 3)
    assert dict(spec.special_tokens) == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                         "pad_token": "<pad>"}
    assert Tokenizer(spec).encode("hi there") == [1, 5, 6]


@settings(max_examples=examples(60), deadline=None)
@given(config_eos=st.sampled_from([None, "</s>", "<|eot|>"]),
       generation_eos=st.one_of(st.none(), st.integers(0, 6), st.lists(st.integers(0, 6), max_size=4)))
def test_end_ids_are_the_generation_configs_without_repeats_and_the_configs_eos_first(
        tmp_path_factory: pytest.TempPathFactory, config_eos, generation_eos) -> None:
    """The config's own EOS comes first (the one add_eos appends), wherever the generation
    config lists it."""
    folder = write_folder(tmp_path_factory.mktemp("eos"), {"eos_token": config_eos},
                          {"eos_token_id": generation_eos})
    listed = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    expected: list[int] = []
    for value in listed:
        if value is not None and value not in expected:
            expected.append(value)
    if config_eos is not None:
        expected = [VOCAB[config_eos], *(i for i in expected if i != VOCAB[config_eos])]
    if not expected:
        with pytest.raises(TokenizerError, match="names no EOS"):
            tokenizer_spec_from_hf(folder)
    else:
        assert tokenizer_spec_from_hf(folder).eos_token_ids == tuple(expected)


def test_the_eos_appended_is_the_configs_own_eos_token(tmp_path: Path) -> None:
    write_folder(tmp_path, {"eos_token": "</s>", "add_eos_token": True}, {"eos_token_id": [4, 2]})
    assert Tokenizer(tokenizer_spec_from_hf(tmp_path)).encode("hi") == [5, VOCAB["</s>"]]


def test_bos_comes_from_the_generation_config_when_the_tokenizer_config_names_none(tmp_path: Path) -> None:
    write_folder(tmp_path, {"eos_token": "</s>"}, {"bos_token_id": 1, "eos_token_id": 2})
    spec = tokenizer_spec_from_hf(tmp_path)
    assert spec.bos_token_id == 1 and "bos_token" not in spec.special_tokens


@pytest.mark.parametrize(("config_flag", "single", "adds"), [
    (None, "<s> $A", True),  # the post-processor puts BOS in front
    (None, "$A </s>", False),  # its first piece is the text
    (None, "</s> $A", False),  # a special token, but not the BOS
    (False, "<s> $A", False),  # the config's flag wins
    (True, "$A", True),
])
def test_whether_bos_is_added_follows_the_config_else_the_post_processor(
        tmp_path: Path, config_flag, single, adds) -> None:
    from tokenizers import processors

    template = processors.TemplateProcessing(single=single, special_tokens=[("<s>", 1), ("</s>", 2)])
    config = {"bos_token": "<s>", "eos_token": "</s>"} | ({} if config_flag is None else {"add_bos_token": config_flag})
    spec = tokenizer_spec_from_hf(write_folder(tmp_path, config, post_processor=template))
    assert spec.add_bos is adds
    assert (Tokenizer(spec).encode("hi")[0] == 1) is adds


def test_a_bos_template_nested_in_a_sequence_of_post_processors_is_found(tmp_path: Path) -> None:
    from tokenizers import processors

    nested = processors.Sequence([processors.ByteLevel(trim_offsets=False),
                                  processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])])
    spec = tokenizer_spec_from_hf(write_folder(tmp_path, {"bos_token": "<s>", "eos_token": "</s>"},
                                               post_processor=nested))
    assert spec.add_bos and Tokenizer(spec).encode("hi there") == [1, 5, 6]


def test_without_a_bos_id_no_bos_is_added_whatever_the_flag_says(tmp_path: Path) -> None:
    spec = tokenizer_spec_from_hf(write_folder(tmp_path, {"eos_token": "</s>", "add_bos_token": True}))
    assert spec.bos_token_id is None and spec.add_bos is False


def test_add_eos_follows_the_config(tmp_path: Path) -> None:
    spec = tokenizer_spec_from_hf(write_folder(tmp_path, {"eos_token": "</s>", "add_eos_token": True}))
    assert spec.add_eos and Tokenizer(spec).encode("hi") == [5, 2]


@pytest.mark.parametrize(("templates", "chosen"), [
    ([{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}], "D"),
    ([{"name": "rag", "template": "R"}, {"name": "tool_use", "template": "T"}], "R"),  # no default: the first
    ([], None),
])
def test_of_several_named_chat_templates_the_default_is_taken(tmp_path: Path, templates, chosen) -> None:
    write_folder(tmp_path, {"eos_token": "</s>", "chat_template": templates})
    assert tokenizer_spec_from_hf(tmp_path).chat_template == chosen


def test_a_separate_chat_template_file_is_read_when_the_config_has_none(tmp_path: Path) -> None:
    write_folder(tmp_path, {"eos_token": "</s>"})
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    spec = tokenizer_spec_from_hf(tmp_path)
    assert Tokenizer(spec).apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"
    write_folder(tmp_path, {"eos_token": "</s>", "chat_template": "config's"})
    assert tokenizer_spec_from_hf(tmp_path).chat_template == "config's"  # the config's own wins


def test_a_chat_template_that_is_not_text_is_dropped(tmp_path: Path) -> None:
    write_folder(tmp_path, {"eos_token": "</s>", "chat_template": 42})
    assert tokenizer_spec_from_hf(tmp_path).chat_template is None


def test_a_folder_with_only_a_generation_config_still_names_its_end(tmp_path: Path) -> None:
    write_folder(tmp_path, None, {"eos_token_id": [4, 2]})
    spec = tokenizer_spec_from_hf(tmp_path)
    assert spec.eos_token_ids == (4, 2) and spec.bos_token_id is None and spec.chat_template is None


@pytest.mark.parametrize(("broken", "message"), [
    ("tokenizer.json", "tokenizer.json cannot be loaded"),
    ("tokenizer_config.json", "cannot read tokenizer_config.json"),
    ("generation_config.json", "cannot read generation_config.json"),
])
def test_a_corrupt_file_is_a_tokenizer_error_naming_it(tmp_path: Path, broken: str, message: str) -> None:
    write_folder(tmp_path, {"eos_token": "</s>"}, {"eos_token_id": 2})
    (tmp_path / broken).write_text('{"model": {"type": "nonsense"}}' if broken == "tokenizer.json" else "{oops")
    with pytest.raises(TokenizerError, match=message):
        tokenizer_spec_from_hf(tmp_path)


def test_a_config_that_is_not_an_object_is_refused(tmp_path: Path) -> None:
    write_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match="does not hold a JSON object"):
        tokenizer_spec_from_hf(tmp_path)
