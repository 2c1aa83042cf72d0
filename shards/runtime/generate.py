"""Text generation over a chain of fragment runners.

The pieces are separable so the cluster code can reuse them where the tail of the chain
lives on another device:

* :class:`TextStream` — a pure state machine fed sampled token ids: detokenises them
  without splitting characters, holds back text that may be the start of a stop string,
  and decides when and why the generation ends (end-of-generation token, stop string,
  ``max_tokens``).
* :func:`prefill` / :func:`decode_step` — one forward pass over the chain for the prompt
  (in chunks) or for one new token, returning the last row of logits.
* :func:`generate` — the thin loop joining them on one machine, which always frees the KV
  sessions it opened.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shards.errors import RunnerError, SamplingError, ShardsError
from shards.runtime.grammar import TokenMask, grammar_tokenizer
from shards.runtime.sampling import Sampler, SamplingParams
from shards.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from shards.runtime.runner import FragmentRunner
    from shards.store.manifest import Manifest
    from shards.store.model_store import ModelStore

log = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK_TOKENS = 256
FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(frozen=True)
class Usage:
    """Token counts and timings of one generation."""

    prompt_tokens: int
    completion_tokens: int
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.completion_tokens < 0:
            raise ValueError("token counts cannot be negative")
        if self.prefill_seconds < 0 or self.decode_seconds < 0:
            raise ValueError("timings cannot be negative")

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class GenerationEvent:
    """One step of a generation: a text piece, and on the last event the finish reason.

    ``token_id`` is the sampled token that produced this piece (None on the final event);
    ``finish_reason`` is None until the last event, then "stop" or "length"; ``usage`` is
    set on the last event only.
    """

    text: str
    token_id: int | None = None
    finish_reason: str | None = None
    usage: Usage | None = None

    def __post_init__(self) -> None:
        if self.finish_reason not in (None, FINISH_STOP, FINISH_LENGTH):
            raise ValueError(f"finish_reason must be None, 'stop' or 'length', got {self.finish_reason!r}")

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def _held_suffix_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of a stop string."""
    best = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:size]):
                best = size
                break
    return best


class TextStream:
    """Sampled token ids in, safe text pieces out; knows when the generation is over.

    Never emits a stop string or anything after it, and never loses text that turned out
    not to start a stop string. When stop strings overlap, the one whose last character
    comes first ends the text, independent of how the text was cut into tokens.
    ``push`` returns the text that may be shown now; ``finish_reason`` becomes "stop"
    (end-of-generation token or stop string) or "length" (``max_tokens`` reached) and then
    ``done`` is true.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams,
                 eos_token_ids: Sequence[int] | None = None, skip_special_tokens: bool = True) -> None:
        self.params = params
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self._decoder = tokenizer.stream_decoder(skip_special_tokens=skip_special_tokens)
        self._held = ""
        self.token_ids: list[int] = []  # every sampled id, EOS included (for KV replay)
        self.finish_reason: str | None = None
        self.text = ""  # everything emitted so far

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def push(self, token_id: int) -> str:
        """Feed one sampled token; returns the text that is now safe to emit."""
        if self.done:
            raise SamplingError("the generation is already finished")
        self.token_ids.append(int(token_id))
        if token_id in self.eos_token_ids:
            return self._finish(FINISH_STOP, self._decoder.flush())
        piece = self._decoder.push(token_id)
        out = self._scan(piece)
        if not self.done and self.completion_tokens >= self.params.max_tokens:
            out += self._finish(FINISH_LENGTH, self._decoder.flush())
        return out

    def finish(self, reason: str = FINISH_LENGTH) -> str:
        """End the stream from outside (e.g. the context is full): emit what is held."""
        if self.done:
            return ""
        return self._finish(reason, self._decoder.flush())

    def _scan(self, piece: str) -> str:
        """Emit ``held + piece`` up to a stop string, or up to a possible stop beginning."""
        buffer = self._held + piece
        stops = self.params.stop
        if not stops:
            self._held = ""
            return self._emit(buffer)
        # The stop string that completes first wins (as if text came one character at a
        # time, whatever the tokens); of those ending together, the longest.
        found = [(i + len(s), -len(s)) for s in stops if (i := buffer.find(s)) >= 0]
        if found:
            end, minus_length = min(found)
            cut = end + minus_length
            self._held = ""
            self.finish_reason = FINISH_STOP
            return self._emit(buffer[:cut])
        hold = _held_suffix_length(buffer, stops)
        self._held = buffer[len(buffer) - hold:] if hold else ""
        return self._emit(buffer[:len(buffer) - hold])

    def _finish(self, reason: str, tail: str) -> str:
        out = self._scan(tail)
        if not self.done:
            out += self._emit(self._held)
            self._held = ""
            self.finish_reason = reason
        return out

    def _emit(self, text: str) -> str:
        self.text += text
        return text


# ---------------------------------------------------------------------------------------
# Running the chain


def _check_prompt(prompt_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    ids = np.asarray(list(prompt_ids), dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise SamplingError("the prompt must hold at least one token")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise SamplingError(f"prompt token ids must be in [0, {vocab_size})")
    return ids


def prefill(runners: Sequence[FragmentRunner], session_id: str, prompt_ids: np.ndarray,
            chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS) -> np.ndarray:
    """Run the prompt through the chain in chunks; returns the last position's logits."""
    from shards.runtime.chain import chain_forward

    if chunk_tokens < 1:
        raise SamplingError(f"prefill chunk must be at least 1 token, got {chunk_tokens}")
    logits = None
    for start in range(0, len(prompt_ids), chunk_tokens):
        chunk = prompt_ids[start:start + chunk_tokens].reshape(1, -1)
        logits = chain_forward(runners, session_id, chunk, last_only=True)
    return np.asarray(logits)[0, -1]


def decode_step(runners: Sequence[FragmentRunner], session_id: str, token_id: int) -> np.ndarray:
    """Run one new token through the chain; returns its logits row."""
    from shards.runtime.chain import chain_forward

    logits = chain_forward(runners, session_id, np.array([[token_id]], dtype=np.int64), last_only=True)
    return np.asarray(logits)[0, -1]


def chain_context_tokens(runners: Sequence[FragmentRunner]) -> int | None:
    """Most positions every runner of the chain can hold (None when none says)."""
    limits = [int(r.max_context) for r in runners if getattr(r, "max_context", None)]
    return min(limits) if limits else None


def generate(runners: Sequence[FragmentRunner], tokenizer: Tokenizer, prompt_ids: Sequence[int], params: SamplingParams,
             session_id: str | None = None, *, prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
             skip_special_tokens: bool = True) -> Iterator[GenerationEvent]:
    """Stream a completion of ``prompt_ids`` over ``runners`` (head first, tail last).

    Yields one event per non-empty text piece, then a final event with ``finish_reason``
    and ``usage``. The KV sessions opened on the runners are closed when the generator
    ends, fails, or is closed early.
    """
    if not runners:
        raise RunnerError("generate needs at least one fragment runner")
    if not runners[0].is_head or not runners[-1].is_tail:
        raise RunnerError("the runner chain must start with the head fragment and end with the tail")
    ids = _check_prompt(prompt_ids, tokenizer.vocab_size)
    context_tokens = chain_context_tokens(runners)
    if context_tokens is not None and len(ids) >= context_tokens:
        raise RunnerError(f"the prompt has {len(ids)} tokens but the model's context holds {context_tokens}; "
                          "shorten it")
    session_id = session_id or f"gen-{uuid.uuid4().hex}"
    mask = TokenMask(grammar_tokenizer(tokenizer), params.grammar) if params.grammar is not None else None
    sampler = Sampler(params, mask)
    stream = TextStream(tokenizer, params, skip_special_tokens=skip_special_tokens)
    opened = []
    try:
        for runner in runners:
            runner.open_session(session_id)
            opened.append(runner)
        started = time.perf_counter()
        logits = prefill(runners, session_id, ids, prefill_chunk_tokens)
        prefill_seconds = time.perf_counter() - started
        started = time.perf_counter()
        while True:
            token = sampler.sample(logits)
            piece = stream.push(token)
            if piece:
                yield GenerationEvent(text=piece, token_id=token)
            context_full = context_tokens is not None and len(ids) + stream.completion_tokens >= context_tokens
            if not stream.done and context_full:
                piece = stream.finish(FINISH_LENGTH)  # the KV cache is full
                if piece:
                    yield GenerationEvent(text=piece)
            if stream.done:
                break
            logits = decode_step(runners, session_id, token)
        decode_seconds = time.perf_counter() - started
        usage = Usage(prompt_tokens=len(ids), completion_tokens=stream.completion_tokens,
                      prefill_seconds=prefill_seconds, decode_seconds=decode_seconds)
        yield GenerationEvent(text="", finish_reason=stream.finish_reason, usage=usage)
    finally:
        for runner in opened:
            try:
                runner.close_session(session_id)
            except ShardsError as exc:  # freeing must not hide the original outcome
                log.warning("closing session %s on layers %s-%s failed: %s",
                            session_id, runner.first_layer, runner.last_layer, exc)


# ---------------------------------------------------------------------------------------
# One model on this machine


def prompt_ids_for(tokenizer: Tokenizer, prompt: str, *, raw: bool = False, system: str | None = None,
                   history: Sequence[Mapping[str, str]] = ()) -> list[int]:
    """Token ids for a user prompt: through the chat template, or as raw text (``raw``)."""
    if raw:
        if system is not None:
            raise SamplingError("a system message needs the chat template; drop --raw or --system")
        return tokenizer.encode(prompt)
    messages = ([{"role": "system", "content": system}] if system is not None else []) + list(history)
    messages.append({"role": "user", "content": prompt})
    return tokenizer.encode_chat(messages, add_generation_prompt=True)


class LocalModel:
    """A stored model opened on this machine as one chain of runners, plus its tokenizer.

    Without ``cuts`` the layers are cut into ``parts`` ranges that take as long to open
    (:func:`~shards.runtime.load_cuts.load_cuts`; default: one per core, at most
    :data:`~shards.runtime.load_cuts.MAX_LOAD_PARTS`) and open side by side (:func:`~shards.runtime.chain.open_chain`),
    while the tokenizer loads on a thread of its own: the time to a first token is the
    slowest of them, not their sum.
    """

    def __init__(self, model_dir: Path, manifest: Manifest, *, cuts: Sequence[tuple[int, int]] | None = None,
                 parts: int | None = None, **runner_kw: Any) -> None:
        from shards.runtime.chain import open_chain
        from shards.runtime.load_cuts import MAX_LOAD_PARTS, load_cuts

        self.manifest = manifest
        self.model_dir = Path(model_dir)
        if cuts is None:
            cuts = load_cuts(manifest, 0, manifest.n_layers - 1, parts or min(os.cpu_count() or 1, MAX_LOAD_PARTS))
        with ThreadPoolExecutor(1, thread_name_prefix="ncm-tokenizer") as pool:
            tokenizer = pool.submit(Tokenizer.from_model_dir, self.model_dir)
            self.runners = open_chain(self.model_dir, list(cuts), **runner_kw)
            try:
                self.tokenizer = tokenizer.result()
            except BaseException:
                self.close()
                raise

    @classmethod
    def open(cls, name: str, store: ModelStore | None = None, **kw: Any) -> LocalModel:
        """Open model ``name`` of ``store`` (the default store when None)."""
        from shards.store.model_store import ModelStore

        store = store or ModelStore()
        manifest = store.manifest(name)
        return cls(store.model_dir(name), manifest, **kw)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, **kw: Any) -> Iterator[GenerationEvent]:
        return generate(self.runners, self.tokenizer, prompt_ids, params, **kw)

    def greedy_chat(self, messages: Sequence[Mapping[str, Any]], max_tokens: int) -> str:
        """The text this model alone answers ``messages`` with at temperature 0 (a reference)."""
        ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True)
        return "".join(e.text for e in self.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens)))

    def close(self) -> None:
        for runner in self.runners:
            runner.close()

    def __enter__(self) -> LocalModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["TextStream", "GenerationEvent", "Usage", "generate", "prefill", "decode_step",
           "prompt_ids_for", "LocalModel", "FINISH_STOP", "FINISH_LENGTH"]
