"""Constrained sampling: the tokens a grammar allows next, by llguidance.

A request's grammar travels as llguidance's grammar text (a JSON schema, a Lark grammar or a
regex, compiled by the functions here); :class:`TokenMask` follows one generation through it,
turning each row of logits into one where the tokens the grammar forbids are ``-inf``, and
:func:`grammar_tokenizer` makes the tokenizer view the matcher needs (once per model: ~0.3 s).

llguidance (Microsoft's Low-level Guidance, the engine behind llama.cpp's ``%llguidance``
grammars and vLLM's guided decoding) computes a mask for a 49k vocabulary in ~0.02 ms.

A reasoning model thinks before a constrained answer, as Ollama lets it: :class:`ThinkFirst`
puts a free think block before the grammar of the answer.

llguidance sees every token a tokenizer adds to its vocabulary (special or not: Qwen's
``<tool_call>`` and ``<think>`` are not) as a special token, which text in a grammar cannot
spell: such a marker is the token itself in a grammar (:func:`marker`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

from shards.errors import GrammarError
from shards.runtime.reasoning import THINK_CLOSE, THINK_OPEN
from shards.text.tokenizer import Tokenizer

# Compact JSON with one space after ':' and ',' (what models write); no free whitespace, so
# that a weak model cannot pad its answer with blank lines until it runs out of tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
MAX_GRAMMAR_CHARS = 1 << 20


@dataclass(frozen=True)
class ThinkFirst:
    """A think block before a constrained answer: free reasoning up to its close, then the
    answer the grammar constrains. ``opened``: the prompt opened the block, so the answer
    begins inside it; else the block is optional (the model may answer at once).
    ``tokens``: the texts the tokenizer holds as one added token."""

    opened: bool
    tokens: frozenset[str] = frozenset()

    def rules(self) -> str:
        """Lark rules: ``think``, the block and the whitespace after it."""
        if THINK_CLOSE in self.tokens:  # free text cannot hold a special token: it ends at the close
            thought = f"/(?s:.*)/ {THINK_CLOSE}"
            extra = ""
        else:
            thought = "thought"
            extra = f"thought[suffix={json.dumps(THINK_CLOSE)}]: /(?s:.*)/\n"
        opening = "" if self.opened else marker(THINK_OPEN, self.tokens) + " "
        return f"think: {opening}{thought} /[ \\n]*/\n{extra}"


def marker(text: str, tokens: frozenset[str]) -> str:
    """A marker in a Lark grammar: the token itself where the tokenizer holds its text as one
    added token (the model writes it as that token), else its text."""
    return text if text in tokens else json.dumps(text)


def answer_grammar(rules: str, think: ThinkFirst | None) -> str:
    """The grammar of Lark ``rules`` whose rule ``answer`` is the answer, after ``think``."""
    if think is None:
        return lark_grammar(f"start: answer\n{rules}")
    first = "think" if think.opened else "think?"
    return lark_grammar(f"start: {first} answer\n{rules}{think.rules()}")


def _schema(schema: Any) -> dict[str, Any]:
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as error:
        raise GrammarError(f"the JSON schema cannot be serialised: {error}") from None
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the JSON schema is longer than {MAX_GRAMMAR_CHARS} characters")
    return schema


def json_schema_grammar(schema: Any, think: ThinkFirst | None = None) -> str:
    """The grammar of JSON text valid under ``schema`` (a JSON schema object), after ``think``."""
    schema = _schema(schema)
    if think is not None:
        return answer_grammar(f"answer: {lark_json(schema)}\n", think)
    return _checked(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS))


def lark_json(schema: dict[str, Any]) -> str:
    """A JSON schema as a Lark rule's body (``%json {...}``), its JSON written as
    :func:`json_schema_grammar` writes it."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def lark_grammar(lark: str) -> str:
    """A Lark grammar (llguidance's dialect: :func:`lark_json` embeds a JSON schema)."""
    if len(lark) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the grammar is longer than {MAX_GRAMMAR_CHARS} characters")
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark))


def _checked(grammar: str) -> str:
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise GrammarError(f"the grammar cannot be used: {problem}")
    return grammar


def grammar_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of a model's tokenizer (its ``tokenizer.json``): build once per model."""
    try:
        return llguidance.LLTokenizer(tokenizer.spec.tokenizer_json, n_vocab=tokenizer.vocab_size,
                                      eos_token=list(tokenizer.eos_token_ids) or None)
    except (ValueError, RuntimeError) as error:
        raise GrammarError(f"this model's tokenizer cannot drive a grammar: {error}") from None


class TokenMask:
    """One generation's place in a grammar: which tokens may come next.

    ``mask(row)`` sets every forbidden token of the row to ``-inf`` (ids past the
    tokenizer's vocabulary, padding of the output layer, are always forbidden); ``accept``
    moves on by the token that was chosen. Once the grammar is complete only end-of-generation
    tokens are allowed.
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self._vocab_size = tokenizer.vocab_size
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(f"the grammar cannot be used: {self._matcher.get_error()}")
        self._bits = np.zeros((self._vocab_size + 31) // 32, dtype=np.int32)

    def mask(self, row: np.ndarray) -> np.ndarray:
        """``row`` (a float row the caller owns) with the forbidden tokens at ``-inf``, in place."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._raise_on_error()
        allowed = np.unpackbits(self._bits.view(np.uint8), count=min(row.size, self._vocab_size), bitorder="little")
        row[:allowed.size][allowed == 0] = -np.inf
        row[allowed.size:] = -np.inf
        return row

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(int(token)):
            self._raise_on_error()
            raise GrammarError(f"token {token} does not follow the grammar")

    def accept_all(self, tokens: Sequence[int]) -> None:
        """Catch up with tokens chosen earlier (a generation replayed on another route)."""
        if tokens and not self._matcher.consume_tokens([int(t) for t in tokens]):
            self._raise_on_error()
            raise GrammarError("the tokens so far do not follow the grammar")

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and allows nothing more."""
        return self._matcher.is_stopped()

    def _raise_on_error(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(f"the grammar failed: {self._matcher.get_error()}")


__all__ = ["JSON_OPTIONS", "ThinkFirst", "TokenMask", "answer_grammar", "grammar_tokenizer", "json_schema_grammar",
           "lark_grammar", "lark_json", "marker"]
