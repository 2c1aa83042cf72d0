"""Speculative decoding: drafts verified by the model in one step, read from the context
itself or proposed by a smaller model.

A model's answer often repeats what its context holds (a summary quotes its text, code edits
copy the code, a tool call repeats a name, JSON repeats its keys). :class:`PromptLookup` finds
the latest earlier place where the context's last few tokens occurred and proposes the tokens
that followed there: no draft model, no cost but a dictionary lookup per step.
:class:`DraftModel` runs a smaller model with the same vocabulary (a 4-bit store of the served
model, a smaller sibling) where the request is sampled and proposes its greedy tokens, for any
text. The model then reads the last token and the draft in one step and the sampler walks its
rows in order: row i samples as a plain step would after the tokens accepted so far, and the
draft goes on only while the sampled token is the drafted one. Every token returned is one the
sampler chose, so greedy output is the same as without drafts, and sampled output keeps its
distribution (a drafted token is kept with its own probability, and a rejected one's row
samples from the rest: speculative sampling with a draft that is sure of itself).
:func:`verify` is that walk.

:class:`DraftLength` adapts how many tokens to draft to how many were kept, and stops drafting
for a while where drafts keep failing, so a text with nothing to copy costs only the steps
that found out.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from shards.runtime.chain import chain_forward
from shards.runtime.generate import DEFAULT_PREFILL_CHUNK_TOKENS, chain_context_tokens
from shards.runtime.runner import FragmentRunner

MAX_NGRAM = 3  # the longest suffix looked up; a shorter one is tried when it is not found
MIN_NGRAM = 2  # a suffix this short is still specific enough to copy after (one token is not)
# A draft model's token less likely than this ends its draft: its probability among its DRAFT_TOP_K
# likeliest, as llama.cpp's draft sampler counts it (--draft-p-min). Not llama.cpp's 0.75: a small
# model is seldom that sure and still right; SmolLM2's q4 store drafting for its f32 one had 35 of
# 96 tokens drafted at 0.75 and 86 (85 kept) at 0.2, as many as with no floor.
DRAFT_P_MIN = 0.2
DRAFT_TOP_K = 10
KEPT_DRAFT_SESSIONS = 4  # a draft model's caches of finished requests kept for the next ones


class PromptLookup:
    """The context's tokens, indexed by n-gram, for drafts (:meth:`draft`)."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        # n -> n-gram -> the position of the token that followed its latest occurrence
        self._follows: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(MIN_NGRAM, MAX_NGRAM + 1)}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            position = len(self.tokens)
            self.tokens.append(int(token))
            for n, follows in self._follows.items():
                if position >= n:
                    follows[tuple(self.tokens[position - n:position])] = position

    def draft(self, count: int) -> tuple[int, ...]:
        """Up to ``count`` tokens that followed the latest earlier occurrence of the context's
        last tokens (the longest suffix found, of :data:`MAX_NGRAM` down to :data:`MIN_NGRAM`);
        () when none occurred before."""
        if count <= 0:
            return ()
        end = len(self.tokens)
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if end < n:
                continue
            position = self._follows[n].get(tuple(self.tokens[end - n:]))
            if position is not None:
                return tuple(self.tokens[position:position + count])
        return ()



def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _top_probability(logits: np.ndarray) -> float:
    """The likeliest token's probability among the :data:`DRAFT_TOP_K` likeliest."""
    k = min(DRAFT_TOP_K, logits.size)
    top = np.partition(logits, -k)[-k:]
    return 1.0 / float(np.exp(top - top.max()).sum())


class DraftModel:
    """A smaller model's greedy drafts (:meth:`draft`), run on ``runners`` (a whole model, head
    to tail). Each request drafts in a session of its own (:meth:`session`) whose KV cache
    follows the request's context: the positions of drafted tokens that were not kept are cut
    before the next draft, and only what the cache lacks is read. A finished request's session
    is kept (:meth:`release`, the :data:`KEPT_DRAFT_SESSIONS` latest) for a next request that
    begins the same way, as the stages keep the served model's. A draft stops at a token the
    model gives less than ``p_min`` among its :data:`DRAFT_TOP_K` likeliest (a guess that would
    be rejected costs a draft step and a verified row). Thread-safe: drafts run on a worker
    thread, one at a time."""

    def __init__(self, runners: Sequence[FragmentRunner], *, p_min: float = DRAFT_P_MIN,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK_TOKENS, kept_sessions: int = KEPT_DRAFT_SESSIONS) -> None:
        if not runners or not runners[0].is_head or not runners[-1].is_tail:
            raise ValueError("a draft model runs a whole model, head to tail")
        self.runners = list(runners)
        self.max_context = chain_context_tokens(self.runners)
        self.p_min = p_min
        self.prefill_chunk = prefill_chunk
        self.kept_sessions = kept_sessions
        self._held: dict[str, list[int]] = {}  # session -> the tokens whose KV it holds
        self._kept: OrderedDict[str, None] = OrderedDict()  # finished requests' sessions, oldest first
        self._lock = threading.Lock()

    def session(self, context: Sequence[int]) -> str:
        """A session for a request whose context is ``context``: the kept one that holds the
        longest part of it, else a new one."""
        with self._lock:
            best = max(self._kept, key=lambda sid: _common_prefix(self._held[sid], context), default=None)
            if best is not None and _common_prefix(self._held[best], context) > 0:
                del self._kept[best]
                return best
            sid = uuid.uuid4().hex
            self._held[sid] = []
            return sid

    def release(self, session_id: str) -> None:
        """The request of ``session_id`` ended: keep its cache for the next, closing the oldest
        kept beyond :attr:`kept_sessions`."""
        with self._lock:
            if session_id not in self._held:
                return
            self._kept[session_id] = None
            while len(self._kept) > self.kept_sessions:
                self._close(self._kept.popitem(last=False)[0])

    def draft(self, session_id: str, context: Sequence[int], count: int, p_min: float | None = None,
              stop: Callable[[Sequence[int]], bool] | None = None) -> tuple[int, ...]:
        """Up to ``count`` tokens the model would choose greedily after ``context``, ended
        early at one it gives less than ``p_min`` (None: :attr:`p_min`) or once ``stop`` (asked
        after each token, with the tokens so far) is true; () where the context leaves no room."""
        p_min = self.p_min if p_min is None else p_min
        with self._lock:
            held = self._held[session_id]
            if count <= 0 or not context or (self.max_context is not None and len(context) + count > self.max_context):
                return ()
            keep = min(_common_prefix(held, context), len(context) - 1)  # the last token is read again for its logits
            if keep < len(held):
                self._cut(session_id, keep)
                del held[keep:]
            ids = np.asarray(context[keep:], dtype=np.int64)
            for start in range(0, len(ids), self.prefill_chunk):
                logits = chain_forward(self.runners, session_id, ids[None, start:start + self.prefill_chunk],
                                       last_only=True)[0, -1]
            held.extend(int(t) for t in ids)
            drafted: list[int] = []
            while True:
                token = int(np.argmax(logits))
                if p_min > 0.0 and _top_probability(logits) < p_min:
                    break
                drafted.append(token)
                if len(drafted) == count or (stop is not None and stop(drafted)):
                    break
                logits = chain_forward(self.runners, session_id, np.asarray([[token]], dtype=np.int64),
                                       last_only=True)[0, -1]
                held.append(token)
            return tuple(drafted)

    def memory_bytes(self) -> int:
        """Weights plus the live and kept sessions' KV caches, in bytes."""
        return sum(runner.memory_bytes() for runner in self.runners)

    def _cut(self, session_id: str, length: int) -> None:
        for runner in self.runners:
            if session_id not in runner.sessions():
                continue
            if length == 0:
                runner.close_session(session_id)
            else:
                runner.adopt_session(session_id, session_id, length)

    def _close(self, session_id: str) -> None:
        self._cut(session_id, 0)
        del self._held[session_id]

    def close(self) -> None:
        """Free every session and the runners."""
        with self._lock:
            for session_id in list(self._held):
                self._close(session_id)
            self._kept.clear()
            for runner in self.runners:
                runner.close()

def verify(sample: Callable[[np.ndarray], int], logits: np.ndarray, draft: Sequence[int]) -> list[int]:
    """The tokens a step chose: ``logits`` has a row per position, the step's last input token
    then each of ``draft`` (``len(draft) + 1`` rows); ``sample`` picks one token from a row,
    counting it as chosen. Row i is sampled while every token before it was the drafted one:
    the tokens returned are the drafted ones kept, then the one that differed (or the one after
    the whole draft)."""
    if logits.shape[0] != len(draft) + 1:
        raise ValueError(f"{len(draft)} drafted tokens need {len(draft) + 1} rows of logits, got {logits.shape[0]}")
    chosen = []
    for row, drafted in zip(logits, [*draft, None]):
        token = sample(row)
        chosen.append(token)
        if token != drafted:
            break
    return chosen


@dataclass
class DraftLength:
    """How many tokens to draft next: one more after a draft kept whole, one fewer after one
    rejected at its first token, none for :attr:`pause_steps` steps after :attr:`misses_to_pause`
    such rejections in a row."""

    most: int
    least: int = 2
    misses_to_pause: int = 4
    pause_steps: int = 32
    current: int = field(init=False)
    _misses: int = field(default=0, init=False)
    _paused_for: int = field(default=0, init=False)
    drafted: int = field(default=0, init=False)  # tokens drafted so far
    kept: int = field(default=0, init=False)  # of them, kept

    def __post_init__(self) -> None:
        self.current = min(4, self.most)

    def next(self) -> int:
        """Tokens to draft at this step (0: a plain step)."""
        if self._paused_for > 0:
            self._paused_for -= 1
            return 0
        return self.current if self.most > 0 else 0

    def kept_of(self, drafted: int, kept: int) -> None:
        """A step verified ``drafted`` tokens and kept ``kept`` of them."""
        if drafted <= 0:
            return
        self.drafted += drafted
        self.kept += kept
        if kept == drafted:
            self.current, self._misses = min(self.current + 1, self.most), 0
        elif kept == 0:
            self.current = max(self.current - 1, min(self.least, self.most))
            self._misses += 1
            if self._misses >= self.misses_to_pause:
                self._misses, self._paused_for = 0, self.pause_steps
        else:
            self._misses = 0
