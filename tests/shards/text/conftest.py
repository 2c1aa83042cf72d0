"""Fixtures the tokenizer tests share: the default model's tokenizer and its spec."""

from __future__ import annotations

import pytest

from shards.text.tokenizer import Tokenizer
from shards.text.tokenizer_spec import TokenizerSpec


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer: Tokenizer) -> Tokenizer:
    """The default model's tokenizer, its spec built from its GGUF by tokenizer_spec_from_gguf."""
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def spec(tok: Tokenizer) -> TokenizerSpec:
    return tok.spec
