"""The embedding models a node keeps open (agent/models/embeddings.py), on a tiny real encoder:
opened on first use and counted while open, closed once idle past the idle rule or a
request's keep_alive, kept while a request runs, and counted in the memory the router's
ledger sees beside the fragments."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from agent.local.probe import GIB, device_memory
from agent.models.embeddings import EmbeddingModels
from shards.importers.encoder import import_encoder
from shards.store.model_store import ModelStore
from tests.shards.importers.test_encoder import SENTENCES, write_tiny_encoder

NAME = "tiny-embedder"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> ModelStore:
    tmp = tmp_path_factory.mktemp("embedding-models")
    write_tiny_encoder(tmp / "src")
    store = ModelStore(tmp / "home")
    import_encoder(tmp / "src", name=NAME, store=store)
    return store


def test_an_open_model_is_counted_until_it_has_been_idle_its_time(store) -> None:
    models = EmbeddingModels(store, threads=1, idle_s=30.0)
    assert models.held_bytes() == 0 and models.resolve(f"{NAME}:latest") == NAME
    first = asyncio.run(models.embed(NAME, SENTENCES[:2]))
    weights = store.encoder_manifest(NAME).weight_bytes
    assert models.memory_bytes() == {NAME: weights} and models.held_bytes() == weights
    assert first.load_s > 0 and first.vectors.shape[0] == 2
    used = models.last_used_s(NAME)
    assert models.close_idle(used + 29.0) == [] and models.held_bytes() == weights
    assert models.close_idle(used + 30.0) == [NAME] and models.held_bytes() == 0
    again = asyncio.run(models.embed(NAME, SENTENCES[:2]))  # reopened, the same vectors
    np.testing.assert_array_equal(again.vectors, first.vectors)


def test_keep_alive_overrides_the_idle_rule_and_zero_closes_only_for_who_may(store) -> None:
    models = EmbeddingModels(store, threads=1, idle_s=0.0)  # 0: open until the agent stops
    asyncio.run(models.embed(NAME, SENTENCES[:1]))
    used = models.last_used_s(NAME)
    assert models.closes_after_s(NAME) == 0 and models.close_idle(used + 1e6) == []
    models.keep_alive(NAME, 5.0, close=False)
    assert models.closes_after_s(NAME) == 5.0 and models.close_idle(used + 5.0) == [NAME]
    asyncio.run(models.embed(NAME, SENTENCES[:1]))
    models.keep_alive(NAME, -1.0, close=False)  # negative: until asked
    assert models.closes_after_s(NAME) == 0 and models.close_idle(time.monotonic() + 1e6) == []
    models.keep_alive(NAME, 0.0, close=False)  # a client without the admin token: its keep_alive ends
    assert models.held_bytes() > 0 and models.closes_after_s(NAME) == 0
    models.keep_alive(NAME, 0.0, close=True)
    assert models.held_bytes() == 0


def test_a_model_in_use_is_not_closed(store) -> None:
    models = EmbeddingModels(store, threads=1, idle_s=0.001)

    async def scenario() -> list[str]:
        await models.embed(NAME, SENTENCES[:1])
        running = asyncio.create_task(models.embed(NAME, SENTENCES * 20))
        while not models._locks[NAME].locked():
            await asyncio.sleep(0)
        closed = models.close_idle(time.monotonic() + 10.0)
        await running
        return closed

    assert asyncio.run(scenario()) == [] and models.held_bytes() > 0


def test_what_is_held_beside_the_fragments_takes_part_of_a_ram_budget() -> None:
    assert device_memory(vram_gib=None, ram_gib=2.0, held_bytes=5, beside_bytes=7) == {
        "total_bytes": 2 * GIB, "external_bytes": 7}
    assert device_memory(vram_gib=8.0, ram_gib=None, held_bytes=5, beside_bytes=7)["external_bytes"] == 0
