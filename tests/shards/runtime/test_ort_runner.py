"""OrtFragmentRunner: sessions, KV bookkeeping, errors, providers."""

from __future__ import annotations

import numpy as np
import pytest

from shards.errors import RunnerError
from shards.runtime.chain import chain_forward, open_chain
from shards.runtime.ort_runner import OrtFragmentRunner
from shards.runtime.runner import FragmentRunner
from tests.shards.fragment_helpers import PROMPT_IDS, SMOLLM2, chain


@pytest.fixture(scope="module")
def model_dir(smollm2_store):
    return smollm2_store.model_dir(SMOLLM2)


@pytest.fixture(scope="module")
def small(model_dir):
    """Head fragment (layers 0-1) and a middle one (2-3), max_context 32."""
    return (OrtFragmentRunner(model_dir, 0, 1, max_context=32, threads=1),
            OrtFragmentRunner(model_dir, 2, 3, max_context=32, threads=1))


def test_runner_reports_its_place_and_provider(small) -> None:
    head, mid = small
    assert isinstance(head, FragmentRunner)
    assert (head.first_layer, head.last_layer, head.is_head, head.is_tail) == (0, 1, True, False)
    assert (mid.is_head, mid.is_tail) == (False, False)
    assert head.provider == "CPUExecutionProvider" and head.flavour == "cpu"


def test_session_lifecycle_and_memory(small) -> None:
    head, mid = small
    base = head.memory_bytes()
    assert base > 100_000_000  # the embedding alone is 113 MB
    head.open_session("a")
    with pytest.raises(RunnerError, match="already open"):
        head.open_session("a")
    h = head.forward("a", PROMPT_IDS[None, :])
    assert h.shape == (1, len(PROMPT_IDS), 576) and h.dtype == np.float32
    assert head.session_length("a") == len(PROMPT_IDS)
    kv = 2 * 2 * 3 * 64 * 4 * 32  # 2 layers x (k, v) x kv_heads x head_dim x f32 x max_context
    assert head.memory_bytes() == base + kv  # the buffer's first size is capped at max_context
    assert head.sessions() == ["a"]
    head.close_session("a")
    assert head.memory_bytes() == base and head.sessions() == []
    with pytest.raises(RunnerError, match="unknown session"):
        head.forward("a", PROMPT_IDS[None, :2])


@pytest.mark.parametrize("op", ["forward", "session_length", "close_session"])
def test_unknown_session(small, op) -> None:
    head, _ = small
    args = ("nope", PROMPT_IDS[None, :2]) if op == "forward" else ("nope",)
    with pytest.raises(RunnerError, match="unknown session"):
        getattr(head, op)(*args)


@pytest.mark.parametrize("bad", [
    np.zeros((2, 3), np.int64), np.zeros((1, 0), np.int64), np.zeros((1, 3), np.float32),
    np.full((1, 2), 49152, np.int64), np.full((1, 2), -1, np.int64), np.zeros(3, np.int64),
])
def test_head_rejects_bad_token_ids(small, bad) -> None:
    head, _ = small
    head.open_session("bad")
    try:
        with pytest.raises(RunnerError):
            head.forward("bad", bad)
        assert head.session_length("bad") == 0
    finally:
        head.close_session("bad")


@pytest.mark.parametrize("bad", [np.zeros((1, 2, 500), np.float32), np.zeros((1, 2, 576), np.float64),
                                 np.zeros((1, 2), np.int64)])
def test_middle_rejects_bad_hidden_states(small, bad) -> None:
    _, mid = small
    mid.open_session("bad")
    try:
        with pytest.raises(RunnerError):
            mid.forward("bad", bad)
    finally:
        mid.close_session("bad")


def test_context_overflow(small) -> None:
    head, _ = small
    head.open_session("long")
    try:
        head.forward("long", np.ones((1, 30), np.int64))
        with pytest.raises(RunnerError, match="context overflow"):
            head.forward("long", np.ones((1, 3), np.int64))
        assert head.session_length("long") == 30
        head.forward("long", np.ones((1, 2), np.int64))  # exactly full is fine
        with pytest.raises(RunnerError, match="context overflow"):
            head.forward("long", np.ones((1, 1), np.int64))
    finally:
        head.close_session("long")


def test_static_runner_overflow_and_memory(model_dir) -> None:
    r = OrtFragmentRunner(model_dir, 2, 2, flavour="static", max_context=16, prefill_chunk=4, threads=1)
    base = r.memory_bytes()
    r.open_session("s")
    assert r.memory_bytes() == base + 2 * 3 * 16 * 64 * 4  # fixed-size cache
    x = np.random.default_rng(0).standard_normal((1, 11, 576)).astype(np.float32)
    assert r.forward("s", x).shape == (1, 11, 576)
    with pytest.raises(RunnerError, match="context overflow"):
        r.forward("s", np.zeros((1, 6, 576), np.float32))
    r.close_session("s")
    assert r.memory_bytes() == base
    r.close()


def test_sessions_are_independent(model_dir) -> None:
    runners = chain(model_dir, [(0, 29)], threads=2)
    a1 = chain_forward(runners, "x", PROMPT_IDS[:5])
    chain_forward(runners, "y", PROMPT_IDS[5:])  # another session in between
    a2 = chain_forward(runners, "x", PROMPT_IDS[5:7])
    alone = chain_forward(runners, "z", PROMPT_IDS[:7])
    for s in ("x", "y", "z"):
        runners[0].close_session(s)
    np.testing.assert_allclose(np.concatenate([a1, a2], axis=1), alone, atol=1e-4, rtol=0)


def test_io_binding_keeps_kv_as_ortvalues(model_dir) -> None:
    """The portable flavour (GPU providers) keeps its KV as OrtValues on the device."""
    r = OrtFragmentRunner(model_dir, 2, 3, max_context=32, threads=1, io_binding=True, flavour="portable")
    plain = OrtFragmentRunner(model_dir, 2, 3, max_context=32, threads=1, flavour="portable")
    base = r.memory_bytes()
    x = np.random.default_rng(0).standard_normal((1, 5, 576)).astype(np.float32)
    for runner in (r, plain):
        runner.open_session("s")
    np.testing.assert_array_equal(r.forward("s", x), plain.forward("s", x))
    np.testing.assert_array_equal(r.forward("s", x[:, :1]), plain.forward("s", x[:, :1]))
    assert r.memory_bytes() == base + 2 * 2 * 3 * 64 * 4 * 6
    r.close_session("s")
    assert r.memory_bytes() == base


def test_forced_unavailable_provider(model_dir) -> None:
    with pytest.raises(RunnerError, match="'NoSuchExecutionProvider' is not usable here"):
        OrtFragmentRunner(model_dir, 0, 0, providers=["NoSuchExecutionProvider"])


@pytest.mark.parametrize("cuts", [[(0, 10)], [(1, 29)], [(0, 10), (12, 29)], [(0, 15), (10, 29)], []])
def test_open_chain_needs_a_tiling(model_dir, cuts) -> None:
    with pytest.raises(RunnerError):
        open_chain(model_dir, cuts)


def test_closed_runner_refuses_work(model_dir) -> None:
    r = OrtFragmentRunner(model_dir, 2, 2, max_context=16, threads=1)
    r.open_session("s")
    r.close()
    assert r.sessions() == []
    with pytest.raises(RunnerError, match="closed"):
        r.open_session("t")
