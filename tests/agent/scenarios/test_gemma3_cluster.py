"""A model of 2026 end to end: Gemma 3 270M (its Q4_K_M file, sliding-window layers) pulled with
``ncm pull`` and served by three real agents, against llama.cpp running the same file."""

from __future__ import annotations

import numpy as np
import pytest

from shards.importers.pull import pull_model
from shards.store.model_store import ModelStore
from shards.text.tokenizer import Tokenizer
from tests.agent.agents import cluster_ready, make_agents, shut_down, wait_for

pytestmark = pytest.mark.slow
MODEL = "gemma3-270m"
QUESTION = "Question: What is the capital of France?\nAnswer:"


@pytest.fixture(scope="module")
def gemma3_store(tmp_path_factory):
    store = ModelStore(tmp_path_factory.mktemp("gemma3-home"))
    pull_model(MODEL, store, progress=False)
    return store


@pytest.fixture(scope="module")
def cluster(gemma3_store, tmp_path_factory):
    agents = make_agents(tmp_path_factory.mktemp("gemma3-cluster"), gemma3_store.root, 3,
                         extra_env={"NCM_MODEL": MODEL})
    try:
        wait_for(lambda: cluster_ready(agents[0], 3) or cluster_ready(agents[1], 3), timeout_s=600,
                 what="the 3-agent cluster to serve Gemma 3")
        yield agents
    finally:
        shut_down(agents)


@pytest.fixture(scope="module")
def llama_cpp_greedy(gemma3_gguf):
    """Greedy token ids of llama.cpp running the same file."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(gemma3_gguf), n_ctx=2048, n_threads=2, logits_all=True, verbose=False)

    def greedy(ids: list[int], steps: int) -> list[int]:
        llm.reset()
        llm.eval(ids)
        out = []
        for _ in range(steps):
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval(out[-1:])
        return out

    return greedy


def test_the_pulled_file_is_gemma3_with_its_sliding_window(gemma3_store) -> None:
    m = gemma3_store.manifest(MODEL)
    assert (m.architecture, m.n_layers, m.sliding_window, m.vocab_size) == ("gemma3", 18, 512, 262144)
    assert m.sliding_layers == tuple(i for i in range(18) if (i + 1) % 6)


def test_three_agents_continue_raw_prompts_as_llama_cpp_does(cluster, gemma3_store, llama_cpp_greedy) -> None:
    """Greedy continuations through the cluster, token for token llama.cpp's: a short prompt, and
    one longer than the sliding window (prefilled in chunks, across the stages)."""
    tokenizer = Tokenizer.from_model_dir(gemma3_store.model_dir(MODEL))
    long_text = " ".join(f"Item {i} of the list is the number {i * 7 % 101}." for i in range(60)) + " Item 60 of"
    for prompt, steps in ((QUESTION, 12), (long_text, 8)):
        ids = tokenizer.encode(prompt)
        status, body = cluster[0].post("/v1/completions", {"model": MODEL, "prompt": prompt, "temperature": 0,
                                                           "max_tokens": steps})
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == len(ids) and (len(ids) > 512) is (prompt is long_text)
        assert body["choices"][0]["text"] == tokenizer.decode(llama_cpp_greedy(ids, steps)), prompt[-40:]
    status, body = cluster[1].post("/v1/completions", {"model": MODEL, "prompt": QUESTION, "temperature": 0,
                                                       "max_tokens": 2})
    assert status == 200 and body["choices"][0]["text"].startswith(" Paris"), body


def test_a_chat_request_is_written_in_gemma_turns(cluster, gemma3_store) -> None:
    """The file has no chat template: a chat goes in Gemma's turn format, as llama.cpp writes it."""
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]
    status, body = cluster[2].post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 8,
                                                            "temperature": 0})
    assert status == 200, body
    tokenizer = Tokenizer.from_model_dir(gemma3_store.model_dir(MODEL))
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered == ("<bos><start_of_turn>user\nAnswer briefly.\n\nName a colour.<end_of_turn>\n"
                        "<start_of_turn>model\n")
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode_chat(messages))
