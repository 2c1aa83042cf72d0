"""The "cpu" flavour's KV cache (rows of a KvPool): written in place, room for the whole context
at once (grown by doubling where that is refused), its memory counted as written, decode
steps of several sessions batched; the same logits as the portable flavour (plain ops, a new
present tensor each step, one session at a time)."""

from __future__ import annotations

import numpy as np
import pytest

import shards.runtime.kv_pool as kv_pool_module
import shards.runtime.ort_runner as runner_module
from shards.errors import RunnerError
from shards.importers.importer import import_model
from shards.runtime.ort_runner import OrtFragmentRunner
from shards.store.model_store import ModelStore
from tests.shards.fragment_helpers import write_tiny_checkpoint

GROWTH = 16  # positions; small, so that a short test crosses several doublings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    store = ModelStore(root / "home")
    import_model(write_tiny_checkpoint(root / "checkpoint", layers=3), name="tiny", weights="f32", store=store,
                 progress=False)
    return store.model_dir("tiny")


@pytest.fixture(autouse=True)
def small_growth(monkeypatch):
    monkeypatch.setattr(runner_module, "KV_GROWTH_POSITIONS", GROWTH)


def kv_bytes(positions: int, layers: int) -> int:
    return layers * 2 * 2 * 16 * 4 * positions  # layers x (k, v) x kv_heads x head_dim x float32


def test_decoding_on_gives_the_portable_flavours_logits_in_one_buffer_counted_as_written(model_dir, tmp_path) -> None:
    in_place = OrtFragmentRunner(model_dir, 0, 2, threads=1, cache_dir=tmp_path)
    portable = OrtFragmentRunner(model_dir, 0, 2, threads=1, flavour="portable", cache_dir=tmp_path)
    assert in_place.flavour == "cpu"
    base = in_place.memory_bytes()
    ids = np.random.default_rng(3).integers(3, 90, size=60)
    for runner in (in_place, portable):
        runner.open_session("s")
    counted = []
    np.testing.assert_allclose(in_place.forward("s", ids[None, :20]), portable.forward("s", ids[None, :20]),
                               atol=1e-4, rtol=0)
    buffer = in_place._pool.arrays["past_key.0"]
    assert buffer.shape[2] == in_place.max_context  # room for the whole context: pages come as they are written
    for position in range(20, 60):
        counted.append((in_place.memory_bytes() - base) // kv_bytes(1, 3))
        step = ids[None, position:position + 1]
        np.testing.assert_allclose(in_place.forward("s", step), portable.forward("s", step), atol=1e-4, rtol=0)
    assert in_place._pool.arrays["past_key.0"] is buffer  # never copied
    # counted before each step: the positions written, in steps of the growth step
    assert sorted(set(counted)) == [32, 48, 64]
    assert counted.index(48) == 32 - 20 + 1
    in_place.close_session("s")
    assert in_place.memory_bytes() == base


def test_without_address_space_for_the_whole_context_the_buffer_grows_by_doubling(model_dir, tmp_path,
                                                                                  monkeypatch) -> None:
    runner = OrtFragmentRunner(model_dir, 0, 2, threads=1, cache_dir=tmp_path)
    alone = OrtFragmentRunner(model_dir, 0, 2, threads=1, cache_dir=tmp_path)
    allocate = kv_pool_module.allocate

    def refused_at_full_context(shape, dtype):
        if shape[2] == runner.max_context:
            raise MemoryError("no address space")
        return allocate(shape, dtype)

    ids = np.random.default_rng(4).integers(3, 90, size=(1, 40))
    alone.open_session("s")
    expected = alone.forward("s", ids)
    monkeypatch.setattr(kv_pool_module, "allocate", refused_at_full_context)
    runner.open_session("s")
    capacities = []
    for position in range(40):
        step = runner.forward("s", ids[:, position:position + 1])
        np.testing.assert_allclose(step[:, 0], expected[:, position], atol=1e-4, rtol=0)
        capacities.append(runner._pool.capacity)
    assert sorted(set(capacities)) == [GROWTH, 2 * GROWTH, 4 * GROWTH]


@pytest.mark.parametrize("flavour", ["cpu", "portable"])
def test_a_tail_asked_for_the_last_row_gives_the_last_row_of_all_of_them(model_dir, tmp_path, flavour) -> None:
    runner = OrtFragmentRunner(model_dir, 0, 2, threads=1, flavour=flavour, cache_dir=tmp_path)
    ids = np.random.default_rng(5).integers(3, 90, size=(1, 12))
    for sid in ("all", "last"):
        runner.open_session(sid)
    full = runner.forward("all", ids[:, :9])
    last = runner.forward("last", ids[:, :9], last_only=True)
    assert full.shape[:2] == (1, 9) and last.shape == (1, 1, full.shape[2])
    np.testing.assert_allclose(last[:, 0], full[:, -1], atol=1e-5, rtol=0)
    # the cache holds all 9 positions either way: the next steps agree row for row
    np.testing.assert_allclose(runner.forward("last", ids[:, 9:], last_only=True), runner.forward("all", ids[:, 9:])[:, -1:],
                               atol=1e-5, rtol=0)
    assert runner.session_length("last") == runner.session_length("all") == 12
    hidden = OrtFragmentRunner(model_dir, 0, 1, threads=1, flavour=flavour, cache_dir=tmp_path)
    hidden.open_session("s")
    assert hidden.forward("s", ids, last_only=True).shape == (1, 12, 64)  # not a tail: every row goes on


def test_a_decode_step_writes_into_the_same_buffer(model_dir, tmp_path) -> None:
    runner = OrtFragmentRunner(model_dir, 1, 2, threads=1, cache_dir=tmp_path)
    runner.open_session("s")
    x = np.random.default_rng(0).standard_normal((1, 5, 64)).astype(np.float32)
    runner.forward("s", x)
    key = runner._pool.arrays["past_key.1"]
    assert key.shape == (1, 2, runner.max_context, 16) and not key[:, :, 5:].any()
    runner.forward("s", x[:, :1])
    assert runner._pool.arrays["past_key.1"] is key  # not a new array: the step wrote into it
    assert key[:, :, 5].any() and not key[:, :, 6:].any()


def test_batched_decode_steps_give_each_sessions_own_logits(model_dir, tmp_path) -> None:
    """Sessions of different lengths step together; one between them in the pool ("idle")
    rides along with a dummy row and is unharmed; a closed session's row is reused."""
    batched = OrtFragmentRunner(model_dir, 0, 2, threads=1, cache_dir=tmp_path)
    alone = OrtFragmentRunner(model_dir, 0, 2, threads=1, flavour="portable", cache_dir=tmp_path)
    rng = np.random.default_rng(5)
    prompts = {"a": 7, "idle": 3, "b": 30, "c": 1}
    for sid, length in prompts.items():
        ids = rng.integers(3, 90, size=(1, length))
        for runner in (batched, alone):
            runner.open_session(sid)
            runner.forward(sid, ids)
    order = ["c", "a", "b"]  # not in row order
    for _ in range(6):  # crosses the growth from 32 to 64 positions ("b")
        ids = rng.integers(3, 90, size=(3, 1))
        expected = np.concatenate([alone.forward(sid, ids[i:i + 1]) for i, sid in enumerate(order)])
        np.testing.assert_allclose(batched.forward_batch(order, ids), expected, atol=1e-4, rtol=0)
    assert [batched.session_length(s) for s in order] == [7, 13, 36]
    step = rng.integers(3, 90, size=(1, 2))
    np.testing.assert_allclose(batched.forward("idle", step), alone.forward("idle", step), atol=1e-4, rtol=0)
    batched.close_session("a")
    batched.open_session("d")  # takes the row "a" left
    assert batched._pool.slot_of["d"] == 0 and batched._pool.slots == 4
    ids = rng.integers(3, 90, size=(1, 4))
    alone.open_session("d")
    np.testing.assert_allclose(batched.forward("d", ids), alone.forward("d", ids), atol=1e-4, rtol=0)
    base = batched.memory_bytes() - batched._pool.nbytes()
    for sid in list(batched.sessions()):
        batched.close_session(sid)
    assert batched.memory_bytes() == base and batched._pool.nbytes() == 0


def test_a_runner_without_a_pool_batches_row_by_row(model_dir, tmp_path) -> None:
    runner = OrtFragmentRunner(model_dir, 0, 2, threads=1, flavour="portable", cache_dir=tmp_path)
    reference = OrtFragmentRunner(model_dir, 0, 2, threads=1, cache_dir=tmp_path)
    for r in (runner, reference):
        for sid in ("x", "y"):
            r.open_session(sid)
    ids = np.array([[5], [9]])
    np.testing.assert_allclose(runner.forward_batch(["x", "y"], ids), reference.forward_batch(["x", "y"], ids),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize(("sessions", "shape", "message"), [
    (["x", "x"], (2, 1), "distinct"),
    (["x", "y"], (2, 3), "one position per session"),
    (["x", "y"], (3, 1), r"token ids \[2, T\]"),
    (["x", "nope"], (2, 1), "unknown session"),
])
def test_a_bad_batch_is_refused_and_changes_nothing(model_dir, tmp_path, sessions, shape, message) -> None:
    runner = OrtFragmentRunner(model_dir, 0, 2, threads=1, cache_dir=tmp_path)
    for sid in ("x", "y"):
        runner.open_session(sid)
    with pytest.raises(RunnerError, match=message):
        runner.forward_batch(sessions, np.full(shape, 5))
    assert runner.session_length("x") == runner.session_length("y") == 0


def test_the_buffer_stops_at_max_context_and_overflow_is_refused(model_dir, tmp_path) -> None:
    runner = OrtFragmentRunner(model_dir, 0, 0, threads=1, max_context=40, cache_dir=tmp_path)
    base = runner.memory_bytes()
    runner.open_session("s")
    runner.forward("s", np.arange(3, 36)[None, :])  # 33 positions: 64 would pass max_context
    assert runner.memory_bytes() - base == kv_bytes(40, 1)
    runner.forward("s", np.arange(3, 10)[None, :])
    with pytest.raises(RunnerError, match="context overflow"):
        runner.forward("s", np.array([[5]]))
    assert runner.session_length("s") == 40


@pytest.mark.parametrize("flavour", ["cpu", "portable", "static"])
def test_a_cache_handed_over_and_cut_reads_on_as_a_fresh_one(model_dir, tmp_path, flavour) -> None:
    """A prompt cache's reuse: a new session takes over a finished one's cache, cut where the
    new prompt leaves the old one, and the rest of the new prompt gives the logits it gives
    from scratch (the old positions past the cut are written over or never read)."""
    runner = OrtFragmentRunner(model_dir, 0, 2, threads=1, flavour=flavour, max_context=64,
                               prefill_chunk=8 if flavour == "static" else None, cache_dir=tmp_path)
    rng = np.random.default_rng(5)
    old, new = rng.integers(3, 90, size=30), rng.integers(3, 90, size=24)
    new[:12] = old[:12]
    runner.open_session("fresh")
    expected = runner.forward("fresh", new[None, :])
    runner.open_session("finished")
    runner.forward("finished", old[None, :])
    runner.open_session("other")  # another row in between, untouched
    runner.forward("other", old[None, :5])
    runner.adopt_session("finished", "reused", 12)
    assert "finished" not in runner.sessions() and runner.session_length("reused") == 12
    np.testing.assert_allclose(runner.forward("reused", new[None, 12:]), expected[:, 12:], atol=1e-4, rtol=0)
    assert runner.session_length("other") == 5
    with pytest.raises(RunnerError):
        runner.adopt_session("reused", "more", 40)  # longer than it holds
    with pytest.raises(RunnerError):
        runner.adopt_session("gone", "more", 1)
    runner.close()
