"""Fixtures of the agent tests: stores with more than the default model."""

from __future__ import annotations

import pytest

from tests.agent.agents import FALLBACK


@pytest.fixture(scope="session")
def full_store(smollm2_store, smollm2_gguf):
    """The model store with the default model in f32 and its q4 copy (the fallback)."""
    from shards.importers.importer import import_model

    if not smollm2_store.has(FALLBACK):
        import_model(smollm2_gguf, name=FALLBACK, weights="q4", store=smollm2_store, progress=False)
    return smollm2_store


@pytest.fixture(autouse=True)
def _shared_calibration(monkeypatch):
    """In-process agents of a test process share one run of the backends' self-test and
    calibration (they are on one machine); agents in processes of their own run their own."""
    from tests.agent.inprocess import share_calibration

    share_calibration(monkeypatch)
