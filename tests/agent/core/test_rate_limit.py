"""The per-key token bucket (agent.core.rate_limit): a burst at once, then ``rate_per_s`` on
average; honest Retry-After answers; waiting never hurts; keys are independent; at most
``max_keys`` buckets, the least recently used forgotten first; bad settings refused."""

from __future__ import annotations

import copy
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.rate_limit import RateLimiter

RATES = st.floats(0.01, 50)
BURSTS = st.integers(1, 20)
GAPS = st.floats(0, 5)
SLACK_S = 1e-6  # Retry-After is computed in floats: probes keep this margin from the exact instant


@given(RATES, BURSTS, st.floats(0, 1e6))
def test_a_new_key_gets_exactly_its_burst_at_once(rate, burst, now):
    limiter = RateLimiter(rate, burst)
    answers = [limiter.allow("10.0.0.7", now=now) for _ in range(burst + 3)]
    assert answers[:burst] == [None] * burst
    assert all(answer is not None for answer in answers[burst:])


@given(RATES, BURSTS, st.lists(GAPS, min_size=1, max_size=60))
def test_no_more_than_the_burst_plus_the_rate_over_any_window(rate, burst, gaps):
    limiter = RateLimiter(rate, burst)
    now, times = 0.0, []
    for gap in gaps:
        now += gap
        if limiter.allow("k", now=now) is None:
            times.append(now)
    for start in range(len(times)):
        for end in range(start, len(times)):
            assert end - start + 1 <= burst + rate * (times[end] - times[start]) + 1e-6


@given(RATES, BURSTS, st.lists(GAPS, max_size=30), st.floats(0, 1e5))
def test_retry_after_is_whole_seconds_and_a_token_is_there_then_and_not_a_second_sooner(rate, burst, gaps, start):
    limiter = RateLimiter(rate, burst)
    now = start
    for gap in [0.0, *gaps]:
        now += gap
        for _ in range(burst + 1):
            retry = limiter.allow("k", now=now)
        assert retry is not None
        assert retry == int(retry) and 1 <= retry <= max(1, math.ceil(1 / rate))
        later = copy.deepcopy(limiter)
        assert later.allow("k", now=now + retry + SLACK_S) is None
        if retry >= 2:
            sooner = copy.deepcopy(limiter)
            assert sooner.allow("k", now=now + retry - 1 - SLACK_S) is not None


@given(RATES, BURSTS, st.lists(GAPS, max_size=20), GAPS, GAPS)
def test_waiting_longer_never_turns_an_allowed_request_into_a_refused_one(rate, burst, gaps, wait, more):
    limiter = RateLimiter(rate, burst)
    now = 0.0
    for gap in gaps:
        now += gap
        limiter.allow("k", now=now)
    soon = copy.deepcopy(limiter).allow("k", now=now + wait)
    late = copy.deepcopy(limiter).allow("k", now=now + wait + more)
    if soon is None:
        assert late is None
    elif late is not None:
        assert late <= soon


@given(RATES, BURSTS, st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), GAPS), max_size=60))
def test_each_key_is_limited_as_if_it_were_alone(rate, burst, requests):
    shared = RateLimiter(rate, burst)
    alone = {key: RateLimiter(rate, burst) for key in "abc"}
    now = 0.0
    for key, gap in requests:
        now += gap
        assert shared.allow(key, now=now) == alone[key].allow(key, now=now)


@given(RATES, BURSTS, st.floats(0, 1e4), st.floats(0, 1e9))
def test_a_long_idle_refills_to_the_burst_and_no_further(rate, burst, start, idle):
    limiter = RateLimiter(rate, burst)
    for _ in range(burst):
        limiter.allow("k", now=start)
    now = start + max(idle, burst / rate + 1)
    answers = [limiter.allow("k", now=now) for _ in range(burst + 1)]
    assert answers[:burst] == [None] * burst and answers[burst] is not None


@given(st.integers(1, 8), st.lists(st.integers(0, 20).map(str), min_size=1, max_size=60))
def test_only_the_max_keys_most_recent_keys_are_remembered(max_keys, keys):
    limiter = RateLimiter(0.001, 1, max_keys=max_keys)  # one request per key, then refused for ages
    recent: list[str] = []
    for key in keys:
        remembered = key in recent
        assert (limiter.allow(key, now=0.0) is not None) == remembered
        recent = [k for k in recent if k != key][-(max_keys - 1):] + [key] if max_keys > 1 else [key]


def test_a_refused_request_takes_no_token():
    limiter = RateLimiter(rate_per_s=1.0, burst=1)
    assert limiter.allow("k", now=0.0) is None
    assert limiter.allow("k", now=0.5) == 1.0
    assert limiter.allow("k", now=1.0) is None


def test_retry_after_counts_the_seconds_to_the_next_token():
    limiter = RateLimiter(rate_per_s=0.1, burst=2)
    assert [limiter.allow("k", now=0.0) for _ in range(3)] == [None, None, 10.0]
    assert limiter.allow("k", now=7.5) == 3.0
    assert limiter.allow("k", now=9.5) == 1.0
    assert limiter.allow("k", now=10.0) is None


def test_the_least_recently_used_key_is_forgotten_first():
    limiter = RateLimiter(rate_per_s=0.001, burst=1, max_keys=2)
    for key in ("a", "b", "a", "c"):  # "a" was used again after "b": "b" goes
        limiter.allow(key, now=0.0)
    assert limiter.allow("a", now=0.0) is not None
    assert limiter.allow("b", now=0.0) is None


@pytest.mark.parametrize(
    "settings",
    [
        {"rate_per_s": 0, "burst": 1},
        {"rate_per_s": -1.0, "burst": 1},
        {"rate_per_s": float("nan"), "burst": 1},
        {"rate_per_s": 1.0, "burst": 0},
        {"rate_per_s": 1.0, "burst": 1, "max_keys": 0},
    ],
)
def test_settings_that_cannot_limit_are_refused(settings):
    with pytest.raises(ValueError, match=r"a rate limit needs rate_per_s > 0, burst >= 1 and max_keys >= 1"):
        RateLimiter(**settings)


def test_a_request_made_exactly_retry_after_seconds_later_is_allowed():
    limiter = RateLimiter(rate_per_s=0.5, burst=1)
    assert limiter.allow("k", now=0.3) is None
    retry = limiter.allow("k", now=0.3)
    assert retry == 2.0
    assert limiter.allow("k", now=0.3 + retry) is None
