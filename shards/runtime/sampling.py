"""Choosing the next token from logits: greedy, temperature, top-k, top-p, seeded.

Pure numpy, no model knowledge: :class:`SamplingParams` says how to choose and when to stop
(``max_tokens``, ``stop`` strings; end-of-generation ids come from the model's tokenizer),
:class:`Sampler` makes the choice for one row of logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from shards.errors import SamplingError

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_TOKENS_LIMIT = 1 << 20
MAX_TEMPERATURE = 100.0


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy (argmax); top_k 0 means no top-k cut; top_p 1.0 means no
    nucleus cut; seed None means a fresh random seed; stop strings are never emitted.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float, np.floating)):
            raise SamplingError(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplingError(f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {self.temperature!r}")
        object.__setattr__(self, "temperature", float(self.temperature))
        if not _is_int(self.top_k) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        object.__setattr__(self, "top_k", int(self.top_k))
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float, np.floating)) \
                or not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "top_p", float(self.top_p))
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise SamplingError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise SamplingError(f"max_tokens must be an integer in [1, {MAX_TOKENS_LIMIT}], got {self.max_tokens!r}")
        object.__setattr__(self, "max_tokens", int(self.max_tokens))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = ()
        try:
            stop = tuple(stop)
        except TypeError:
            raise SamplingError(f"stop must be a string or a list of strings, got {self.stop!r}") from None
        if len(stop) > MAX_STOP_STRINGS:
            raise SamplingError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        for item in stop:
            if not isinstance(item, str) or not item:
                raise SamplingError(f"stop strings must be non-empty strings, got {item!r}")
            if len(item) > MAX_STOP_STRING_CHARS:
                raise SamplingError(f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters long")
        object.__setattr__(self, "stop", tuple(dict.fromkeys(stop)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """Picks one token id per row of logits according to :class:`SamplingParams`.

    A seeded sampler fed the same logits returns the same ids in the same order.
    """

    def __init__(self, params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise SamplingError(f"Sampler needs SamplingParams, got {type(params).__name__}")
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def allowed(self, logits: np.ndarray) -> np.ndarray:
        """Ids the params allow for these logits (best first) and their probabilities."""
        return self._candidates(self._check(logits))[0]

    def sample(self, logits: np.ndarray) -> int:
        """The next token id for one row of logits (shape ``[vocab]``)."""
        row = self._check(logits)
        if self.params.greedy:
            return int(np.argmax(row))
        ids, probs = self._candidates(row)
        if len(ids) == 1:
            return int(ids[0])
        cumulative = np.cumsum(probs)
        pick = int(np.searchsorted(cumulative, self._rng.random() * cumulative[-1], side="right"))
        return int(ids[min(pick, len(ids) - 1)])

    @staticmethod
    def _check(logits: np.ndarray) -> np.ndarray:
        row = np.asarray(logits)
        if row.ndim == 2 and row.shape[0] == 1:
            row = row[0]
        if row.ndim != 1 or row.size == 0:
            raise SamplingError(f"logits must be one row [vocab], got shape {row.shape}")
        if np.isnan(row).any():
            raise SamplingError("logits hold NaN")
        if not np.isfinite(row).any() and not (row == np.inf).any():
            raise SamplingError("logits are all -inf: no token can be chosen")
        return row

    def _candidates(self, row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Allowed ids (descending logit, ties by id) and their renormalised probabilities."""
        p = self.params
        if p.greedy:
            best = int(np.argmax(row))
            return np.array([best]), np.array([1.0])
        scores = row.astype(np.float64)
        if (scores == np.inf).any():  # +inf dominates: only those tokens are possible
            scores = np.where(scores == np.inf, 0.0, -np.inf)
        with np.errstate(over="ignore"):  # a tiny temperature leaves only the best tokens
            scores = (scores - scores[np.isfinite(scores)].max()) / p.temperature
        vocab = scores.size
        if 0 < p.top_k < vocab:
            # the k best by (logit desc, id asc): partition on the value, then sort the few
            kth = np.partition(scores, vocab - p.top_k)[vocab - p.top_k]
            pool = np.flatnonzero(scores >= kth)
        else:
            pool = np.arange(vocab)
        pool = pool[np.isfinite(scores[pool])]
        order = pool[np.lexsort((pool, -scores[pool]))]
        if 0 < p.top_k < order.size:
            order = order[:p.top_k]
        logits_kept = scores[order]
        probs = np.exp(logits_kept - logits_kept[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            cumulative = np.cumsum(probs)
            keep = int(np.searchsorted(cumulative, p.top_p, side="left")) + 1
            order, probs = order[:keep], probs[:keep]
            probs = probs / probs.sum()
        return order, probs


__all__ = ["SamplingParams", "Sampler"]
