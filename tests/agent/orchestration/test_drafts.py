"""Draft models (agent/orchestration/drafts.py), on two in-process agents serving the tiny
model, the first storing every model: a model whose preset names a draft model answers token
for token what plain steps answer, greedy and sampled; a copy of its own weights as the draft
gets its greedy drafts kept, another model's gets them verified all the same; a draft model
that no node holds leaves the requests to prompt lookup, with a warning."""

from __future__ import annotations

import asyncio
import logging

from agent.http.app_keys import METRICS
from shards.importers.importer import import_model
from shards.store.model_store import ModelStore
from tests.agent.inprocess import call
from tests.agent.tiny import tiny_cluster
from tests.shards.fragment_helpers import write_tiny_checkpoint

PROMPT = " ".join(f"w{10 + (i * 7) % 80}" for i in range(30))
PRESETS = """
[tiny]
model-draft = tiny-copy

[tiny-other-draft]
model = tiny
model-draft = other

[tiny-no-draft]
model = tiny
model-draft = missing
"""


def drafted_and_kept(agent, model: str) -> tuple[float, float]:
    metrics = agent.app[METRICS].registry
    return tuple(metrics.get_sample_value("ncm_draft_tokens_total", {"model": model, "outcome": outcome}) or 0.0
                 for outcome in ("drafted", "kept"))


def test_a_draft_models_tokens_are_verified_and_the_answers_stay_the_same(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="agent.orchestration.drafts")
    store = ModelStore(tmp_path / "home-0")
    # the tiny model's own weights (tiny_cluster writes the same checkpoint) under another name
    import_model(write_tiny_checkpoint(tmp_path / "same", layers=4), name="tiny-copy", store=store, progress=False)
    import_model(write_tiny_checkpoint(tmp_path / "other", seed=1), name="other", store=store, progress=False)
    presets = tmp_path / "models.ini"
    presets.write_text(PRESETS)

    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, layers=4, max_context=256, models_preset=presets) as (leader, _):
            for model in ("tiny", "tiny-other-draft", "tiny-no-draft"):
                for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 7, "top_k": 5}):
                    answers = []
                    for extra in ({"speculative.n_max": 0}, {"speculative.p_min": 0},
                                  {"speculative.n_max": 3, "speculative.p_min": 0.2}):
                        status, answer = await call("POST", leader.url + "/v1/completions", {
                            "model": model, "prompt": PROMPT, "max_tokens": 32, "cache_prompt": False,
                            **sampling, **extra})
                        assert status == 200, answer
                        answers.append((answer["choices"][0]["text"], answer["usage"]["completion_tokens"]))
                    assert answers[1] == answers[0] and answers[2] == answers[0], (model, sampling, answers)
                    if model == "tiny" and not sampling["temperature"]:
                        drafted, kept = drafted_and_kept(leader, "tiny")
                        assert drafted > 0 and kept >= 0.9 * drafted, (drafted, kept)
            drafted, kept = drafted_and_kept(leader, "tiny-other-draft")
            assert drafted > 0 and kept <= drafted, (drafted, kept)
            refused = [r.getMessage() for r in caplog.records if "cannot be used" in r.getMessage()]
            assert len(refused) == 1 and "its draft model missing" in refused[0], refused
            status, answer = await call("POST", leader.url + "/v1/completions", {
                "model": "tiny", "prompt": "w1", "speculative.p_min": 1.5})
            assert status == 400 and answer["error"]["param"] == "speculative.p_min", answer

    asyncio.run(scenario())
