"""Speculative decoding (shards/runtime/speculation.py): prompt-lookup drafts are what
followed the latest earlier occurrence of the context's last tokens, a draft model's are its
greedy tokens whatever its cache held before, the verification keeps exactly the tokens the
sampler would have chosen one step at a time, and the draft length follows what was kept."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shards.importers.importer import import_model
from shards.runtime.chain import open_chain
from shards.runtime.sampling import Sampler, SamplingParams
from shards.runtime.speculation import MAX_NGRAM, MIN_NGRAM, DraftLength, DraftModel, PromptLookup, verify
from shards.store.model_store import ModelStore
from tests.examples import examples
from tests.shards.fragment_helpers import VOCAB, chain, write_tiny_checkpoint
from tests.shards.fragment_helpers import greedy as greedy_tokens


def reference_draft(tokens: list[int], count: int) -> tuple[int, ...]:
    """The draft by brute force: the longest suffix (MAX_NGRAM down to MIN_NGRAM) found earlier,
    its latest occurrence, the tokens after it."""
    for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # an occurrence ending before the last token
            if tokens[end - n:end] == suffix:
                return tuple(tokens[end:end + count])
    return ()


@given(st.lists(st.integers(0, 5), max_size=60), st.integers(0, 8), st.integers(0, 60))
def test_a_draft_is_what_followed_the_latest_earlier_occurrence_of_the_last_tokens(tokens, count, split):
    lookup = PromptLookup(tokens[:split])
    lookup.extend(tokens[split:])  # indexed in two goes as in one
    assert lookup.draft(count) == reference_draft(tokens, count)


def test_a_context_that_repeats_itself_drafts_its_continuation():
    lookup = PromptLookup([1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    assert lookup.draft(3) == (4, 5, 6)
    lookup.extend([4, 9])
    assert lookup.draft(3) == ()  # 4 9 never occurred before
    assert PromptLookup([1, 2, 1]).draft(4) == ()  # a single token is not enough to copy after


def greedy(vocab: int, favourites: list[int]) -> np.ndarray:
    """Rows of logits whose argmax is each of ``favourites``."""
    rows = np.zeros((len(favourites), vocab), np.float32)
    rows[np.arange(len(favourites)), favourites] = 5.0
    return rows


def test_verify_keeps_the_drafted_tokens_the_model_chose_then_its_own():
    sampler = Sampler(SamplingParams(temperature=0.0))
    assert verify(sampler.sample, greedy(10, [4, 5, 6]), [4, 5]) == [4, 5, 6]  # all kept, and the next
    assert verify(sampler.sample, greedy(10, [4, 7, 6]), [4, 5]) == [4, 7]  # the second differs: stop there
    assert verify(sampler.sample, greedy(10, [3]), []) == [3]  # a plain step
    with pytest.raises(ValueError, match="2 drafted tokens need 3 rows"):
        verify(sampler.sample, greedy(10, [1, 2]), [1, 2])


@given(st.integers(0, 2**32 - 1), st.lists(st.integers(0, 7), min_size=0, max_size=5),
       st.floats(0.2, 1.5), st.integers(1, 8))
def test_a_seeded_sampler_chooses_the_same_tokens_with_or_without_a_draft(seed, draft, temperature, top_k):
    """The walk samples each row as a plain step would after the tokens kept so far: the
    same seed gives the same tokens as sampling the rows one at a time, whatever was drafted."""
    logits = np.random.default_rng(seed).standard_normal((len(draft) + 1, 8)).astype(np.float32)
    params = SamplingParams(temperature=temperature, top_k=top_k, seed=seed, repeat_penalty=1.3)
    chosen = verify(Sampler(params).sample, logits, draft)
    one_by_one = Sampler(params)
    assert chosen == [one_by_one.sample(row) for row in logits[:len(chosen)]]
    assert chosen[:-1] == draft[:len(chosen) - 1]


@given(st.integers(0, 2**32 - 1))
@settings(max_examples=examples(10), deadline=None)
def test_a_sure_draft_is_kept_with_the_probability_the_model_gives_it(seed):
    """Speculative sampling keeps the distribution: over many walks, the first token is the
    drafted one as often as the model's own probability of it."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((2, 4)).astype(np.float32)
    probability = np.exp(logits[0]) / np.exp(logits[0]).sum()
    walks = 2000
    kept = sum(verify(Sampler(SamplingParams(temperature=1.0, seed=int(rng.integers(2**32)))).sample, logits, [2])[0] == 2
               for _ in range(walks))
    assert abs(kept / walks - probability[2]) < 4 * np.sqrt(probability[2] * (1 - probability[2]) / walks) + 0.01


def test_the_draft_length_grows_when_kept_shrinks_when_rejected_and_pauses_after_misses():
    length = DraftLength(most=6, misses_to_pause=3, pause_steps=2)
    assert length.next() == 4
    length.kept_of(4, 4)
    assert length.next() == 5
    length.kept_of(5, 2)  # kept in part: unchanged
    assert length.next() == 5
    for _ in range(3):
        length.kept_of(length.next(), 0)
    assert [length.next(), length.next(), length.next()] == [0, 0, 2]  # paused two steps, then the least
    assert (length.drafted, length.kept) == (4 + 5 + 5 + 4 + 3, 4 + 2)
    assert DraftLength(most=0).next() == 0


# --- a draft model: the tiny random model drafting for itself ---------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("draft")
    store = ModelStore(tmp / "home")
    import_model(write_tiny_checkpoint(tmp / "checkpoint"), name="tiny", store=store, progress=False)
    return store.model_dir("tiny")


def reference(tiny_dir: Path, context: list[int], count: int) -> tuple[int, ...]:
    """The model's greedy tokens after ``context``, read in a fresh session."""
    return tuple(greedy_tokens(chain(tiny_dir, [(0, 1)]), "reference", np.array(context), count)[1])


def test_a_draft_models_drafts_are_its_greedy_tokens_whatever_its_cache_held(tiny_dir):
    """The draft session follows the request's context: the positions of drafted tokens the
    step did not keep are cut, a finished request's session is taken by the next that begins
    the same way, and the drafts are always what a fresh session would draft."""
    prompt = [1, 5, 9, 13, 17, 21, 25]
    draft = DraftModel(open_chain(tiny_dir, [(0, 1)]), kept_sessions=1)
    try:
        sid = draft.session(prompt)
        first = draft.draft(sid, prompt, 4, p_min=0.0)
        assert first == reference(tiny_dir, prompt, 4)
        # the step kept two drafted tokens and chose another third one
        context = [*prompt, *first[:2], (first[2] + 1) % VOCAB]
        assert draft.draft(sid, context, 3, p_min=0.0) == reference(tiny_dir, context, 3)
        # a whole draft kept, and the token after it
        second = draft.draft(sid, context, 2, p_min=0.0)
        context = [*context, *second, 3]
        assert draft.draft(sid, context, 3, p_min=0.0) == reference(tiny_dir, context, 3)
        assert draft.draft(sid, context, 3, p_min=1.0) == ()  # no token is that sure
        assert draft.draft(sid, context, draft.max_context - len(context) + 1, p_min=0.0) == ()  # no room
        draft.release(sid)

        assert draft.session([*context, 7]) == sid  # a request that begins the same way takes it
        draft.release(sid)
        other = draft.session([2, 4])  # nothing in common: a session of its own
        assert other != sid
        assert draft.draft(other, [2, 4], 2, p_min=0.0) == reference(tiny_dir, [2, 4], 2)
        draft.release(other)  # one session kept: the older one is closed
        assert [r.sessions() for r in draft.runners] == [[other]]
    finally:
        draft.close()
    with pytest.raises(ValueError, match="whole model"):
        DraftModel(chain(tiny_dir, [(0, 0), (1, 1)])[:1])  # the head alone
