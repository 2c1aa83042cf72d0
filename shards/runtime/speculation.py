"""Speculative decoding by prompt lookup: drafts read from the context itself, verified by the
model in one step.

A model's answer often repeats what its context holds (a summary quotes its text, code edits
copy the code, a tool call repeats a name, JSON repeats its keys). :class:`PromptLookup` finds
the latest earlier place where the context's last few tokens occurred and proposes the tokens
that followed there: no draft model, no cost but a dictionary lookup per step. The model then
reads the last token and the draft in one step and the sampler walks its rows in order: row i
samples as a plain step would after the tokens accepted so far, and the draft goes on only
while the sampled token is the drafted one. Every token returned is one the sampler chose, so
greedy output is the same as without drafts, and sampled output keeps its distribution (a
drafted token is kept with its own probability, and a rejected one's row samples from the
rest: speculative sampling with a draft that is sure of itself). :func:`verify` is that walk.

:class:`DraftLength` adapts how many tokens to draft to how many were kept, and stops drafting
for a while where drafts keep failing, so a text with nothing to copy costs only the steps
that found out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

MAX_NGRAM = 3  # the longest suffix looked up; a shorter one is tried when it is not found
MIN_NGRAM = 2  # a suffix this short is still specific enough to copy after (one token is not)


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
