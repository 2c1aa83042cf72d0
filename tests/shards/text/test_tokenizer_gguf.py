"""Building a tokenizer spec from a GGUF file's metadata (shards.text.tokenizer_gguf): the
default model's ids and template; byte-level ("gpt2") and sentencepiece ("llama") vocabularies
written here as tiny GGUFs and checked against llama.cpp, the program that defines the files
(the pre-tokenizer splits by ``tokenizer.ggml.pre``, control and user-defined tokens, the
space prefix), the end-of-generation ids, the fallback chat template of base Gemma files, and
the files that are refused."""

from __future__ import annotations

import logging
import unicodedata
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shards.errors import TokenizerError
from shards.text.tokenizer import Tokenizer
from shards.text.tokenizer_gguf import GEMMA_TURNS, PRE_TOKENIZER_SPLITS, tokenizer_spec_from_gguf
from shards.text.tokenizer_spec import TokenizerSpec
from tests.examples import examples
from tests.shards.text.tokenizer_helpers import ENCODABLE, FAST, SPM_PIECES, tiny_gguf_writer, write_spm_gguf


def read_gguf(path: Path) -> TokenizerSpec:
    import gguf

    return tokenizer_spec_from_gguf(gguf.GGUFReader(path))


# --- the default model's GGUF -----------------------------------------------------------------

def test_spec_from_gguf_reads_ids_and_template(spec: TokenizerSpec, tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert spec.eos_token_ids[0] == 2  # <|im_end|>, the file's EOS
    assert 0 in spec.eos_token_ids  # <|endoftext|> also ends a generation
    assert spec.add_bos is False
    assert spec.chat_template is not None and "<|im_start|>" in spec.chat_template
    assert tok.id_to_token(1) == "<|im_start|>"
    assert {0, 1, 2} <= tok.special_token_ids


def test_gguf_without_tokenizer_raises() -> None:
    class Empty:
        fields: dict = {}

    with pytest.raises(TokenizerError, match="no tokenizer"):
        tokenizer_spec_from_gguf(Empty())


@pytest.fixture(scope="module")
def llama_cpp_vocab(smollm2_gguf: Path):
    """llama.cpp's own tokenizer for the GGUF (the program that defines these files)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(str(smollm2_gguf), vocab_only=True, verbose=False)


# Characters new in recent Unicode versions get different classes in llama.cpp's tables and in
# the regex engine of `tokenizers`; compare on characters Python's own database knows.
_ASSIGNED = ENCODABLE.filter(lambda c: unicodedata.category(c) != "Cn")
_RANDOM_PIECES = st.one_of(_ASSIGNED, st.sampled_from(
    list("0123456789 \n\t'sdl") + ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "'s", "'ll", "  "]))


@FAST
@given(text=st.lists(_RANDOM_PIECES, max_size=50).map("".join))
def test_encode_matches_llama_cpp_on_random_text(tok: Tokenizer, llama_cpp_vocab, text: str) -> None:
    assert tok.encode(text) == llama_cpp_vocab.tokenize(text.encode("utf-8"), add_bos=False, special=True)


@pytest.mark.parametrize("text", ["  0", "a  12", "x   2024"])
def test_spaces_before_digits_follow_llama_cpp(tok: Tokenizer, llama_cpp_vocab, text: str) -> None:
    """tokenizer.ggml.pre = "smollm" isolates digits before the GPT-2 split (as llama.cpp and
    SmolLM2's own tokenizer.json do); transformers' GGUF reader ignores it and differs here."""
    ours = tok.encode(text)
    assert ours == llama_cpp_vocab.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    assert tok.decode(ours) == text


# --- a sentencepiece-style ("llama") vocabulary, written as a small GGUF -------------------

SPM_SAMPLES = ["hello world", "the world is in", " hello  world", "東京 é ü 🤖", "hello\nworld\t!", "",
               "<s>hello</s> the", "  ", "a\u2581b", "x<unk>y"]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_spm_gguf(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="module")
def spm_tok(spm_gguf: Path) -> Tokenizer:
    return Tokenizer(read_gguf(spm_gguf))


# transformers reads a sentencepiece GGUF a little differently from llama.cpp: it adds the
# prefix space only once, and not to text that already starts with one
_SPM_TRANSFORMERS_AGREE = ["hello world", "the world is in", "東京 é ü 🤖", "hello\nworld\t!", "", "a\u2581b"]


@pytest.mark.slow  # transformers, the reference, takes seconds to import
@pytest.mark.parametrize("text", _SPM_TRANSFORMERS_AGREE)
def test_sentencepiece_gguf_agrees_with_transformers(spm_gguf: Path, spm_tok: Tokenizer, text: str) -> None:
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoTokenizer.from_pretrained(str(spm_gguf.parent), gguf_file=spm_gguf.name)
    assert spm_tok.spec.add_bos and spm_tok.bos_token_id == 1
    ids = spm_tok.encode(text)
    assert ids == hf.encode(text)
    assert ids[0] == 1
    for skip in (False, True):
        assert spm_tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.fixture(scope="module")
def spm_llama_cpp(spm_gguf: Path):
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(str(spm_gguf), vocab_only=True, verbose=False)


@pytest.mark.parametrize("text", SPM_SAMPLES)
def test_sentencepiece_gguf_agrees_with_llama_cpp(spm_tok: Tokenizer, spm_llama_cpp, text: str) -> None:
    ids = spm_tok.encode(text)
    assert ids == spm_llama_cpp.tokenize(text.encode("utf-8"), add_bos=True, special=True)
    assert spm_tok.decode(ids, skip_special_tokens=True) == spm_llama_cpp.detokenize(ids).decode("utf-8")


@FAST
@given(text=st.lists(st.sampled_from(SPM_PIECES[1:] + [" ", "  ", "<s>", "</s>", "\n", "ü", "🤖"]),
                     max_size=20).map("".join).map(lambda t: t.replace("\u2581", " ")))
def test_sentencepiece_random_text_agrees_with_llama_cpp(spm_tok: Tokenizer, spm_llama_cpp, text: str) -> None:
    assert spm_tok.encode(text) == spm_llama_cpp.tokenize(text.encode("utf-8"), add_bos=True, special=True)


# --- tiny GGUFs made here, one metadata field at a time ----------------------------------------

def _byte_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


GPT2_MERGES = ["h e", "l l", "he ll", "hell o", "1 2", "\u0120 w", "o r", "\u0120w or", "\u0120wor l", "\u0120worl d"]
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eot_id|>", "<|end|>"]
GPT2_TOKENS = CONTROL + _byte_alphabet() + [m.replace(" ", "") for m in GPT2_MERGES] + ["<tool>", "</s>"]
# control tokens first, normal ones, then a user-defined token and a normal token spelled "</s>"
GPT2_TYPES = [3] * len(CONTROL) + [1] * (len(GPT2_TOKENS) - len(CONTROL) - 2) + [4, 1]
IM_START, IM_END, EOT_ID, END = 1, 2, 3, 4
TOOL = GPT2_TOKENS.index("<tool>")


def write_gguf(path: Path, *, arch: str = "llama", model: str | None = "gpt2", pre: str | None = "smollm",
               tokens: list[str] | None = None, types: list[int] | None = None,
               merges: list[str] | None = GPT2_MERGES, scores: list[float] | None = None,
               ids: dict[str, int] | None = None, flags: dict[str, bool] | None = None,
               template: str | None = None) -> Path:
    """A GGUF holding a tokenizer and nothing else: ``ids`` by GGUFWriter's names (``bos`` ->
    ``add_bos_token_id``), ``flags`` likewise (``add_bos_token`` -> ``add_add_bos_token``)."""

    tokens = GPT2_TOKENS if tokens is None else tokens
    writer = tiny_gguf_writer(path, arch)
    if model is not None:
        writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(GPT2_TYPES if types is None else types)
    if merges is not None:
        writer.add_token_merges(merges)
    if scores is not None:
        writer.add_token_scores(scores)
    for name, value in ({"bos": IM_START, "eos": IM_END} if ids is None else ids).items():
        getattr(writer, f"add_{name}_token_id")(value)
    for name, value in (flags or {}).items():
        getattr(writer, f"add_{name}")(value)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_control_tokens_are_special_and_user_defined_ones_plain_added_tokens(tmp_path: Path) -> None:
    tok = Tokenizer(read_gguf(write_gguf(tmp_path / "t.gguf")))
    assert tok.special_token_ids == set(range(len(CONTROL)))
    assert "<tool>" in tok.added_token_texts and TOOL not in tok.special_token_ids
    ids = tok.encode("<|im_start|>hello<tool> world<|im_end|>")
    assert ids[0] == IM_START and TOOL in ids and ids[-1] == IM_END  # each matched whole
    assert tok.decode(ids, skip_special_tokens=True) == "hello<tool> world"
    assert tok.encode("hello world") == [GPT2_TOKENS.index("hello"), GPT2_TOKENS.index("\u0120world")]


def test_end_of_generation_ids_are_eos_and_eot_then_the_control_tokens_known_to_end_a_turn(tmp_path: Path) -> None:
    spec = read_gguf(write_gguf(tmp_path / "t.gguf", ids={"bos": IM_START, "eos": IM_END, "eot": EOT_ID}))
    # <|endoftext|> and <|end|> end a turn by name; <|im_start|> is control but ends nothing; the
    # normal token spelled "</s>" is no control token
    assert spec.eos_token_ids == (IM_END, EOT_ID, 0, END)


def test_a_file_naming_no_eos_ends_on_its_known_end_of_turn_tokens(tmp_path: Path) -> None:
    spec = read_gguf(write_gguf(tmp_path / "t.gguf", ids={"bos": IM_START}))
    assert spec.eos_token_ids == (0, IM_END, EOT_ID, END)
    assert "eos_token" not in spec.special_tokens


def test_a_file_with_no_end_of_generation_token_at_all_is_refused(tmp_path: Path) -> None:
    tokens = ["<s>", *_byte_alphabet(), "he"]
    path = write_gguf(tmp_path / "t.gguf", tokens=tokens, types=[3] + [1] * (len(tokens) - 1), merges=["h e"],
                      ids={"bos": 0})
    with pytest.raises(TokenizerError, match="names no EOS"):
        read_gguf(path)


def test_the_special_token_names_follow_the_files_ids(tmp_path: Path) -> None:
    spec = read_gguf(write_gguf(tmp_path / "t.gguf", ids={"bos": IM_START, "eos": IM_END, "pad": 0,
                                                          "unk": TOOL}))
    assert dict(spec.special_tokens) == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                         "pad_token": "<|endoftext|>", "unk_token": "<tool>"}
    assert (spec.bos_token_id, spec.pad_token_id, spec.unk_token_id) == (IM_START, 0, TOOL)


def test_ids_outside_the_vocabulary_are_ignored_with_a_warning(tmp_path: Path, caplog) -> None:
    path = write_gguf(tmp_path / "t.gguf", ids={"bos": 10**6, "eos": IM_END, "pad": len(GPT2_TOKENS)},
                      flags={"add_bos_token": True})
    with caplog.at_level(logging.WARNING, logger="shards.text.tokenizer_gguf"):
        spec = read_gguf(path)
    assert spec.bos_token_id is None and spec.pad_token_id is None
    assert spec.add_bos is False  # no BOS to add
    assert "bos_token_id = 1000000 is outside the vocabulary" in caplog.text


def test_add_bos_and_add_eos_follow_the_file(tmp_path: Path) -> None:
    flags = {"add_bos_token": True, "add_eos_token": True}
    tok = Tokenizer(read_gguf(write_gguf(tmp_path / "both.gguf", flags=flags)))
    assert tok.encode("hello") == [IM_START, GPT2_TOKENS.index("hello"), IM_END]
    plain = read_gguf(write_gguf(tmp_path / "plain.gguf"))
    assert (plain.add_bos, plain.add_eos) == (False, False)  # byte-level BPE adds nothing unless told
    no_eos = read_gguf(write_gguf(tmp_path / "no-eos.gguf", ids={"bos": IM_START, "eot": EOT_ID}, flags=flags))
    assert no_eos.add_bos and not no_eos.add_eos  # an EOS to add needs an EOS id


def test_a_base_gemma_file_without_a_template_gets_gemmas_turns(tmp_path: Path) -> None:
    tokens = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", *_byte_alphabet(), "he"]
    types = [3] * 5 + [1] * (len(tokens) - 5)
    ids = {"bos": 2, "eos": 1}
    base = read_gguf(write_gguf(tmp_path / "base.gguf", arch="gemma3", tokens=tokens, types=types, merges=["h e"],
                                ids=ids))
    assert base.chat_template == GEMMA_TURNS
    messages = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    assert Tokenizer(base).apply_chat_template(messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    own = read_gguf(write_gguf(tmp_path / "own.gguf", arch="gemma3", tokens=tokens, types=types, merges=["h e"],
                               ids=ids, template="{{ messages[0]['content'] }}"))
    assert own.chat_template == "{{ messages[0]['content'] }}"  # the file's own template wins
    assert read_gguf(write_gguf(tmp_path / "llama.gguf")).chat_template is None  # no fallback for others


@pytest.mark.parametrize(("change", "message"), [
    ({"model": "bert"}, "'bert' is not supported"),
    ({"model": None}, "no tokenizer"),
    ({"merges": None}, "no tokenizer.ggml.merges"),
    ({"merges": ["he"]}, "is not 'left right'"),
    ({"types": [3, 3]}, "token_type has 2 entries"),
    ({"model": "llama"}, "no tokenizer.ggml.scores"),
])
def test_a_tokenizer_that_cannot_be_built_is_refused_with_the_reason(tmp_path: Path, change, message) -> None:
    with pytest.raises(TokenizerError, match=message):
        read_gguf(write_gguf(tmp_path / "t.gguf", **change))


def test_a_merge_making_a_token_outside_the_vocabulary_is_refused_as_a_tokenizer_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError):
        read_gguf(write_gguf(tmp_path / "t.gguf", merges=[*GPT2_MERGES, "w o"]))  # "wo" is no token


def test_an_unknown_pre_tokenizer_falls_back_to_the_gpt2_split_with_a_warning(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="shards.text.tokenizer_gguf"):
        unknown = Tokenizer(read_gguf(write_gguf(tmp_path / "unknown.gguf", pre="no-such-pre")))
    assert "unknown tokenizer.ggml.pre 'no-such-pre'" in caplog.text
    gpt2 = Tokenizer(read_gguf(write_gguf(tmp_path / "gpt2.gguf", pre="gpt2")))
    smollm = Tokenizer(read_gguf(write_gguf(tmp_path / "smollm.gguf", pre="smollm")))
    text = "hello 12 world 1212"
    assert unknown.encode(text) == gpt2.encode(text) != smollm.encode(text)  # smollm isolates every digit


# A few of llama.cpp's pre-tokenizer types, each the head of a family in PRE_TOKENIZER_SPLITS.
PRES = ["gpt-2", "smollm", "starcoder", "llama-bpe", "falcon3", "qwen2"]
_PRE_PIECES = st.sampled_from(list("hel owrd12345 \n\t\r'sA.!?é東🤖") + [
    "<|im_start|>", "<|im_end|>", "<tool>", "'ll", "'S", "  ", "hello", "12", " world", "...", "\u00a0"])


@pytest.fixture(scope="module")
def pre_vocabularies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Tokenizer, object]]:
    """For each of PRES: our tokenizer and llama.cpp's of the same tiny byte-level GGUF."""
    llama_cpp = pytest.importorskip("llama_cpp")
    folder = tmp_path_factory.mktemp("pre")
    out = {}
    for pre in PRES:
        path = write_gguf(folder / f"{pre}.gguf", pre=pre)
        out[pre] = (Tokenizer(read_gguf(path)), llama_cpp.Llama(str(path), vocab_only=True, verbose=False))
    return out


def test_the_pre_tokenizers_tested_are_ones_the_module_knows() -> None:
    assert set(PRES) <= set(PRE_TOKENIZER_SPLITS)


@pytest.mark.parametrize("pre", PRES)
@settings(max_examples=examples(100), deadline=None)
@given(text=st.lists(_PRE_PIECES, max_size=24).map("".join))
def test_each_pre_tokenizer_splits_as_llama_cpp_does(pre_vocabularies, pre: str, text: str) -> None:
    ours, theirs = pre_vocabularies[pre]
    ids = ours.encode(text)
    assert ids == theirs.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    assert ours.decode(ids) == text


def test_the_default_pre_tokenizer_splits_digit_runs_as_llama_cpp_does(tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    path = write_gguf(tmp_path / "default.gguf", pre="default")
    theirs = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    assert Tokenizer(read_gguf(path)).encode("1212") == theirs.tokenize(b"1212", add_bos=False, special=True)


def test_a_sentencepiece_file_without_the_space_prefix_agrees_with_llama_cpp(tmp_path: Path) -> None:
    """``add_space_prefix`` false: no space in front of the text (nor stripped when decoding);
    ``add_bos_token`` false overrides the sentencepiece default of adding BOS."""
    llama_cpp = pytest.importorskip("llama_cpp")
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256)), *SPM_PIECES]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    scores = [0.0] * 259 + [-float(rank) for rank in range(len(SPM_PIECES))]
    path = write_gguf(tmp_path / "spm.gguf", model="llama", pre=None, tokens=tokens, types=types, merges=None,
                      scores=scores, ids={"bos": 1, "eos": 2, "unk": 0},
                      flags={"add_space_prefix": False, "add_bos_token": False})
    tok = Tokenizer(read_gguf(path))
    theirs = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    assert not tok.spec.add_bos and tok.spec.unk_token_id == 0
    for text in ["hello world", " hello", "<s>hello</s> the", "東京 é", "ü"]:
        ids = tok.encode(text)
        assert ids == theirs.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        assert tok.decode(ids) == text
    assert tok.encode("hello")[0] == tokens.index("he")  # not "\u2581hello": no space was put in front
