"""Fixtures of the agent tests: stores with more than the default model."""

from __future__ import annotations

import pytest

from tests.agent.agents import FALLBACK


@pytest.fixture(scope="session")
def full_store(smollm2_store, smollm2_gguf):
    """The model store with the default model in f32 and its q4 copy (the fallback)."""
    from shards.importer import import_model

    if not smollm2_store.has(FALLBACK):
        import_model(smollm2_gguf, name=FALLBACK, weights="q4", store=smollm2_store, progress=False)
    return smollm2_store
