"""The prompt cache across the pipeline, on two in-process agents serving the tiny model (each
a stage of the route): a request that begins like a finished one takes over the KV cache every
stage kept of it and reads only the rest, with the answer it gives when it reads everything;
the least recently kept cache is freed beyond the model's entries; a stage that lost a kept
cache makes the request read its whole prompt; Ollama counts only what was computed."""

from __future__ import annotations

import asyncio
from typing import Any

from agent.http.app_keys import METRICS, ORCHESTRATOR, WORKER
from tests.agent.inprocess import call
from tests.agent.tiny import TINY, tiny_cluster

LONG = " ".join(f"w{10 + i % 80}" for i in range(60))  # one word, one token: 61 with the BOS
OTHERS = [" ".join(f"w{10 + (i * step) % 80}" for i in range(50)) for step in (3, 7)]


async def complete(url: str, prompt: str, **extra: Any) -> tuple[str, int]:
    status, answer = await call("POST", url + "/v1/completions", {
        "model": TINY, "prompt": prompt, "max_tokens": 6, "temperature": 0, **extra})
    assert status == 200, answer
    return answer["choices"][0]["text"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_prompt_that_begins_like_a_finished_one_reads_only_the_rest(tmp_path):
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, layers=4, max_context=256) as (leader, others):
            url, agents = leader.url, [leader, *others]
            route = leader.app[ORCHESTRATOR].deployments[TINY].order.route.nodes
            assert len(route) == 2, route  # both agents are stages

            def kept_on_stages() -> list[int]:
                return [agent.app[WORKER].status()["kept_sessions"] for agent in agents]

            assert (await complete(url, LONG))[1] == 0
            assert kept_on_stages() == [1, 1] and all(a.app[WORKER].status()["sessions"] == 0 for a in agents)
            longer = LONG + " w5 w6 w7"
            expected, cached = await complete(url, longer, cache_prompt=False)  # neither takes nor keeps
            assert cached == 0 and kept_on_stages() == [1, 1]
            text, cached = await complete(url, longer)
            assert (text, cached) == (expected, 61)  # BOS + the 60 words: read from the kept cache
            # the same prompt again: all but its last token
            assert await complete(url, longer) == (expected, 64 - 1)

            # Two more conversations: the least recently kept cache is freed (2 entries per model).
            for prompt in OTHERS:
                await complete(url, prompt)
            kept = leader.app[ORCHESTRATOR].requests.kept(TINY)
            assert len(kept) == 2 and kept_on_stages() == [2, 2]
            assert (await complete(url, longer))[1] == 0  # its cache went

            # A stage that no longer keeps a cache: the request reads its whole prompt, as it would.
            newest = leader.app[ORCHESTRATOR].requests.kept(TINY)[-1]
            others[0].app[WORKER].close_session(newest.sid)
            expected, _ = await complete(url, longer + " w9", cache_prompt=False)
            assert await complete(url, longer + " w9") == (expected, 0)
            assert kept_on_stages() == [2, 2]  # nothing of the lost one left behind

            # Ollama counts only what was computed.
            fresh = " ".join(f"w{20 + i % 50}" for i in range(40))
            status, first = await call("POST", url + "/api/generate", {
                "model": TINY, "prompt": fresh, "raw": True, "stream": False, "options": {"num_predict": 2}})
            status, again = await call("POST", url + "/api/generate", {
                "model": TINY, "prompt": fresh + " w5", "raw": True, "stream": False, "options": {"num_predict": 2}})
            assert status == 200 and first["prompt_eval_count"] == 41 and again["prompt_eval_count"] == 1, again

    asyncio.run(scenario())


def drafted_and_kept(agent) -> tuple[float, float]:
    metrics = agent.app[METRICS].registry
    return tuple(metrics.get_sample_value("ncm_draft_tokens_total", {"model": TINY, "outcome": outcome}) or 0.0
                 for outcome in ("drafted", "kept"))


def test_speculative_steps_answer_what_plain_steps_answer(tmp_path):
    """Drafts from the context, verified by the tail in one trip: the greedy and the seeded
    sampled answers are token for token those of plain steps (``speculative.n_max`` 0), and
    some drafts were kept. Two stages, so that a rejected draft is cut back on both."""
    repeating = " ".join(f"w{10 + i % 7}" for i in range(40))  # a text that repeats itself: drafts to copy

    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, layers=4, max_context=256) as (leader, _):
            url = leader.url
            for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 7, "top_k": 5}):
                answers = []
                for n_max in (0, 8, 3):
                    status, answer = await call("POST", url + "/v1/completions", {
                        "model": TINY, "prompt": repeating, "max_tokens": 48, "cache_prompt": False,
                        "speculative.n_max": n_max, **sampling})
                    assert status == 200, answer
                    answers.append((answer["choices"][0]["text"], answer["usage"]["completion_tokens"]))
                assert answers[1] == answers[0] and answers[2] == answers[0], (sampling, answers)
            drafted, kept = drafted_and_kept(leader)
            assert drafted > 0 and 0 < kept <= drafted, (drafted, kept)
            status, answer = await call("POST", url + "/v1/completions", {
                "model": TINY, "prompt": "w1", "speculative.n_max": 17})
            assert status == 400 and answer["error"]["param"] == "speculative.n_max", answer

    asyncio.run(scenario())
