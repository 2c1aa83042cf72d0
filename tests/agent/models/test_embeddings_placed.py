"""An embedding model placed by the router (agent/core/embedding_placement.py) on another node
than the orchestrator, on in-process agents: the orchestrator (node-0, which stores the model)
has no memory to spare, so node-1 fetches the model from it, runs it, answers the vectors the
orchestrator would have computed, and its errors and keep_alive reach the caller as they would
on one node; /api/ps lists the model open there."""

from __future__ import annotations

import asyncio

import numpy as np

from agent.http.app_keys import ADMIN_TOKEN, EMBEDDINGS, ROUTER
from agent.models.embeddings import EmbeddingModels
from shards.importers.encoder import import_encoder
from shards.store.model_store import ModelStore
from tests.agent.inprocess import call, eventually
from tests.agent.tiny import tiny_cluster
from tests.shards.importers.test_encoder import SENTENCES, write_tiny_encoder

EMBEDDER = "tiny-embedder"
# node-0: the orchestrator, with no memory for models (its ram_gib budget is a few KiB), and no layer
PER_AGENT = [{"orchestrator": True, "vram_gib": 0.0, "ram_gib": 1e-5}, {"vram_gib": 8.0, "ram_gib": 4.0}]


def test_an_embedding_model_runs_where_the_router_places_it(tmp_path):
    write_tiny_encoder(tmp_path / "encoder")
    import_encoder(tmp_path / "encoder", name=EMBEDDER, store=ModelStore(tmp_path / "home-0"))
    expected = asyncio.run(EmbeddingModels(ModelStore(tmp_path / "home-0"), threads=1).embed(EMBEDDER, SENTENCES))

    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, per_agent=PER_AGENT, min_layers_per_node=0,
                                models_memory_margin_mib=0) as (leader, (other,)):
            assert leader.node_id == "node-0"
            status, body = await call("POST", leader.url + "/api/embed", {"model": EMBEDDER, "input": SENTENCES},
                                      timeout_s=60)
            assert status == 200, body
            np.testing.assert_allclose(body["embeddings"], expected.vectors, atol=1e-5)
            assert body["prompt_eval_count"] == expected.prompt_tokens
            assert ModelStore(tmp_path / "home-1").has_encoder(EMBEDDER)  # fetched from the orchestrator
            assert list(other.app[EMBEDDINGS].memory_bytes()) == [EMBEDDER]
            assert leader.app[EMBEDDINGS].memory_bytes() == {}

            async def listed() -> bool:
                _, running = await call("GET", leader.url + "/api/ps")
                return f"{EMBEDDER}:latest" in [m["model"] for m in running["models"]]
            await eventually(listed, timeout_s=30, what="/api/ps to list the model open on node-1")

            status, body = await call("POST", leader.url + "/api/embed", {
                "model": EMBEDDER, "input": "the " * 40, "truncate": False})
            assert status == 400 and "truncate" in body["error"], body  # node-1's refusal, as it answered it
            status, body = await call("POST", leader.url + "/v1/embeddings", {"model": EMBEDDER, "input": SENTENCES[0]})
            assert status == 200 and np.allclose(body["data"][0]["embedding"], expected.vectors[0], atol=1e-5)

            admin = {"Authorization": f"Bearer {leader.app[ADMIN_TOKEN]}"}
            status, _ = await call("POST", leader.url + "/api/embed", {"model": EMBEDDER, "input": "x", "keep_alive": 0},
                                   headers=admin)
            assert status == 200 and other.app[EMBEDDINGS].memory_bytes() == {}  # closed where it ran

            async def gone() -> bool:
                return not await listed()
            await eventually(gone, timeout_s=30, what="/api/ps to see the model closed on node-1")

            # no node has room: refused, naming what there is
            leader.app[ROUTER].registry.ledger.memory_margin_bytes = 8 << 30
            status, body = await call("POST", leader.url + "/api/embed", {"model": EMBEDDER, "input": "x"})
            assert status == 503 and "no node has room" in body["error"], body

    asyncio.run(scenario())
