"""A worker's compute queue: steps run one call at a time on the worker's compute thread, and
the decode steps (one position each) of different sessions on the same fragment that wait
while that thread is busy run together as one batched call.

Batches form by themselves: the steps that arrive while the thread is busy run together next.
Only one thing waits: when the first decode step of a new round is due while sessions of the
fragment's previous batch (still open) have not sent theirs, it waits for them up to
:data:`GATHER_S` from when it could run (it arrived and the thread was free), and never
longer than :data:`GATHER_SHARE` of that batch's compute time, so a round does not split
into one step alone and the rest after it (the sessions come back together, a round trip of
the chain later), two groups of streams whose steps arrive while the other's batch runs do
not take turns for ever (each waits for the other once, and they run as one batch from then
on), and a session that stalls (its client reads slowly) costs the others little. A step
whose session is out of step, or whose batch fails, gets its own error: the other rows run
alone. A lone stream's quick decode steps run on the event loop itself
(:meth:`StepBatcher._inline`).

A prompt never stalls decoding streams: while decode steps run on this worker (queued, or one
ran within :data:`DECODE_RECENT_S`), a prompt's step is read in slices, each sized to take
about ``slice_share`` times as long as the last decode batch (from the seconds per
position its fragment's recent slices took, at least :data:`MIN_SLICE_TOKENS`), and the decode
steps queued when a slice ends run before the next slice. Prompts are read one after the
other (the rest of a sliced one goes back ahead of those that came after it), so each first
token comes as early as it can. A stream's gap between tokens is then a decode batch and a
slice, not a whole prompt; a prompt read alone runs whole, and so does one that two slices
would read (a short one: the slice's extra weight read would cost its own first token, and
the streams' total, more than the gap it saves them). (Each slice is a call of its own
that reads the fragment's weights again: on a CPU, where that is most of a decode step, a
share of 1 reads the prompt 3x slower than alone, 2 about 2x, 4 hardly slower, for gaps of
about 2, 3 and 4-5 decode batches.)

Prompts into empty caches that are read whole (nothing decodes beside them, or together they
are as short as two slices) are read as one call when several are queued for a fragment,
padded to the longest (at most :data:`PROMPT_SPREAD_TOKENS` apart): one weight read for all,
as llama.cpp's server reads the prompts that arrive together. A prompt read in slices is read
alone, so the streams beside it keep their gaps (a batch of prompts cannot be sliced: the
fused attention reads several positions of several rows only into empty caches).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from agent.dataplane.links import StageError
from shards.errors import ShardsError
from shards.runtime.runner import FragmentRunner

log = logging.getLogger(__name__)
MAX_BATCH_ROWS = 32  # decode steps one call runs at most
GATHER_S = 0.003  # how long a decode step waits for the rest of its fragment's previous batch
GATHER_SHARE = 0.25  # ... and never more than this share of that batch's compute time
INLINE_DECODE_S = 0.05  # a lone stream's decode step runs on the event loop when its fragment's last one took less
DECODE_RECENT_S = 0.25  # a decode batch ran this recently: prompts are read in slices between decode batches
MIN_SLICE_TOKENS = 8  # a slice of a prompt reads at least this many positions
FIRST_SLICE_TOKENS = 32  # ... and this many before the fragment's time per position is known
PROMPT_BATCH_TOKENS = 1024  # prompts read together: at most this many positions, padding included
PROMPT_SPREAD_TOKENS = 32  # ... each at most this much shorter or longer than the first


@dataclass
class _Pending:
    runner: FragmentRunner
    sid: str
    start: int  # the position the step starts at
    x: np.ndarray
    future: asyncio.Future[np.ndarray] = field(repr=False)
    arrived_s: float = 0.0  # event-loop time
    reuse: str | None = None  # a kept session whose cache this one takes over (see _prepare)
    hidden: bool = False  # a tail's step that returns the final hidden states (an embedding), never batched
    rows: int = 1  # a tail's rows of logits wanted, the last ones (a speculative step's: one per drafted token, +1)
    done: int = 0  # positions read by earlier slices
    pieces: list[np.ndarray] = field(default_factory=list, repr=False)  # a non-tail's outputs of earlier slices

    @property
    def decode(self) -> bool:
        return self.x.shape[1] == 1 and not self.hidden

    @property
    def fresh_prompt(self) -> bool:
        """A prompt's step into an empty cache, not begun: one that can be read with others."""
        return (not self.decode and not self.hidden and self.rows == 1 and self.start == 0 and self.reuse is None
                and self.done == 0)

    @property
    def left(self) -> int:
        """Positions not read yet."""
        return self.x.shape[1] - self.done

    @property
    def sliceable(self) -> bool:
        """A prompt's step, long enough to read in slices (a speculative step is short and needs
        its rows whole)."""
        return self.rows == 1 and self.left > MIN_SLICE_TOKENS

    def step(self, tokens: int) -> tuple[str, int, np.ndarray, str | None, bool, int]:
        """The arguments of :func:`run_batch` for its next ``tokens`` positions (all that are
        left when fewer): only the first slice takes the kept session over, only the last
        returns the hidden states or several rows."""
        end = min(self.done + tokens, self.x.shape[1])
        last = end == self.x.shape[1]
        return (self.sid, self.start + self.done, self.x[:, self.done:end], self.reuse if self.done == 0 else None,
                self.hidden and last, self.rows if last else 1)


def _prepare(runner: FragmentRunner, sid: str, start: int, reuse: str | None = None) -> None:
    """Open ``sid`` on ``runner`` where needed; a step from position 0 (a replay) starts its
    cache anew, one that ``reuse``s a kept session takes its cache over, cut to ``start``
    positions, and one that starts before the cache ends cuts it back there (positions a
    speculative step drafted and did not keep). StageError if the cache ends before the step
    starts, ``cache_miss`` when the kept session is not here (any more)."""
    if reuse is not None:
        if sid in runner.sessions():
            runner.close_session(sid)
        try:
            runner.adopt_session(reuse, sid, start)
        except ShardsError as error:
            if reuse in runner.sessions():
                runner.close_session(reuse)
            raise StageError("cache_miss", f"the kept session {reuse[:8]} cannot be reused here: {error}",
                             None) from None
        return
    if start == 0 and sid in runner.sessions():
        runner.close_session(sid)
    if sid not in runner.sessions():
        runner.open_session(sid)
    length = runner.session_length(sid)
    if 0 < start < length:
        runner.adopt_session(sid, sid, start)
        length = start
    if length != start:
        raise StageError("session_out_of_sync", f"session {sid} holds {length} positions, step starts at {start}", None)


def run_batch(runner: FragmentRunner, steps: list[tuple[str, int, np.ndarray, str | None, bool, int]]
              ) -> list[np.ndarray | BaseException]:
    """Run ``steps`` ((session, start, input, reused session, final hidden states wanted, rows
    of logits wanted) each: decode steps, or prompts into empty caches) on ``runner``: one
    batched call for the rows that are ready, each row alone if that call fails (or when the
    runner cannot read those prompts together). Per step its output or its error."""
    results: list[np.ndarray | BaseException | None] = [None] * len(steps)
    ready = []
    for index, (sid, start, _, reuse, _, _) in enumerate(steps):
        try:
            _prepare(runner, sid, start, reuse)
            ready.append(index)
        except (StageError, ShardsError) as error:
            results[index] = error
    if len(ready) > 1 and steps[ready[0]][2].shape[1] > 1:  # prompts: together when the runner can
        sids = [steps[i][0] for i in ready]
        if runner.reads_prompts_together(sids):
            lengths = [steps[i][2].shape[1] for i in ready]
            x = np.zeros((len(ready), max(lengths), *steps[ready[0]][2].shape[2:]), steps[ready[0]][2].dtype)
            for row, index in enumerate(ready):
                x[row, :lengths[row]] = steps[index][2][0]
            try:
                out = runner.forward_prompts(sids, x, lengths)
                for row, index in enumerate(ready):
                    results[index] = out[row:row + 1] if runner.is_tail else out[row:row + 1, :lengths[row]]
                ready = []
            except ShardsError as error:
                log.warning("%d prompts read together failed, reading them one by one: %s", len(ready), error)
    elif len(ready) > 1:
        try:
            out = runner.forward_batch([steps[i][0] for i in ready], np.concatenate([steps[i][2] for i in ready]))
            for row, index in enumerate(ready):
                results[index] = out[row:row + 1]
            ready = []
        except ShardsError as error:
            log.warning("a batch of %d steps failed, running them one by one: %s", len(ready), error)
    for index in ready:
        sid, _, x, _, hidden, rows = steps[index]
        try:  # a tail's step samples (or embeds) its last row, a speculative one its last ``rows``
            out = runner.forward(sid, x, last_only=rows == 1, hidden=hidden)
            results[index] = out[:, -rows:] if runner.is_tail and rows > 1 else out
        except (StageError, ShardsError) as error:
            results[index] = error
    return results  # type: ignore[return-value]


class StepBatcher:
    """Queues steps for the compute thread (``executor``, one worker), batches decode steps and
    reads prompts beside them in slices of about ``slice_share`` decode batches (0: whole)."""

    def __init__(self, executor: Executor, slice_share: float = 2.0) -> None:
        self.executor = executor
        self.slice_share = slice_share
        self._queue: deque[_Pending] = deque()
        self._busy = False
        # per fragment, the sessions of its last decode batch: the next round waits for them
        self._last_batch: weakref.WeakKeyDictionary[FragmentRunner, set[str]] = weakref.WeakKeyDictionary()
        self._last_compute_s: weakref.WeakKeyDictionary[FragmentRunner, float] = weakref.WeakKeyDictionary()
        self._timer: asyncio.TimerHandle | None = None
        self._freed_s = float("-inf")  # event-loop time the compute thread last finished a call
        # per fragment, the seconds per position of its recent prompt steps (an average)
        self._position_s: weakref.WeakKeyDictionary[FragmentRunner, float] = weakref.WeakKeyDictionary()
        self._decode_s = 0.0  # the compute time of the last decode batch (of any fragment)
        self._decoded_at_s = float("-inf")  # event-loop time it ended
        self.batches = 0  # calls that ran more than one step
        self.batched_steps = 0  # steps that ran in those calls

    async def compute(self, runner: FragmentRunner, sid: str, start: int, x: np.ndarray,
                      reuse: str | None = None, *, hidden: bool = False, rows: int = 1) -> np.ndarray:
        """Run ``x`` (positions from ``start`` on) through ``runner`` for session ``sid``
        (which takes over the cache of the kept session ``reuse`` first, when given); a tail
        returns the logits of the last ``rows`` positions, or with ``hidden`` the last row's
        final hidden states instead."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[np.ndarray] = loop.create_future()
        self._queue.append(_Pending(runner, sid, start, x, future, loop.time(), reuse, hidden, rows))
        self._next()
        return await future

    def _missing(self, runner: FragmentRunner) -> set[str]:
        """Sessions of ``runner``'s last decode batch, still open, with no step queued."""
        expected = self._last_batch.get(runner, set()) & set(runner.sessions())
        return expected - {p.sid for p in self._queue if p.runner is runner}

    def _wake(self) -> None:
        self._timer = None
        self._next()

    def _take(self, now_s: float) -> list[_Pending]:
        """The oldest step, and when it is a decode step every queued decode step of another
        session on the same fragment (up to :data:`MAX_BATCH_ROWS`); when it is a prompt into
        an empty cache that is read whole, the other such prompts queued for the fragment whose
        lengths are close to its own, as many as are read whole together (padding included;
        beside decode steps, as long as two slices; else up to :data:`PROMPT_BATCH_TOKENS`)."""
        first = self._queue.popleft()
        batch = [first]
        slice_size = self._slice_size(first.runner, now_s) if first.fresh_prompt else None
        budget = PROMPT_BATCH_TOKENS if slice_size is None else min(PROMPT_BATCH_TOKENS, 2 * slice_size)
        if not first.decode and not (first.fresh_prompt and first.left <= budget):
            return batch
        sids, longest = {first.sid}, first.left
        for pending in list(self._queue):
            if len(batch) >= MAX_BATCH_ROWS:
                break
            if pending.runner is not first.runner or pending.sid in sids:
                continue
            if first.decode:
                if not pending.decode:
                    continue
            elif (not pending.fresh_prompt or abs(pending.left - first.left) > PROMPT_SPREAD_TOKENS
                  or (len(batch) + 1) * max(longest, pending.left) > budget):
                continue
            longest = max(longest, pending.left)
            batch.append(pending)
            sids.add(pending.sid)
            self._queue.remove(pending)
        return batch

    def _next(self) -> None:
        while self._queue and self._queue[0].future.done():  # its caller left
            self._queue.popleft()
        if self._busy or not self._queue:
            return
        first, loop = self._queue[0], asyncio.get_running_loop()
        gather_s = min(GATHER_S, GATHER_SHARE * self._last_compute_s.get(first.runner, 0.0))
        wait_s = max(first.arrived_s, self._freed_s) + gather_s - loop.time()
        if first.decode and wait_s > 0 and self._missing(first.runner):
            if self._timer is None:
                self._timer = loop.call_later(wait_s, self._wake)
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch = [p for p in self._take(loop.time()) if not p.future.done()]
        if not batch:
            self._next()
            return
        self._busy = True
        if batch[0].decode:
            self._last_batch[batch[0].runner] = {p.sid for p in batch}
        if len(batch) > 1:
            self.batches += 1
            self.batched_steps += len(batch)
        started_s = loop.time()
        if len(batch) == 1:
            tokens = self._slice_tokens(batch[0], loop.time())
        else:  # decode steps: one each; prompts read together: whole
            tokens = max(p.left for p in batch)
        steps = [p.step(tokens) for p in batch]
        if self._inline(batch):
            try:
                results: list[np.ndarray | BaseException | None] = list(run_batch(batch[0].runner, steps))
            except Exception as error:  # noqa: BLE001 - a bug: the caller hears it
                results = [error]
            self._finish(batch, results, started_s, tokens)
            return
        work = loop.run_in_executor(self.executor, run_batch, batch[0].runner, steps)
        work.add_done_callback(lambda done: self._finish(batch, self._outcome(done, len(batch)), started_s, tokens))

    def _slice_size(self, runner: FragmentRunner, now_s: float) -> int | None:
        """Positions a slice of a prompt reads on ``runner`` now, or None when prompts run whole
        (no decode step runs beside them, or slicing is off)."""
        contended = now_s - self._decoded_at_s < DECODE_RECENT_S or any(p.decode for p in self._queue)
        if not contended or not self.slice_share:
            return None
        position_s = self._position_s.get(runner)
        return FIRST_SLICE_TOKENS if position_s is None else max(
            MIN_SLICE_TOKENS, int(self.slice_share * self._decode_s / max(position_s, 1e-9)))

    def _slice_tokens(self, pending: _Pending, now_s: float) -> int:
        """How many positions of ``pending`` run now: all of them, or a slice when decode steps
        run beside it (see the module's docstring)."""
        left = pending.left
        tokens = None if pending.decode or not pending.sliceable else self._slice_size(pending.runner, now_s)
        if tokens is None or (pending.done == 0 and left <= 2 * tokens):  # two slices: a weight read more for a
            return left  # gap of 2 decode batches
        return -(-left // -(-left // tokens))  # slices of one size: no small last one that costs a weight read

    def _inline(self, batch: list[_Pending]) -> bool:
        """Whether ``batch`` runs right here, on the event loop: a decode step of the only
        session its fragment holds (no other session's step could join its batch) whose last
        decode step took less than :data:`INLINE_DECODE_S` (the loop, which answers pings
        and requests, is held that long at most). Handing a small step to the compute thread
        and back wakes two threads, a share of the step a stage of a pipeline feels."""
        first = batch[0]
        return (first.decode and len(batch) == 1
                and self._last_compute_s.get(first.runner, INLINE_DECODE_S) < INLINE_DECODE_S
                and set(first.runner.sessions()) <= {first.sid})

    @staticmethod
    def _outcome(done: asyncio.Future[list[np.ndarray | BaseException]], rows: int) -> list[np.ndarray | BaseException | None]:
        """Per step of a batch run on the compute thread, its output, error or None (cancelled)."""
        if done.cancelled():  # the executor shut down
            return [None] * rows
        if done.exception() is not None:  # a bug: every caller of the batch hears it
            return [done.exception()] * rows
        return list(done.result())

    def _finish(self, batch: list[_Pending], results: list[np.ndarray | BaseException | None], started_s: float,
                tokens: int) -> None:
        self._busy = False
        now_s = self._freed_s = asyncio.get_running_loop().time()
        first = batch[0]
        if first.decode:
            self._last_compute_s[first.runner] = self._decode_s = now_s - started_s
            self._decoded_at_s = now_s
        elif min(tokens, first.left) >= MIN_SLICE_TOKENS:  # a slice's (or the prompts') weights read and all
            measured_s = (now_s - started_s) / sum(min(tokens, p.left) for p in batch)
            known_s = self._position_s.get(first.runner, measured_s)
            self._position_s[first.runner] = (known_s + measured_s) / 2
        for pending, result in zip(batch, results):
            if pending.future.done():
                continue
            if result is None:
                pending.future.cancel()
            elif isinstance(result, BaseException):
                pending.future.set_exception(result)
            elif pending.done + tokens < pending.x.shape[1]:  # a slice: the rest after the decode steps queued now
                pending.done += tokens
                if not pending.runner.is_tail:
                    pending.pieces.append(result)
                self._requeue(pending)
            else:
                pending.future.set_result(np.concatenate([*pending.pieces, result], axis=1) if pending.pieces else result)
        self._next()

    def _requeue(self, pending: _Pending) -> None:
        """Put the rest of a sliced prompt back behind the decode steps queued now and ahead
        of the other steps, which all came after it: prompts are read one after the other,
        each first token as early as it can come, not all of them in turns."""
        decode = [p for p in self._queue if p.decode]
        others = [p for p in self._queue if not p.decode]
        self._queue.clear()
        self._queue.extend([*decode, pending, *others])

    def close(self) -> None:
        """Cancel the steps still queued (the agent is stopping)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._queue:
            self._queue.popleft().future.cancel()
