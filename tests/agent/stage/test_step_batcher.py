"""The worker's compute queue on a real fragment of the tiny model: decode steps that wait for
the compute thread run as one batch with each session's own output; a step out of step gets
its own error and the others still run; a prompt beside decoding streams is read in slices,
prompts queued together into empty caches as one call. Then on in-process agents:
concurrent greedy requests are batched at every stage and each gets the text it gets alone."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from agent.dataplane.links import StageError
from agent.http.app_keys import WORKER
from agent.stage.step_batcher import StepBatcher, run_batch
from shards.runtime.ort_runner import OrtFragmentRunner
from tests.agent.inprocess import call
from tests.agent.tiny import TINY, store_tiny_models, tiny_cluster


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return store_tiny_models(tmp_path_factory.mktemp("batcher")).model_dir(TINY)


def prompts(count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return [rng.integers(3, 90, size=(1, 2 + 3 * i)) for i in range(count)]


def test_waiting_decode_steps_run_as_one_batch_with_each_sessions_output(model_dir, tmp_path) -> None:
    runner = OrtFragmentRunner(model_dir, 0, 1, threads=1, cache_dir=tmp_path)
    alone = OrtFragmentRunner(model_dir, 0, 1, threads=1, cache_dir=tmp_path)
    starts = prompts(5)
    for i, ids in enumerate(starts):
        for r in (runner, alone):
            r.open_session(f"s{i}")
            r.forward(f"s{i}", ids)
    steps = np.arange(10, 15)[:, None]

    async def scenario() -> list[np.ndarray | BaseException]:
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = StepBatcher(executor)
            calls = [batcher.compute(runner, f"s{i}", ids.shape[1], steps[i:i + 1]) for i, ids in enumerate(starts)]
            calls.append(batcher.compute(runner, "s0", 0, starts[0]))  # a replay of s0: runs alone, after
            bad = batcher.compute(runner, "s3", 99, steps[3:4])  # out of step (s3 is stepped too)
            outputs = await asyncio.gather(*calls, bad, return_exceptions=True)
            # the first step ran alone (the thread was idle); the others waited and met
            assert (batcher.batches, batcher.batched_steps) == (1, 4)
            return outputs

    outputs = asyncio.run(scenario())
    for i, ids in enumerate(starts):
        np.testing.assert_allclose(outputs[i], alone.forward(f"s{i}", steps[i:i + 1]), atol=1e-4, rtol=0)
    assert isinstance(outputs[-1], StageError) and outputs[-1].code == "session_out_of_sync"
    alone.close_session("s0")
    alone.open_session("s0")
    # a tail's step gives the logits its sampling reads: the last position's
    np.testing.assert_allclose(outputs[5], alone.forward("s0", starts[0])[:, -1:], atol=1e-4, rtol=0)
    assert runner.session_length("s0") == starts[0].shape[1]


class SlowDevice(OrtFragmentRunner):
    """The tiny fragment on a device that takes 20 ms a call (a 1B-class model's decode)."""

    def forward(self, session_id, x, *, last_only=False, hidden=False):
        time.sleep(0.02)
        return super().forward(session_id, x, last_only=last_only, hidden=hidden)

    def forward_batch(self, session_ids, x):
        time.sleep(0.02)
        return super().forward_batch(session_ids, x)


def test_a_round_waits_briefly_for_the_rest_of_the_last_batch_and_not_for_a_stalled_session(model_dir, tmp_path) -> None:
    runner = SlowDevice(model_dir, 0, 1, threads=1, cache_dir=tmp_path)
    for sid in ("a", "b", "x"):
        runner.open_session(sid)

    async def scenario() -> None:
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = StepBatcher(executor)
            step = {"a": 0, "b": 0}

            def decode(sid: str) -> asyncio.Future:
                step[sid] += 1
                return asyncio.ensure_future(batcher.compute(runner, sid, step[sid] - 1, np.array([[5 + step[sid]]])))

            busy = asyncio.ensure_future(batcher.compute(runner, "x", 0, np.arange(3, 9)[None]))  # a prefill
            await asyncio.sleep(0)
            await asyncio.gather(busy, decode("a"), decode("b"))  # a and b waited for it: one batch
            assert batcher.batches == 1
            first = decode("a")  # the thread is idle, but b (of the last batch) has not come yet
            await asyncio.sleep(0)
            await asyncio.gather(first, decode("b"))
            assert batcher.batches == 2  # a waited the moment it took b to come
            await decode("a")  # b stalls: a waits no more than GATHER_S, then runs alone
            assert batcher.batches == 2 and runner.session_length("a") == 3

    asyncio.run(scenario())


class Recording(OrtFragmentRunner):
    """The tiny fragment, noting the thread each call runs on; ``delay_s`` more a call."""

    delay_s = 0.0

    def forward(self, session_id, x, *, last_only=False, hidden=False):
        self.threads.append(threading.get_ident())
        time.sleep(self.delay_s)
        return super().forward(session_id, x, last_only=last_only, hidden=hidden)


@pytest.mark.parametrize("case", ["lone quick stream", "slow device", "two sessions"])
def test_a_lone_streams_quick_decode_steps_run_on_the_event_loop_and_nothing_else_does(model_dir, tmp_path, case) -> None:
    runner = Recording(model_dir, 0, 1, threads=1, cache_dir=tmp_path)
    alone = OrtFragmentRunner(model_dir, 0, 1, threads=1, cache_dir=tmp_path)
    runner.threads, runner.delay_s = [], 0.06 if case == "slow device" else 0.0
    if case == "two sessions":
        runner.open_session("other")
    ids = prompts(1)[0]
    alone.open_session("a")
    expected = [alone.forward("a", ids, last_only=True), *(alone.forward("a", np.array([[t]])) for t in (7, 8, 9))]

    async def scenario() -> tuple[list[np.ndarray], int]:
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = StepBatcher(executor)
            outputs = [await batcher.compute(runner, "a", 0, ids)]
            for position, token in enumerate((7, 8, 9), start=ids.shape[1]):
                outputs.append(await batcher.compute(runner, "a", position, np.array([[token]])))
            return outputs, threading.get_ident()

    outputs, loop_thread = asyncio.run(scenario())
    for got, want in zip(outputs, expected):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    on_loop = [thread == loop_thread for thread in runner.threads]
    # the prefill and the first decode step (its time unknown yet) go to the compute thread
    assert on_loop == ([False, False, True, True] if case == "lone quick stream" else [False] * 4)


def test_concurrent_greedy_requests_are_batched_and_each_gets_its_own_text(tmp_path) -> None:
    questions = [f"w{7 + i} w{20 + 2 * i} w{40 + i}" for i in range(6)]

    async def ask(url: str, prompt: str) -> str:
        status, body = await call("POST", url + "/v1/completions",
                                  {"model": TINY, "prompt": prompt, "max_tokens": 24, "temperature": 0}, timeout_s=60)
        assert status == 200, body
        return body["choices"][0]["text"]

    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, layers=4, max_requests_in_flight=8) as (leader, others):
            alone = [await ask(leader.url, q) for q in questions]
            together = await asyncio.gather(*(ask(leader.url, q) for q in questions))
            assert together == alone
            batched = [a.app[WORKER].status()["batches"] for a in (leader, *others)]
            assert all(b["calls"] > 0 and b["steps"] >= 2 * b["calls"] for b in batched), batched

    asyncio.run(scenario())


def test_a_step_reusing_a_kept_session_takes_its_cache_or_misses_by_name(model_dir, tmp_path) -> None:
    runner = OrtFragmentRunner(model_dir, 0, 1, threads=1, cache_dir=tmp_path)
    ids = prompts(4)[3]  # 11 tokens
    runner.open_session("kept")
    expected = runner.forward("kept", ids)
    runner.open_session("late")  # a session of the reusing request that exists already goes
    results = run_batch(runner, [("new", 6, ids[:, 6:], "kept", False, 1), ("other", 0, ids[:, :2], "gone", False, 1)])
    np.testing.assert_allclose(results[0], expected[:, -1:], atol=1e-4, rtol=0)  # a tail: its last row
    assert isinstance(results[1], StageError) and results[1].code == "cache_miss"
    assert sorted(runner.sessions()) == ["late", "new"] and runner.session_length("new") == 11
    runner.close()


class Calls(OrtFragmentRunner):
    """A fragment that notes each call it runs: (session, positions) or ("batch", rows); each
    call takes at least ``compute_s`` (a larger model's step)."""

    compute_s = 0.0

    def forward(self, session_id, x, *, last_only=False, hidden=False):
        self.calls.append((session_id, x.shape[1]))
        time.sleep(self.compute_s)
        return super().forward(session_id, x, last_only=last_only, hidden=hidden)

    def forward_batch(self, session_ids, x):
        self.calls.append(("batch", len(session_ids)))
        time.sleep(self.compute_s)
        return super().forward_batch(session_ids, x)

    def forward_prompts(self, session_ids, x, lengths):
        self.calls.append(("prompts", tuple(lengths)))
        time.sleep(self.compute_s)
        return super().forward_prompts(session_ids, x, lengths)


async def decoding_streams(batcher: StepBatcher, runner: Calls, positions: range) -> list[asyncio.Task]:
    """Streams "a" and "b" decoding ``positions`` on ``runner``, once they run as one batch."""

    async def stream(sid: str) -> None:
        for position in positions:
            await batcher.compute(runner, sid, position, np.array([[7]]))

    streams = [asyncio.create_task(stream(sid)) for sid in ("a", "b")]
    deadline_s = asyncio.get_running_loop().time() + 60
    while ("batch", 2) not in runner.calls:  # both streams decode
        assert asyncio.get_running_loop().time() < deadline_s, runner.calls
        await asyncio.sleep(0.001)
    return streams


def test_two_streams_whose_steps_arrive_while_the_others_run_come_together_in_one_batch(model_dir,
                                                                                       tmp_path) -> None:
    """Stream b's first step arrives while a's runs; when a's ends, b's is due and a's next is
    one event-loop turn away: b waits for it (a session of the last batch) rather than run
    alone, and from then on the two run as one batch instead of taking turns."""
    runner = Calls(model_dir, 0, 1, threads=1, cache_dir=tmp_path)
    runner.calls, runner.compute_s = [], 0.01
    for sid in ("a", "b"):
        runner.open_session(sid)

    async def scenario() -> None:
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = StepBatcher(executor)

            async def stream(sid: str) -> None:
                for position in range(20):
                    await batcher.compute(runner, sid, position, np.array([[7]]))

            first = asyncio.create_task(stream("a"))
            deadline_s = asyncio.get_running_loop().time() + 60
            while not runner.calls:  # a's first step runs
                assert asyncio.get_running_loop().time() < deadline_s
                await asyncio.sleep(0.001)
            await asyncio.gather(first, stream("b"))

    asyncio.run(scenario())
    assert runner.calls[:2] == [("a", 1), ("batch", 2)], runner.calls
    assert runner.calls.count(("batch", 2)) >= 15, runner.calls  # together from then on (a slow moment may split one)


@pytest.mark.parametrize("last_layer", [0, 1], ids=["a head's hidden states", "a tail's logits"])
@pytest.mark.parametrize("share", [2.0, 0.0], ids=["sliced", "whole (prefill_share 0)"])
def test_a_prompt_beside_decoding_streams_is_read_in_slices_between_their_steps(model_dir, tmp_path, last_layer,
                                                                                 share) -> None:
    """While two streams decode, a 150-token prompt step (one of the ``kept`` session's, taken
    over from position 20) is read in slices with their batches between them and gives what it
    gives read whole; with prefill_share 0, or with no stream decoding, it is one call."""
    runner = Calls(model_dir, 0, last_layer, threads=1, cache_dir=tmp_path)
    alone = OrtFragmentRunner(model_dir, 0, last_layer, threads=1, cache_dir=tmp_path)
    runner.calls = []
    ids = np.random.default_rng(5).integers(3, 90, size=(1, 170))
    alone.open_session("p")
    expected = alone.forward("p", ids)[:, 20:]
    for sid in ("a", "b"):
        runner.open_session(sid)
        runner.forward(sid, ids[:, :5])
    runner.open_session("kept")
    runner.forward("kept", ids[:, :30])

    async def scenario() -> tuple[np.ndarray, np.ndarray]:
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = StepBatcher(executor, share)

            streams = await decoding_streams(batcher, runner, range(5, 45))
            read = await batcher.compute(runner, "p", 20, ids[:, 20:], "kept")
            await asyncio.gather(*streams)
            runner.calls.append(("quiet", 0))
            batcher._decoded_at_s = float("-inf")  # long after: nothing decodes beside the next prompt
            runner.open_session("q")
            alone_read = await batcher.compute(runner, "q", 0, ids[:, :150])
            return read, alone_read

    read, alone_read = asyncio.run(scenario())
    np.testing.assert_allclose(read, expected if last_layer == 0 else expected[:, -1:], atol=1e-4, rtol=0)
    assert runner.session_length("p") == 170 and "kept" not in runner.sessions()
    slices = [i for i, call in enumerate(runner.calls) if call[0] == "p"]
    assert sum(runner.calls[i][1] for i in slices) == 150
    if share:
        # more than one call (usually 3 or more: the slices after the first are sized from the last
        # decode batch's time, and one slow moment of a busy machine can make the rest one slice)
        assert len(slices) >= 2, runner.calls
        between = runner.calls[slices[0]:slices[-1]]
        decoded = sum(call[0] in ("batch", "a", "b") for call in between)
        assert decoded >= len(slices) - 1, runner.calls  # the streams' steps after each slice
    else:
        assert len(slices) == 1
    quiet = runner.calls[runner.calls.index(("quiet", 0)) + 1:]
    assert quiet == [("q", 150)]
    alone.open_session("q")
    whole = alone.forward("q", ids[:, :150])
    np.testing.assert_allclose(alone_read, whole if last_layer == 0 else whole[:, -1:], atol=1e-4, rtol=0)


def test_prompts_arriving_together_beside_decoding_streams_are_read_one_after_the_other(model_dir,
                                                                                        tmp_path) -> None:
    """Two prompts queued together while two streams decode: the first is read in slices with
    the streams' batches between them, and the second starts only when the first is read (its
    first token as early as it can come), not slice for slice in turns with it."""
    runner = Calls(model_dir, 0, 1, threads=1, cache_dir=tmp_path)
    runner.calls = []
    ids = np.random.default_rng(6).integers(3, 90, size=(1, 120))
    for sid in ("a", "b"):
        runner.open_session(sid)
        runner.forward(sid, ids[:, :5])
    for sid in ("p", "q"):
        runner.open_session(sid)

    async def scenario() -> None:
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = StepBatcher(executor)

            streams = await decoding_streams(batcher, runner, range(5, 105))
            await asyncio.gather(batcher.compute(runner, "p", 0, ids), batcher.compute(runner, "q", 0, ids))
            await asyncio.gather(*streams)

    asyncio.run(scenario())
    p_slices = [i for i, call in enumerate(runner.calls) if call[0] == "p"]
    q_slices = [i for i, call in enumerate(runner.calls) if call[0] == "q"]
    assert len(p_slices) >= 2 and max(p_slices) < min(q_slices), runner.calls
    assert sum(runner.calls[i][1] for i in p_slices) == sum(runner.calls[i][1] for i in q_slices) == 120
    decoded = sum(call[0] in ("batch", "a", "b") for call in runner.calls[p_slices[0]:p_slices[-1]])
    assert decoded >= len(p_slices) - 1, runner.calls


def test_a_prompt_two_slices_would_read_is_read_whole_beside_decoding_streams(model_dir, tmp_path) -> None:
    """A short prompt (here 40 positions, under two first slices of 32) is read in one call
    while streams decode: a second slice would read the weights once more, which costs its
    first token and the streams' total more than the gap it saves them."""
    runner = Calls(model_dir, 0, 1, threads=1, cache_dir=tmp_path)
    runner.calls = []
    ids = np.random.default_rng(7).integers(3, 90, size=(1, 40))
    for sid in ("a", "b", "p"):
        runner.open_session(sid)

    async def scenario() -> None:
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = StepBatcher(executor)

            streams = await decoding_streams(batcher, runner, range(40))
            await batcher.compute(runner, "p", 0, ids)
            await asyncio.gather(*streams)

    asyncio.run(scenario())
    assert [call for call in runner.calls if call[0] == "p"] == [("p", 40)]


def test_prompts_queued_together_while_nothing_decodes_are_read_in_one_call(model_dir, tmp_path) -> None:
    """Prompts into empty caches that queue while the compute thread reads another are read
    as one call, each getting what it gets read alone; one whose length is far from theirs,
    and one that takes a kept session's cache over, are read alone."""
    runner = Calls(model_dir, 0, 1, threads=1, cache_dir=tmp_path)
    alone = OrtFragmentRunner(model_dir, 0, 1, threads=1, cache_dir=tmp_path)
    runner.calls = []
    ids = np.random.default_rng(8).integers(3, 90, size=(1, 100))
    lengths = {"p": 30, "q": 25, "r": 40, "s": 90}
    runner.open_session("kept")
    runner.forward("kept", ids[:, :30])
    runner.calls.clear()

    async def scenario() -> list[np.ndarray]:
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = StepBatcher(executor)
            first = batcher.compute(runner, "w", 0, ids[:, :20])  # runs at once: the others queue behind it
            prompts = [batcher.compute(runner, sid, 0, ids[:, :n]) for sid, n in lengths.items()]
            reused = batcher.compute(runner, "t", 20, ids[:, 20:50], "kept")
            return await asyncio.gather(first, *prompts, reused)

    outputs = asyncio.run(scenario())
    assert runner.calls == [("w", 20), ("prompts", (30, 25, 40)), ("s", 90), ("t", 30)], runner.calls
    for (sid, n), out in zip(lengths.items(), outputs[1:]):
        alone.open_session(sid)
        np.testing.assert_allclose(out, alone.forward(sid, ids[:, :n], last_only=True), atol=1e-4, rtol=0)
        assert runner.session_length(sid) == n
    alone.open_session("t")
    np.testing.assert_allclose(outputs[-1], alone.forward("t", ids[:, :50], last_only=True), atol=1e-4, rtol=0)
