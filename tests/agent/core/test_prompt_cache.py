"""The orchestrator's books of the KV caches its stages keep: the longest common beginning is
taken, never the last token; the least recently kept and the idle ones are freed; a cache of
another plan is forgotten."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.prompt_cache import KeptPrompt, PromptCache

SYSTEM = tuple(range(100, 140))  # 40 tokens every request begins with


def kept(sid: str, tokens: tuple[int, ...], plan: int = 1, at_s: float = 0.0, node: str = "") -> KeptPrompt:
    return KeptPrompt(sid, tokens, plan, at_s, node)


def test_the_longest_common_beginning_is_taken_and_no_longer_kept():
    cache = PromptCache(entries=3, idle_s=100)
    cache.keep(kept("a", SYSTEM + (1, 2, 3)))
    cache.keep(kept("b", SYSTEM + (1, 2, 9, 9)))
    taken, length, freed = cache.take(SYSTEM + (1, 2, 9, 7), plan=1, now_s=1)
    assert (taken.sid, length, freed) == ("b", 43, [])
    assert [k.sid for k in cache.kept] == ["a"]


def test_the_last_token_is_always_computed_and_short_matches_are_left_alone():
    cache = PromptCache(entries=2, idle_s=100)
    cache.keep(kept("a", SYSTEM))
    taken, length, _ = cache.take(SYSTEM, plan=1, now_s=1)  # the same prompt again
    assert taken.sid == "a" and length == len(SYSTEM) - 1
    cache.keep(kept("b", SYSTEM[:20] + (1,) * 30))
    assert cache.take(SYSTEM, plan=1, now_s=1)[:2] == (None, 0)  # 20 tokens in common: not worth it
    assert [k.sid for k in cache.kept] == ["b"]


def test_the_least_recently_kept_and_the_idle_are_freed_and_other_plans_forgotten():
    cache = PromptCache(entries=2, idle_s=10)
    assert cache.keep(kept("a", SYSTEM, at_s=0)) == []
    assert cache.keep(kept("b", SYSTEM + (5,), at_s=1)) == []
    assert [k.sid for k in cache.keep(kept("c", SYSTEM + (6,), at_s=2))] == ["a"]
    taken, _, freed = cache.take(SYSTEM + (6, 1), plan=1, now_s=11.5)  # b idle 10.5 s: freed; c taken
    assert taken.sid == "c" and [k.sid for k in freed] == ["b"] and cache.kept == ()
    cache.keep(kept("d", SYSTEM, plan=1))
    assert cache.take(SYSTEM + (1,), plan=2, now_s=0) == (None, 0, []) and cache.kept == ()


def test_a_cache_of_no_entries_keeps_nothing():
    cache = PromptCache(entries=0, idle_s=1)
    assert [k.sid for k in cache.keep(kept("a", SYSTEM))] == ["a"] and cache.kept == ()
    with pytest.raises(ValueError):
        PromptCache(entries=-1, idle_s=1)


@given(st.lists(st.lists(st.integers(0, 3), min_size=30, max_size=60), min_size=1, max_size=6),
       st.lists(st.integers(0, 3), min_size=1, max_size=60))
def test_what_is_taken_is_a_true_common_beginning_shorter_than_the_prompt(kept_lists, prompt):
    cache = PromptCache(entries=6, idle_s=100, min_reused_tokens=1)
    for index, tokens in enumerate(kept_lists):
        cache.keep(kept(str(index), tuple(tokens)))
    taken, length, _ = cache.take(prompt, plan=1, now_s=0)
    if taken is None:
        assert length == 0 and all(not tokens or len(prompt) < 2 or tokens[0] != prompt[0] for tokens in kept_lists)
    else:
        assert 0 < length < len(prompt) and tuple(prompt[:length]) == taken.tokens[:length]


def test_a_request_on_one_copy_takes_only_what_that_copy_keeps():
    cache = PromptCache(entries=4, idle_s=100)
    cache.keep(kept("on-a", SYSTEM + (1, 2, 3), node="a"))
    cache.keep(kept("on-b", SYSTEM + (1, 2), node="b"))
    prompt = SYSTEM + (1, 2, 3, 4)
    assert cache.reuse_by_node(prompt, plan=1) == {"a": 43, "b": 42}
    assert cache.reuse_by_node(prompt, plan=2) == {}
    taken, length, _ = cache.take(prompt, plan=1, now_s=1, node="b")
    assert (taken.sid, length) == ("on-b", 42)
    assert cache.take(prompt, plan=1, now_s=1, node="c")[0] is None
    assert [k.sid for k in cache.kept] == ["on-a"]


def test_each_copy_keeps_its_own_entries():
    cache = PromptCache(entries=1, idle_s=100)
    assert cache.keep(kept("on-a", SYSTEM, node="a")) == []
    assert cache.keep(kept("on-b", SYSTEM, node="b")) == []
    assert [k.sid for k in cache.keep(kept("on-a-2", SYSTEM, node="a"))] == ["on-a"]
    assert [k.sid for k in cache.kept] == ["on-b", "on-a-2"]
