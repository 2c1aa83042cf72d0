"""Choosing the next token from logits: greedy, temperature, top-k, top-p, min-p, seeded,
with logit biases, repetition penalties and a grammar.

Pure numpy, no model knowledge: :class:`SamplingParams` says how to choose and when to stop
(``max_tokens``, ``stop`` strings; end-of-generation ids come from the model's tokenizer),
:class:`Sampler` makes the choice for one row of logits. The order is llama.cpp's: logit
bias, penalties, grammar, then top-k, top-p, min-p and temperature.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from shards.errors import SamplingError

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_TOKENS_LIMIT = 1 << 20
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0  # presence and frequency penalties, as OpenAI bounds them
MAX_REPEAT_PENALTY = 10.0
MAX_LOGIT_BIASES = 1024
MAX_LOGIT_BIAS = 100.0
MAX_TOP_LOGPROBS = 20  # as OpenAI bounds top_logprobs
DEFAULT_REPEAT_LAST_N = 64  # llama.cpp's and Ollama's window for the penalties


def _number(value: Any, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value) or not low <= value <= high:
        raise SamplingError(f"{name} must be a number between {low:g} and {high:g}, got {value!r}")
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass(frozen=True)
class TokenLogprobs:
    """A chosen token's log-probability under the model (the log-softmax of its logits, before
    any bias, penalty, grammar or temperature: what OpenAI reports) and the likeliest
    alternatives, best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy (argmax); top_k 0 means no top-k cut; top_p 1.0 means no
    nucleus cut; min_p 0 means no cut below a share of the best token's probability; seed
    None means a fresh random seed; stop strings are never emitted.

    The penalties (llama.cpp's): over the last ``repeat_last_n`` tokens of the context (-1:
    all of it, 0: none), a token seen there has its logit divided by ``repeat_penalty`` (or
    multiplied, when negative), lowered by ``presence_penalty`` once and by
    ``frequency_penalty`` per time it was seen. ``logit_bias`` adds to the logits of the ids
    it names (-100 bans a token). ``grammar``: llguidance grammar text the output must follow
    (see :mod:`shards.runtime.grammar`).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = DEFAULT_REPEAT_LAST_N
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str | None = None
    logprobs: int | None = None

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
        object.__setattr__(self, "min_p", _number(self.min_p, "min_p", 0.0, 1.0))
        object.__setattr__(self, "repeat_penalty", _number(self.repeat_penalty, "repeat_penalty", 0.0,
                                                           MAX_REPEAT_PENALTY))
        if self.repeat_penalty == 0.0:
            raise SamplingError("repeat_penalty must be above 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, _number(getattr(self, name), name, -MAX_PENALTY, MAX_PENALTY))
        if not _is_int(self.repeat_last_n) or self.repeat_last_n < -1:
            raise SamplingError(f"repeat_last_n must be an integer >= -1 (-1 = the whole context), "
                                f"got {self.repeat_last_n!r}")
        object.__setattr__(self, "repeat_last_n", int(self.repeat_last_n))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise SamplingError("grammar must be grammar text")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise SamplingError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] (the alternatives to "
                                f"report), got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether the penalties change anything (they need the recent tokens)."""
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                                            or self.frequency_penalty != 0.0)

    def wire(self) -> dict[str, Any]:
        """The fields the tail stage samples with, as plain values for a step frame (the
        stop conditions stay with whoever streams the text)."""
        fields = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "seed": self.seed,
                  "min_p": self.min_p}
        if self.penalised:
            fields.update(repeat_penalty=self.repeat_penalty, presence_penalty=self.presence_penalty,
                          frequency_penalty=self.frequency_penalty, repeat_last_n=self.repeat_last_n)
        if self.logit_bias:
            fields["logit_bias"] = [list(pair) for pair in self.logit_bias]
        if self.grammar is not None:
            fields["grammar"] = self.grammar
        if self.logprobs is not None:
            fields["logprobs"] = self.logprobs
        return fields


def _logprobs(row: np.ndarray, token: int, top_n: int) -> TokenLogprobs:
    scores = row.astype(np.float64)
    finite = scores[np.isfinite(scores)]
    peak = finite.max()
    log_total = peak + math.log(float(np.exp(finite - peak).sum()))
    top: tuple[tuple[int, float], ...] = ()
    if top_n:
        best = np.argpartition(-scores, min(top_n, scores.size - 1))[:top_n]
        best = best[np.lexsort((best, -scores[best]))]
        top = tuple((int(i), float(scores[i] - log_total)) for i in best)
    return TokenLogprobs(int(token), float(scores[token] - log_total), top)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """``{id: bias}`` or ``[[id, bias], ...]`` as sorted pairs (ids as ints, biases bounded)."""
    if value is None:
        return ()
    pairs = value.items() if isinstance(value, dict) else value
    try:
        pairs = list(pairs)
    except TypeError:
        raise SamplingError("logit_bias must map token ids to numbers") from None
    if len(pairs) > MAX_LOGIT_BIASES:
        raise SamplingError(f"logit_bias may name at most {MAX_LOGIT_BIASES} tokens")
    biases: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise SamplingError("logit_bias must map token ids to numbers")
        token, bias = pair
        if isinstance(token, str) and token.isdigit():
            token = int(token)
        if not _is_int(token) or token < 0:
            raise SamplingError(f"logit_bias keys must be token ids, got {token!r}")
        biases[int(token)] = _number(bias, "a logit_bias value", -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return tuple(sorted(biases.items()))


class Constraint(Protocol):
    """What limits the next token beyond the params (a grammar: :class:`~shards.runtime.grammar.TokenMask`);
    ``mask`` sets the forbidden ids of a row the sampler owns (a copy) to -inf."""

    def mask(self, row: np.ndarray) -> np.ndarray: ...

    def accept(self, token: int) -> None: ...


class Sampler:
    """Picks one token id per row of logits according to :class:`SamplingParams`.

    A seeded sampler fed the same logits returns the same ids in the same order. Each id it
    returns counts as chosen (penalties, ``constraint``). ``history``: the context's tokens
    before the first choice (the penalties' window reaches into them).
    """

    def __init__(self, params: SamplingParams, constraint: Constraint | None = None,
                 history: Sequence[int] = ()) -> None:
        if not isinstance(params, SamplingParams):
            raise SamplingError(f"Sampler needs SamplingParams, got {type(params).__name__}")
        self.params = params
        self.constraint = constraint
        self._rng = np.random.default_rng(params.seed)
        window = None if params.repeat_last_n == -1 else params.repeat_last_n
        self._recent: deque[int] | None = deque(history, maxlen=window) if params.penalised else None
        self._plain = not (params.penalised or params.logit_bias or constraint is not None)
        self.last_logprobs: TokenLogprobs | None = None  # of the last choice, when the params ask

    def allowed(self, logits: np.ndarray) -> np.ndarray:
        """Ids the params allow for these logits (best first) and their probabilities."""
        return self._candidates(self._check(logits))[0]

    def sample(self, logits: np.ndarray) -> int:
        """The next token id for one row of logits (shape ``[vocab]``), counted as chosen."""
        raw = row = self._check(logits)
        if not self._plain:
            row = self._check(self._adjusted(row))
        if self.params.greedy:
            token = int(np.argmax(row))
        else:
            ids, probs = self._candidates(row)
            if len(ids) == 1:
                token = int(ids[0])
            else:
                cumulative = np.cumsum(probs)
                pick = int(np.searchsorted(cumulative, self._rng.random() * cumulative[-1], side="right"))
                token = int(ids[min(pick, len(ids) - 1)])
        if self.params.logprobs is not None:
            self.last_logprobs = _logprobs(raw, token, self.params.logprobs)
        self.accept(token)
        return token

    def accept(self, token: int) -> None:
        """Count ``token`` as the context's next one (a chosen token, or one replayed)."""
        if self._recent is not None:
            self._recent.append(int(token))
        if self.constraint is not None:
            self.constraint.accept(token)

    def _adjusted(self, row: np.ndarray) -> np.ndarray:
        """The row after logit bias, penalties and the constraint (llama.cpp's order)."""
        p = self.params
        row = row.astype(np.float64)
        for token, bias in p.logit_bias:
            if token < row.size:
                row[token] += bias
        if self._recent:
            ids, counts = np.unique(np.fromiter(self._recent, dtype=np.int64), return_counts=True)
            keep = ids < row.size
            ids, counts = ids[keep], counts[keep]
            seen = row[ids]
            if p.repeat_penalty != 1.0:
                seen = np.where(seen > 0, seen / p.repeat_penalty, seen * p.repeat_penalty)
            row[ids] = seen - counts * p.frequency_penalty - p.presence_penalty
        if self.constraint is not None:
            row = self.constraint.mask(row)
        return row

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
        logits = row.astype(np.float64)
        if (logits == np.inf).any():  # +inf dominates: only those tokens are possible
            logits = np.where(logits == np.inf, 0.0, -np.inf)
        with np.errstate(over="ignore"):  # a tiny temperature leaves only the best tokens
            scores = (logits - logits[np.isfinite(logits)].max()) / p.temperature
        vocab = scores.size
        # Ranked by the logits themselves: shifted and scaled, two close ones may round to a tie.
        if 0 < p.top_k < vocab:
            # the k best by (logit desc, id asc): partition on the value, then sort the few
            kth = np.partition(logits, vocab - p.top_k)[vocab - p.top_k]
            pool = np.flatnonzero(logits >= kth)
        else:
            pool = np.arange(vocab)
        pool = pool[np.isfinite(scores[pool])]
        order = pool[np.lexsort((pool, -logits[pool]))]
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
        if p.min_p > 0.0:
            keep = int(np.count_nonzero(probs >= p.min_p * probs[0]))
            order, probs = order[:keep], probs[:keep]
            probs = probs / probs.sum()
        return order, probs


__all__ = ["Constraint", "SamplingParams", "Sampler", "TokenLogprobs"]
