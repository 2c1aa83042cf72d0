"""Embeddings through the official `openai` and `ollama` clients against real agents serving
the default chat model and all-MiniLM-L6-v2: a batch equals its texts one by one, base64
decodes to the same floats, Open WebUI's `/api/embed` batches and the legacy endpoint answer,
the model is listed with its capability, and what cannot be honoured is refused by name. The
request goes to an agent that is not the orchestrator too. An open embedding model is listed
by /api/ps and closed by keep_alive 0 from the admin token. The chat model embeds through its
two-agent pipeline what one process computes: its last token's final hidden state, normalised."""

from __future__ import annotations

import base64

import numpy as np
import ollama
import openai
import pytest

from shards.importers.encoder import import_encoder
from shards.runtime.chain import open_range
from shards.store.model_store import ModelStore
from tests.agent.agents import ADMIN, cluster_ready, linked_copy, make_agents, shut_down, wait_for
from tests.conftest import SMOLLM2_MODEL_NAME

pytestmark = pytest.mark.slow
EMBEDDER = "all-minilm-l6-v2"
TEXTS = ["The kitchen light is on.", "Paris is the capital of France.", "How do I reset the thermostat?"]


@pytest.fixture(scope="module")
def agents(smollm2_store, minilm_folder, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embeddings")
    homes = [linked_copy(smollm2_store.root, tmp / "home-0", (SMOLLM2_MODEL_NAME,)), tmp / "home-1"]
    import_encoder(minilm_folder, name=EMBEDDER, store=ModelStore(homes[0]))
    started = make_agents(tmp, homes, 2, extra_env={"NCM_MAX_CONTEXT": "256", "NCM_ALLOW_FALLBACK": "false"},
                          start=False)
    started[0].env["NCM_ORCHESTRATOR"] = "true"
    for agent in started:
        agent.start([f"--peer={other.url}" for other in started if other is not agent])
    try:
        wait_for(lambda: cluster_ready(started[0], 2), timeout_s=300, what="the cluster to serve")
        yield started
    finally:
        shut_down(started)


def test_the_openai_client_embeds_a_batch_as_one_by_one(agents):
    for agent in agents:  # the orchestrator, then an agent that passes the request on
        client = openai.OpenAI(base_url=agent.url + "/v1", api_key="none", timeout=60, max_retries=0)
        batch = client.embeddings.create(model=EMBEDDER, input=TEXTS)
        vectors = np.array([item.embedding for item in batch.data])
        assert vectors.shape == (3, 384) and [item.index for item in batch.data] == [0, 1, 2]
        assert batch.model == EMBEDDER and batch.usage.prompt_tokens > 3
        for text, vector in zip(TEXTS, vectors):
            alone = client.embeddings.create(model=f"{EMBEDDER}:latest", input=text).data[0].embedding
            np.testing.assert_allclose(alone, vector, atol=1e-5)
        raw = client.embeddings.with_raw_response.create(model=EMBEDDER, input=TEXTS[:1], encoding_format="base64")
        packed = raw.http_response.json()["data"][0]["embedding"]
        np.testing.assert_allclose(np.frombuffer(base64.b64decode(packed), "<f4"), vectors[0], atol=1e-6)
        assert EMBEDDER in [model.id for model in client.models.list()]


def test_what_cannot_be_honoured_is_refused_by_name(agents):
    client = openai.OpenAI(base_url=agents[1].url + "/v1", api_key="none", timeout=60, max_retries=0)
    assert len(client.embeddings.create(model=EMBEDDER, input="x", dimensions=384).data[0].embedding) == 384
    for kwargs, named in (({"dimensions": 128}, "dimensions"), ({"input": [[1, 2, 3]]}, "token ids"),
                          ({"extra_body": {"colour": "red"}}, "colour")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.embeddings.create(**{"model": EMBEDDER, "input": "x", **kwargs})
        assert named in caught.value.message
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-embedder", input="x")


def test_the_ollama_client_and_open_webui_rag_batches(agents):
    client = ollama.Client(host=agents[1].url, timeout=60)
    embedded = client.embed(model=EMBEDDER, input=TEXTS)
    assert len(embedded.embeddings) == 3 and embedded.prompt_eval_count > 3
    legacy = client.embeddings(model=EMBEDDER, prompt=TEXTS[1])
    np.testing.assert_allclose(legacy.embedding, embedded.embeddings[1], atol=1e-5)
    # Open WebUI's RAG upload: chunks of a document in one /api/embed call
    chunks = [f"Chunk {n} of the manual: the boiler needs a yearly service." for n in range(40)]
    status, answer = agents[0].post("/api/embed", {"model": f"{EMBEDDER}:latest", "input": chunks})
    assert status == 200 and len(answer["embeddings"]) == 40 and answer["model"] == EMBEDDER
    shown = client.show(EMBEDDER)
    assert shown.capabilities == ["embedding"] and shown.modelinfo["bert.embedding_length"] == 384
    assert f"{EMBEDDER}:latest" in [m.model for m in client.list().models]
    with pytest.raises(ollama.ResponseError) as caught:
        client.embed(model=EMBEDDER, input="the " * 400, truncate=False)
    assert caught.value.status_code == 400 and "truncate" in caught.value.error


def test_an_open_embedding_model_is_listed_running_and_closed_by_keep_alive_zero(agents):
    client = ollama.Client(host=agents[1].url, timeout=60)
    client.embed(model=EMBEDDER, input=TEXTS[:1], keep_alive="10m")
    running = {m.model: m for m in client.ps().models}
    assert running[f"{EMBEDDER}:latest"].size > 1_000_000 and running[f"{EMBEDDER}:latest"].expires_at.year < 2300
    client.embed(model=EMBEDDER, input=TEXTS[:1], keep_alive=0)  # no admin token: its own keep_alive ends
    assert f"{EMBEDDER}:latest" in [m.model for m in client.ps().models]
    status, _ = agents[1].post("/api/embed", {"model": EMBEDDER, "input": "x", "keep_alive": 0}, headers=ADMIN)
    assert status == 200 and f"{EMBEDDER}:latest" not in [m.model for m in client.ps().models]
    with pytest.raises(ollama.ResponseError) as caught:
        client.embed(model=EMBEDDER, input="x", keep_alive="soon")
    assert caught.value.status_code == 400 and "keep_alive" in caught.value.error


def test_a_chat_model_embeds_through_its_pipeline_what_one_process_computes(agents, smollm2_store, smollm2_tokenizer):
    client = openai.OpenAI(base_url=agents[1].url + "/v1", api_key="none", timeout=120, max_retries=0)
    batch = client.embeddings.create(model=SMOLLM2_MODEL_NAME, input=TEXTS)
    vectors = np.array([item.embedding for item in batch.data])
    assert vectors.shape == (3, 576) and batch.model == SMOLLM2_MODEL_NAME
    runner = open_range(smollm2_store.model_dir(SMOLLM2_MODEL_NAME), 0, 29, 1, threads=1)
    try:
        for index, text in enumerate(TEXTS):
            ids = smollm2_tokenizer.encode(text)
            runner.open_session("reference")
            last = runner.forward("reference", np.array([ids]), last_only=True, hidden=True)[0, -1]
            runner.close_session("reference")
            assert float(vectors[index] @ (last / np.linalg.norm(last))) >= 0.9999
    finally:
        runner.close()
    assert batch.usage.prompt_tokens == sum(len(smollm2_tokenizer.encode(text)) for text in TEXTS)
    ollama_client = ollama.Client(host=agents[0].url, timeout=120)
    alone = ollama_client.embed(model=f"{SMOLLM2_MODEL_NAME}:latest", input=TEXTS[1]).embeddings[0]
    np.testing.assert_allclose(alone, vectors[1], atol=1e-5)
    long_text = "the lights are on " * 200  # 800 tokens, past the context of 256
    cut = ollama_client.embed(model=SMOLLM2_MODEL_NAME, input=long_text)
    assert cut.prompt_eval_count == 256 and len(cut.embeddings[0]) == 576
    with pytest.raises(ollama.ResponseError) as caught:
        ollama_client.embed(model=SMOLLM2_MODEL_NAME, input=long_text, truncate=False)
    assert caught.value.status_code == 400 and "truncate" in caught.value.error
