"""The FragmentRunner interface (shards.runtime.runner): the methods every backend writes, the
behaviour it gives those that write no more (a batch run row by row, no hand-over of a
session's cache, a description naming the provider, no fragment files), and the contract its
docstrings state, held by each runner there is: a small numpy runner written here on the
interface alone, onnxruntime's in its batching (cpu) and row-by-row (portable) flavours, and a
chain of two ranges run as one, on a tiny random model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shards.errors import RunnerError
from shards.importers.importer import import_model
from shards.runtime.chain import RunnerChain
from shards.runtime.ort_runner import OrtFragmentRunner
from shards.runtime.runner import FragmentRunner
from shards.store.model_store import ModelStore
from tests.examples import examples
from tests.shards.fragment_helpers import VOCAB, write_tiny_checkpoint

ABSTRACT = {"open_session", "forward", "session_length", "close_session", "sessions", "memory_bytes", "close"}


class NumpyRunner(FragmentRunner):
    """A whole one-layer model in numpy, written on the interface alone (no method it gives is
    overridden): position t's hidden state is its token's embedding plus the mean of the states
    the session cached before it, its logits that state times an output matrix."""

    def __init__(self, vocab: int = 11, hidden: int = 4, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.table = rng.normal(size=(vocab, hidden)).astype(np.float32)
        self.output = rng.normal(size=(hidden, vocab)).astype(np.float32)
        self.first_layer = self.last_layer = 0
        self.is_head = self.is_tail = True
        self.provider = "numpy"
        self.max_context = 64
        self._cache: dict[str, list[np.ndarray]] = {}

    def open_session(self, session_id: str) -> None:
        if session_id in self._cache:
            raise RunnerError(f"session {session_id!r} is already open")
        self._cache[session_id] = []

    def _get(self, session_id: str) -> list[np.ndarray]:
        if session_id not in self._cache:
            raise RunnerError(f"unknown session {session_id!r}")
        return self._cache[session_id]

    def forward(self, session_id: str, x: np.ndarray, *, last_only: bool = False, hidden: bool = False) -> np.ndarray:
        cache = self._get(session_id)
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[0] != 1 or not np.issubdtype(x.dtype, np.integer):
            raise RunnerError(f"token ids [1, T] wanted, got {x.shape}")
        if len(cache) + x.shape[1] > self.max_context:
            raise RunnerError("context overflow")
        states = []
        for token in x[0]:
            state = self.table[token] + (np.mean(cache, axis=0) if cache else 0)
            cache.append(state)
            states.append(state)
        out = np.stack(states)[None]
        if last_only:
            out = out[:, -1:]
        return out if hidden else out @ self.output

    def session_length(self, session_id: str) -> int:
        return len(self._get(session_id))

    def close_session(self, session_id: str) -> None:
        self._get(session_id)
        del self._cache[session_id]

    def sessions(self) -> list[str]:
        return list(self._cache)

    def memory_bytes(self) -> int:
        return self.table.nbytes + self.output.nbytes + sum(len(c) for c in self._cache.values()) * 16

    def close(self) -> None:
        self._cache.clear()


# --- the interface ---------------------------------------------------------------------------

def test_the_interface_names_the_methods_every_backend_must_write() -> None:
    assert FragmentRunner.__abstractmethods__ == ABSTRACT
    with pytest.raises(TypeError):
        FragmentRunner()  # type: ignore[abstract]


@pytest.mark.parametrize("missing", sorted(ABSTRACT))
def test_a_runner_that_leaves_out_any_of_them_cannot_be_made(missing: str) -> None:
    methods = {name: getattr(NumpyRunner, name) for name in ABSTRACT - {missing}} | {"__init__": NumpyRunner.__init__}
    partial = type("Partial", (FragmentRunner,), methods)
    with pytest.raises(TypeError, match=missing):
        partial()


def test_a_runner_that_writes_no_more_describes_its_provider_and_opened_no_files() -> None:
    runner = NumpyRunner()
    assert runner.describe() == {"provider": "numpy"}
    assert runner.builds() == []


def test_a_runner_that_writes_no_more_cannot_hand_a_sessions_cache_over() -> None:
    runner = NumpyRunner()
    runner.open_session("cached")
    runner.forward("cached", np.array([[1, 2, 3]]))
    with pytest.raises(RunnerError, match="NumpyRunner cannot hand a session's cache over"):
        runner.adopt_session("cached", "new", 2)
    assert runner.sessions() == ["cached"] and runner.session_length("cached") == 3


@pytest.mark.parametrize(("sessions", "rows"), [(["a", "a"], 2), (["a", "b"], 1), (["a", "b"], 3), (["a"], 2)])
def test_a_batch_needs_one_row_per_distinct_session(sessions: list[str], rows: int) -> None:
    runner = NumpyRunner()
    for sid in ("a", "b"):
        runner.open_session(sid)
    with pytest.raises(RunnerError, match=f"one row per distinct session, got {rows} rows for {len(sessions)}"):
        runner.forward_batch(sessions, np.ones((rows, 1), np.int64))
    assert runner.session_length("a") == runner.session_length("b") == 0  # refused before any row ran


@settings(max_examples=examples(100), deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 10), min_size=1, max_size=5), min_size=1, max_size=5),
       steps=st.lists(st.tuples(st.permutations(range(5)), st.integers(1, 5),
                                st.lists(st.integers(0, 10), min_size=5, max_size=5)), max_size=4))
def test_a_batch_runs_row_by_row_as_each_sessions_own_steps(prompts: list[list[int]], steps) -> None:
    """Whatever the order of its rows, a batch step gives each session what its own step would
    give, and moves each on by one position."""
    batched, alone = NumpyRunner(), NumpyRunner()
    sids = [f"s{i}" for i in range(len(prompts))]
    for runner in (batched, alone):
        for sid, prompt in zip(sids, prompts):
            runner.open_session(sid)
            runner.forward(sid, np.array([prompt]))
    for order, size, tokens in steps:
        chosen = [sids[i] for i in order if i < len(sids)][:size]
        ids = np.array(tokens[:len(chosen)])[:, None]
        out = batched.forward_batch(chosen, ids)
        expected = np.concatenate([alone.forward(sid, ids[i:i + 1]) for i, sid in enumerate(chosen)])
        np.testing.assert_array_equal(out, expected)
    assert [batched.session_length(s) for s in sids] == [alone.session_length(s) for s in sids]


# --- the contract, held by every runner --------------------------------------------------------

LAYERS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runner")
    store = ModelStore(root / "home")
    import_model(write_tiny_checkpoint(root / "checkpoint", layers=LAYERS), name="tiny", store=store, progress=False)
    return store.model_dir("tiny")


def open_runner(kind: str, model_dir: Path) -> FragmentRunner:
    cache = model_dir.parent.parent / "fragments"
    if kind == "numpy":
        return NumpyRunner(vocab=VOCAB)
    if kind == "chain":
        return RunnerChain([OrtFragmentRunner(model_dir, 0, 0, threads=1, cache_dir=cache),
                            OrtFragmentRunner(model_dir, 1, LAYERS - 1, threads=1, cache_dir=cache)])
    return OrtFragmentRunner(model_dir, 0, LAYERS - 1, threads=1, flavour=kind, cache_dir=cache)


KINDS = ["numpy", "cpu", "portable", "chain"]


@pytest.fixture(params=KINDS)
def runner(request: pytest.FixtureRequest, model_dir: Path):
    opened = open_runner(request.param, model_dir)
    yield opened
    opened.close()


def test_a_runner_says_where_it_sits_and_what_it_runs_on(runner: FragmentRunner) -> None:
    assert runner.is_head and runner.is_tail and runner.first_layer == 0
    assert runner.last_layer == (0 if isinstance(runner, NumpyRunner) else LAYERS - 1)
    assert runner.describe()["provider"] == runner.provider and runner.max_context > 0
    assert all(path.is_file() for path in runner.builds())


def test_a_session_opens_once_and_every_use_of_an_unknown_one_is_refused(runner: FragmentRunner) -> None:
    runner.open_session("a")
    with pytest.raises(RunnerError):
        runner.open_session("a")
    for use in (lambda: runner.session_length("b"), lambda: runner.close_session("b"),
                lambda: runner.forward("b", np.array([[1]]))):
        with pytest.raises(RunnerError):
            use()
    assert runner.sessions() == ["a"]


def test_forward_appends_its_positions_and_returns_one_row_each(runner: FragmentRunner) -> None:
    base = runner.memory_bytes()
    runner.open_session("a")
    first = runner.forward("a", np.array([[5, 6, 7]]))
    assert first.shape == (1, 3, VOCAB) and first.dtype == np.float32 and runner.session_length("a") == 3
    step = runner.forward("a", np.array([[8]]))
    assert step.shape == (1, 1, VOCAB) and runner.session_length("a") == 4
    assert runner.memory_bytes() > base
    runner.close_session("a")
    assert runner.sessions() == [] and runner.memory_bytes() == base


def test_last_only_gives_the_last_positions_logits_and_hidden_the_states_before_them(runner: FragmentRunner) -> None:
    prompt = np.array([[3, 9, 4, 1]])
    for sid in ("whole", "last", "hidden"):
        runner.open_session(sid)
    whole = runner.forward("whole", prompt)
    last = runner.forward("last", prompt, last_only=True)
    states = runner.forward("hidden", prompt, hidden=True)
    assert last.shape == (1, 1, VOCAB) and states.ndim == 3 and states.shape[:2] == (1, 4)
    np.testing.assert_allclose(last[0, 0], whole[0, -1], atol=1e-5, rtol=0)
    assert runner.session_length("last") == runner.session_length("hidden") == 4  # every position is cached


def test_a_decode_step_of_several_sessions_gives_each_its_own_logits(runner: FragmentRunner, model_dir: Path) -> None:
    alone = open_runner("numpy" if isinstance(runner, NumpyRunner) else "portable", model_dir)
    try:
        for sid, prompt in (("a", [4, 5, 6]), ("b", [7]), ("c", [8, 9])):
            for r in (runner, alone):
                r.open_session(sid)
                r.forward(sid, np.array([prompt]))
        order, ids = ["c", "a", "b"], np.array([[10], [11], [12]])
        expected = np.concatenate([alone.forward(sid, ids[i:i + 1]) for i, sid in enumerate(order)])
        np.testing.assert_allclose(runner.forward_batch(order, ids), expected, atol=1e-4, rtol=0)
        assert [runner.session_length(s) for s in ("a", "b", "c")] == [4, 2, 3]
    finally:
        alone.close()


def test_a_portable_runner_batches_with_the_interfaces_row_by_row_steps(model_dir: Path) -> None:
    """onnxruntime's portable flavour keeps no pool of caches: its batch is the interface's."""
    runner = open_runner("portable", model_dir)
    try:
        for sid in ("x", "y"):
            runner.open_session(sid)
        with pytest.raises(RunnerError, match="one row per distinct session"):
            runner.forward_batch(["x", "x"], np.array([[1], [2]]))
        assert runner.session_length("x") == 0
    finally:
        runner.close()


def test_a_refused_batch_moves_no_session_on(model_dir: Path) -> None:
    runner = OrtFragmentRunner(model_dir, 0, LAYERS - 1, threads=1, flavour="portable", max_context=8,
                               cache_dir=model_dir.parent.parent / "fragments")
    try:
        runner.open_session("short")
        runner.open_session("full")
        runner.forward("full", np.arange(3, 11)[None, :])
        with pytest.raises(RunnerError, match="context overflow"):
            runner.forward_batch(["short", "full"], np.array([[5], [6]]))
        assert runner.session_length("short") == 0
    finally:
        runner.close()


def test_an_empty_batch_is_refused_as_a_runner_error() -> None:
    with pytest.raises(RunnerError):
        NumpyRunner().forward_batch([], np.zeros((0, 1), np.int64))


def test_close_lets_go_of_every_session(runner: FragmentRunner) -> None:
    for sid in ("a", "b"):
        runner.open_session(sid)
        runner.forward(sid, np.array([[2, 3]]))
    runner.close()
    assert runner.sessions() == []


def test_a_runner_that_writes_no_more_reads_prompts_one_by_one_each_to_its_own_length() -> None:
    batched, alone = NumpyRunner(), NumpyRunner()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    x = np.zeros((3, 4), np.int64)
    for i, prompt in enumerate(prompts):
        x[i, :len(prompt)] = prompt
        for runner in (batched, alone):
            runner.open_session(f"s{i}")
    assert not batched.reads_prompts_together(["s0", "s1", "s2"])
    out = batched.forward_prompts(["s0", "s1", "s2"], x, [3, 2, 4])
    for i, prompt in enumerate(prompts):
        np.testing.assert_array_equal(out[i:i + 1], alone.forward(f"s{i}", np.array([prompt]), last_only=True))
        assert batched.session_length(f"s{i}") == len(prompt)


@pytest.mark.parametrize("lengths", [[3, 4], [4, 4, 4, 4], [0, 4, 2], [3, 2, 5], [3, 2, 3]])
def test_prompts_need_one_length_per_row_the_longest_filling_it(lengths: list[int]) -> None:
    runner = NumpyRunner()
    for sid in ("a", "b", "c"):
        runner.open_session(sid)
    with pytest.raises(RunnerError, match="one row and one length"):
        runner.forward_prompts(["a", "b", "c"], np.ones((3, 4), np.int64), lengths)
    assert runner.session_length("a") == runner.session_length("b") == runner.session_length("c") == 0
