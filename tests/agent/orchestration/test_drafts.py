"""Draft models (agent/orchestration/drafts.py), on two in-process agents serving the tiny
model, the first storing every model: a model whose preset names a draft model answers token
for token what plain steps answer, greedy and sampled; a copy of its own weights as the draft
gets its greedy drafts kept, another model's gets them verified all the same, and what they
hold counts beside the fragments; a draft model that no node holds leaves the requests to
prompt lookup, with a warning. A request's next draft, written while a step is verified, is
the one it would draft then when the step kept what it guessed, and is dropped when not."""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from agent.http.app_keys import METRICS, ORCHESTRATOR, WORKER
from agent.orchestration.drafts import RequestDraft
from shards.importers.importer import import_model
from shards.runtime.chain import open_chain
from shards.runtime.speculation import DraftModel
from shards.store.model_store import ModelStore
from tests.agent.inprocess import call
from tests.agent.tiny import tiny_cluster
from tests.shards.fragment_helpers import VOCAB, chain, greedy, write_tiny_checkpoint

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


def drafted_kept_ahead(agent, model: str) -> tuple[float, float, float]:
    metrics = agent.app[METRICS].registry
    return tuple(metrics.get_sample_value("ncm_draft_tokens_total", {"model": model, "outcome": outcome}) or 0.0
                 for outcome in ("drafted", "kept", "ahead"))


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
                        drafted, kept, ahead = drafted_kept_ahead(leader, "tiny")
                        assert drafted > 0 and kept >= 0.9 * drafted, (drafted, kept)
                        assert ahead >= 0.5 * drafted, (drafted, ahead)  # most written while a step was verified
            # the draft models' memory counts beside the fragments in what the node reports for the ledger
            held = leader.app[ORCHESTRATOR].requests.drafts.held_bytes()
            assert held > 0 and leader.app[WORKER].beside_bytes() >= held
            drafted, kept, _ = drafted_kept_ahead(leader, "tiny-other-draft")
            assert drafted > 0 and kept <= drafted, (drafted, kept)
            refused = [r.getMessage() for r in caplog.records if "cannot be used" in r.getMessage()]
            assert len(refused) == 1 and "its draft model missing" in refused[0], refused
            status, answer = await call("POST", leader.url + "/v1/completions", {
                "model": "tiny", "prompt": "w1", "speculative.p_min": 1.5})
            assert status == 400 and answer["error"]["param"] == "speculative.p_min", answer

    asyncio.run(scenario())


def test_a_draft_written_ahead_is_taken_when_the_step_kept_what_it_guessed(tmp_path):
    store = ModelStore(tmp_path / "home")
    import_model(write_tiny_checkpoint(tmp_path / "checkpoint"), name="tiny", store=store, progress=False)
    model_dir = store.model_dir("tiny")

    def reference(context: list[int], count: int) -> list[int]:
        return greedy(chain(model_dir, [(0, 1)]), "reference", np.array(context), count)[1]

    async def scenario(model: DraftModel) -> None:
        prompt = [1, 5, 9, 13, 17, 21, 25]
        request = await RequestDraft.open(model, prompt, p_min=0.0)
        first = await request.draft(prompt, 3)
        assert list(first) == reference(prompt, 3) and not request.drafted_ahead
        # the step keeps the whole draft and the draft model's own next token: the next draft was written
        request.draft_ahead(prompt, first, 4)
        context = [*prompt, *first, reference([*prompt, *first], 1)[0]]
        second = await request.draft(context, 4)
        assert list(second) == reference(context, 4) and request.drafted_ahead
        # the step keeps the whole draft and chooses another token after it: drafted again
        request.draft_ahead(context, second, 4)
        context = [*context, *second, (reference([*context, *second], 1)[0] + 1) % VOCAB]
        second = await request.draft(context, 4)
        assert list(second) == reference(context, 4) and not request.drafted_ahead
        # the step keeps one drafted token and chooses another second one: drafted again
        request.draft_ahead(context, second, 4)
        context = [*context, second[0], (second[1] + 1) % VOCAB]
        assert list(await request.draft(context, 2)) == reference(context, 2) and not request.drafted_ahead
        request.draft_ahead(context, (3,), 4)
        await request.stop_ahead()  # a step that does not draft
        request.draft_ahead(context, (3,), 4)
        await request.close()  # the request ends while a draft ahead runs: the session is kept
        assert model.session([*context, 3]) == request.session_id

    model = DraftModel(open_chain(model_dir, [(0, 1)]))
    try:
        asyncio.run(scenario(model))
    finally:
        model.close()
