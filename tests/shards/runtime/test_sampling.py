"""Sampler properties: greedy is argmax, top-k / top-p never leave their set, seeds repeat."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from shards.errors import SamplingError
from shards.runtime.sampling import Sampler, SamplingParams
from tests.examples import examples

_logits = arrays(np.float32, st.integers(2, 64), elements=st.floats(-30, 30, width=32))
_PROPS = settings(max_examples=examples(200), deadline=None)


@_PROPS
@given(logits=_logits)
def test_greedy_is_argmax(logits: np.ndarray) -> None:
    assert Sampler(SamplingParams()).sample(logits) == int(np.argmax(logits))


@_PROPS
@given(logits=_logits, k=st.integers(1, 70), seed=st.integers(0, 2**32), temperature=st.floats(0.05, 5))
@example(logits=np.array([1.0, -1.5000947e-36, 0.0], np.float32), k=2, seed=0, temperature=1.0)  # a tie once shifted
def test_top_k_stays_in_the_k_best(logits: np.ndarray, k: int, seed: int, temperature: float) -> None:
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=k, seed=seed))
    kth_best = np.sort(logits)[::-1][min(k, logits.size) - 1]
    for _ in range(5):
        assert logits[sampler.sample(logits)] >= kth_best


@_PROPS
@given(logits=_logits, p=st.floats(0.01, 1.0), seed=st.integers(0, 2**32), temperature=st.floats(0.05, 5))
def test_top_p_stays_in_the_nucleus(logits: np.ndarray, p: float, seed: int, temperature: float) -> None:
    sampler = Sampler(SamplingParams(temperature=temperature, top_p=p, seed=seed))
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    for _ in range(5):
        token = sampler.sample(logits)
        # a token is in the nucleus when the tokens strictly more likely than it sum to < p
        assert probs[probs > probs[token]].sum() < p + 1e-9


@_PROPS
@given(logits=_logits, seed=st.integers(0, 2**63), top_k=st.integers(0, 10), top_p=st.floats(0.1, 1.0))
def test_same_seed_same_sequence(logits: np.ndarray, seed: int, top_k: int, top_p: float) -> None:
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, seed=seed)
    first, second = Sampler(params), Sampler(params)
    assert [first.sample(logits) for _ in range(10)] == [second.sample(logits) for _ in range(10)]


def test_temperature_follows_the_distribution() -> None:
    sampler = Sampler(SamplingParams(temperature=1.0, seed=7))
    logits = np.log(np.array([0.25, 0.75], dtype=np.float32))
    picks = np.array([sampler.sample(logits) for _ in range(4000)])
    assert abs(picks.mean() - 0.75) < 0.03


def test_low_temperature_approaches_greedy() -> None:
    logits = np.array([1.0, 1.5, 0.2], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=0.01, seed=1))
    assert {sampler.sample(logits) for _ in range(50)} == {1}


def test_masked_logits_are_never_picked() -> None:
    logits = np.array([-np.inf, 0.0, -np.inf, 0.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=2.0, seed=3))
    assert {sampler.sample(logits) for _ in range(100)} == {1, 3}


def test_accepts_a_batch_row_and_rejects_bad_logits() -> None:
    sampler = Sampler(SamplingParams())
    assert sampler.sample(np.array([[0.0, 2.0, 1.0]])) == 1
    for bad in (np.zeros((2, 3)), np.array([]), np.array([np.nan, 1.0]), np.full(3, -np.inf)):
        with pytest.raises(SamplingError):
            sampler.sample(bad)


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "hot"),
    ("top_k", -1), ("top_k", 2.5), ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")),
    ("seed", -1), ("seed", 1.5), ("max_tokens", 0), ("max_tokens", True), ("stop", [""]), ("stop", [3]),
    ("stop", ["x"] * 17),
])
def test_bad_params_name_the_field(field: str, value) -> None:
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**{field: value})


def test_params_normalise_stop() -> None:
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b", "a"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams().greedy and not SamplingParams(temperature=0.7).greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 1.0  # type: ignore[misc]


def test_a_temperature_too_small_to_divide_by_keeps_the_best_token() -> None:
    # 5e-324 is a valid temperature (> 0): dividing logits by it overflows to infinities.
    logits = np.array([0.5, 2.0, -1.0, 2.0 - 1e-9], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=5e-324, seed=3))
    assert {int(sampler.sample(logits)) for _ in range(20)} <= {1, 3}


def test_logit_bias_bans_and_forces_tokens():
    logits = np.array([5.0, 4.0, 3.0, 0.0])
    assert Sampler(SamplingParams(logit_bias={0: -100})).sample(logits) == 1
    assert Sampler(SamplingParams(logit_bias=[[3, 100]])).sample(logits) == 3
    with pytest.raises(SamplingError):
        SamplingParams(logit_bias={0: 101})


def test_penalties_follow_the_window_of_recent_tokens():
    logits = np.array([2.0, 1.9, -1.0, 0.0])
    # token 0 was in the prompt's last tokens: a repeat penalty of 2 halves its logit
    assert Sampler(SamplingParams(repeat_penalty=2.0), history=[0]).sample(logits) == 1
    assert Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=1), history=[0, 3]).sample(logits) == 0
    assert Sampler(SamplingParams(presence_penalty=0.5), history=[0]).sample(logits) == 1
    sampler = Sampler(SamplingParams(frequency_penalty=0.06))
    picks = [sampler.sample(logits) for _ in range(4)]  # each choice counts against itself
    assert picks == [0, 0, 1, 0]


def test_min_p_drops_the_unlikely():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=0.4, seed=3))
    assert set(sampler.allowed(logits)) == {0, 1}


def test_logprobs_are_the_models_own_and_name_the_likeliest():
    logits = np.array([2.0, 1.0, 0.0, -1.0])
    sampler = Sampler(SamplingParams(logprobs=2, logit_bias={0: -100}))  # the bias changes the choice, not the report
    token = sampler.sample(logits)
    expected = logits - np.log(np.exp(logits).sum())
    assert token == 1 and sampler.last_logprobs.token == 1
    assert sampler.last_logprobs.logprob == pytest.approx(expected[1])
    assert [i for i, _ in sampler.last_logprobs.top] == [0, 1]
    assert Sampler(SamplingParams()).last_logprobs is None
    with pytest.raises(SamplingError):
        SamplingParams(logprobs=21)
