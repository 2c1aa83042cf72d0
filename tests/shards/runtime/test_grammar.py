"""Constrained sampling with llguidance on the real SmolLM2 tokenizer: whatever the logits
say, what a grammar lets through parses (50 random JSON schemas, each output validated with
jsonschema), tool-call grammars give calls that read back, and a generation replayed on
another route takes up the grammar where it was."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from shards.errors import GrammarError
from shards.runtime.grammar import TokenMask, grammar_tokenizer, json_schema_grammar
from shards.runtime.sampling import Sampler, SamplingParams
from shards.runtime.tool_calls import FORMATS, call_grammar, parse_calls

MAX_STEPS = 600


@pytest.fixture(scope="module")
def llg(smollm2_tokenizer):
    return grammar_tokenizer(smollm2_tokenizer)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2, None, True], rng.randint(1, 3))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    names = rng.sample(["name", "age", "city", "tags", "ok", "n", "x"], rng.randint(1, 4))
    properties = {name: random_schema(rng, depth + 1) for name in names}
    return {"type": "object", "properties": properties,
            "required": rng.sample(names, rng.randint(0, len(names))), "additionalProperties": False}


def constrained(llg, tokenizer, grammar: str, seed: int, *, steps: int = MAX_STEPS,
                bias: tuple[tuple[int, float], ...] = ()) -> list[int]:
    """Sample from random logits through ``grammar`` until an end-of-generation token."""
    rng = np.random.default_rng(seed)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed, logit_bias=bias), TokenMask(llg, grammar))
    ids = []
    for _ in range(steps):
        token = sampler.sample(rng.normal(size=tokenizer.vocab_size).astype(np.float32) * 3)
        if token in tokenizer.eos_token_ids:
            return ids
        ids.append(token)
    raise AssertionError(f"no end after {steps} tokens: {tokenizer.decode(ids)[:200]!r}")


def test_fifty_random_schemas_each_give_valid_json(llg, smollm2_tokenizer):
    rng = random.Random(20261203)
    for index in range(50):
        schema = random_schema(rng)
        if schema.get("type") != "object":
            schema = {"type": "object", "properties": {"value": schema}, "required": ["value"],
                      "additionalProperties": False}
        ids = constrained(llg, smollm2_tokenizer, json_schema_grammar(schema), index)
        jsonschema.validate(json.loads(smollm2_tokenizer.decode(ids)), schema)


def test_a_replayed_generation_goes_on_where_the_grammar_was(llg, smollm2_tokenizer):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
    grammar = json_schema_grammar(schema)
    ids = constrained(llg, smollm2_tokenizer, grammar, 3)
    replayed = TokenMask(llg, grammar)
    replayed.accept_all(ids[:5])  # a new tail catches up with what was chosen, then goes on
    for token in ids[5:]:
        assert np.isfinite(replayed.mask(np.zeros(smollm2_tokenizer.vocab_size))[token])
        replayed.accept(token)
    with pytest.raises(GrammarError):
        TokenMask(llg, grammar).accept_all(smollm2_tokenizer.encode("not json", add_special_tokens=False))


TOOLS = [{"name": "HassTurnOn", "description": "turns a device on",
          "parameters": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                          "area": {"type": "string", "maxLength": 8}},
                         "required": ["name"], "additionalProperties": False}},
         {"name": "GetLiveContext", "description": "what the home looks like now",
          "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_forced_tool_call_reads_back_in_every_format(llg, smollm2_tokenizer, fmt):
    for choice in ("required", "GetLiveContext"):
        for seed in range(3):
            grammar = call_grammar(fmt, TOOLS, choice, parallel=False)
            text = smollm2_tokenizer.decode(constrained(llg, smollm2_tokenizer, grammar, seed))
            content, calls = parse_calls(fmt, text)
            assert len(calls) == 1 and content == "", text
            tool = next(t for t in TOOLS if t["name"] == calls[0].name)
            assert choice == "required" or tool["name"] == choice
            jsonschema.validate(calls[0].arguments, tool["parameters"])


def test_an_auto_generic_answer_is_a_call_or_a_reply(llg, smollm2_tokenizer):
    grammar = call_grammar("generic", TOOLS, "auto", parallel=True)
    quote = smollm2_tokenizer.encode('"', add_special_tokens=False)[0]  # a free reply ends some time
    for seed in range(6):
        text = smollm2_tokenizer.decode(constrained(llg, smollm2_tokenizer, grammar, seed, bias=((quote, 8.0),)))
        content, calls = parse_calls("generic", text)
        assert calls or content == json.loads(text)["response"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_with_a_response_format_an_auto_answer_is_a_call_or_json_of_its_schema(llg, smollm2_tokenizer, fmt):
    """Tools and response_format together (agents with a typed output): whatever the logits,
    the answer is a well-formed call, or JSON the schema validates (the reply's content)."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "celsius": {"type": "integer", "minimum": -40, "maximum": 50}},
              "required": ["city", "celsius"], "additionalProperties": False}
    grammar = call_grammar(fmt, TOOLS, "auto", parallel=False, answer_schema=schema)
    kinds = set()
    for seed in range(8):
        text = smollm2_tokenizer.decode(constrained(llg, smollm2_tokenizer, grammar, seed))
        content, calls = parse_calls(fmt, text)
        if calls:
            tool = next(t for t in TOOLS if t["name"] == calls[0].name)
            jsonschema.validate(calls[0].arguments, tool["parameters"])
            kinds.add("call")
        else:
            jsonschema.validate(json.loads(content), schema)
            kinds.add("answer")
    assert kinds, "nothing sampled"


def test_a_bad_schema_is_a_typed_error():
    with pytest.raises(GrammarError):
        json_schema_grammar({"type": "object", "properties": {"a": {"type": "no-such-type"}}})
    with pytest.raises(GrammarError):
        json_schema_grammar(["not", "a", "schema"])


def qwen_like_tokenizer(folder):
    """A byte-level tokenizer whose reasoning and call marks are added tokens that are not
    special, as Qwen3's are: llguidance still sees each as one special token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from shards.text.tokenizer import Tokenizer as NcmTokenizer
    from shards.text.tokenizer_hf import tokenizer_spec_from_hf

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({char: i for i, char in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True, normalized=False)])
    tok.add_tokens([AddedToken(text, special=False, normalized=False)
                    for text in ("<think>", "</think>", "<tool_call>", "</tool_call>")])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    return NcmTokenizer(tokenizer_spec_from_hf(folder))


def split_reasoning(text: str, *, opened: bool) -> tuple[str, str]:
    from shards.runtime.reasoning import ReasoningSplitter

    splitter = ReasoningSplitter(inside=opened)
    pieces = [splitter.push(text), splitter.finish()]
    return "".join(p[0] for p in pieces), "".join(p[1] for p in pieces)


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "celsius": {"type": "integer", "minimum": -40, "maximum": 50}},
           "required": ["city", "celsius"], "additionalProperties": False}


@pytest.mark.parametrize("opened", [False, True])
def test_a_thinking_model_thinks_freely_before_a_constrained_answer(llg, smollm2_tokenizer, tmp_path, opened):
    """Reasoning first, then JSON its schema validates, whether the close of the think block is
    text (SmolLM2 holds no such token) or one added token (Qwen's kind, not special): the
    think block ends at its first close, and what follows is held to the format."""
    from shards.runtime.grammar import ThinkFirst

    qwen = qwen_like_tokenizer(tmp_path)
    for tokenizer, engine in ((smollm2_tokenizer, llg), (qwen, grammar_tokenizer(qwen))):
        think = ThinkFirst(opened=opened, tokens=tokenizer.added_token_texts)
        grammar = json_schema_grammar(WEATHER, think)
        for seed, thought in enumerate(("", "It is { cold </think there.", "Paris?\n\nNo: Oslo.")):
            written = ("" if opened else "<think>") + f"\n{thought}\n</think>\n\n"
            mask = TokenMask(engine, grammar)
            for token in tokenizer.encode(written, add_special_tokens=False):  # the grammar lets it all through
                assert np.isfinite(mask.mask(np.zeros(tokenizer.vocab_size, np.float32))[token]), written
                mask.accept(token)
            sampler = Sampler(SamplingParams(temperature=1.0, seed=seed), mask)
            rng = np.random.default_rng(seed)
            ids = []
            while (token := sampler.sample(rng.normal(size=tokenizer.vocab_size).astype(np.float32) * 3)) \
                    not in tokenizer.eos_token_ids:
                ids.append(token)
                assert len(ids) < MAX_STEPS
            reasoning, reply = split_reasoning(written + tokenizer.decode(ids), opened=opened)
            assert reasoning == thought.strip()
            jsonschema.validate(json.loads(reply), WEATHER)
        # the close of the block, the way the tokenizer writes it, ends the reasoning
        mask = TokenMask(engine, grammar)
        mask.accept_all(([] if opened else tokenizer.encode("<think>", add_special_tokens=False))
                        + tokenizer.encode("hmm { </think>", add_special_tokens=False))
        with pytest.raises(GrammarError):
            mask.accept_all(tokenizer.encode("</think>", add_special_tokens=False))


def test_a_forced_call_writes_an_added_marker_as_its_one_token(tmp_path):
    """Qwen's <tool_call> is an added token that is not special: the grammar takes that one
    token (the model's own way to write it), not the text spelled out."""
    qwen = qwen_like_tokenizer(tmp_path)
    engine = grammar_tokenizer(qwen)
    grammar = call_grammar("hermes", TOOLS, "GetLiveContext", parallel=False, tokens=qwen.added_token_texts)
    mask = TokenMask(engine, grammar)
    opening = qwen.token_to_id("<tool_call>")
    row = mask.mask(np.zeros(qwen.vocab_size, np.float32))
    assert np.isfinite(row[opening]) and np.isinf(row[qwen.encode("<", add_special_tokens=False)[0]])
    text = qwen.decode(constrained(engine, qwen, grammar, 0))
    content, calls = parse_calls("hermes", text)
    assert content == "" and [call.name for call in calls] == ["GetLiveContext"]
