"""Runners in a row: a range opened in parts side by side that runs as one runner
(:class:`RunnerChain`, :func:`open_range`), a whole model's chain (:func:`open_chain`) and
token ids run through one (:func:`chain_forward`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from shards.errors import RunnerError
from shards.graph.fragment import load_manifest
from shards.runtime.load_cuts import load_cuts
from shards.runtime.ort_runner import OrtFragmentRunner
from shards.runtime.runner import FragmentRunner


def _open_side_by_side(model_dir: Path, cuts: list[tuple[int, int]], kw: dict[str, Any]) -> list[OrtFragmentRunner]:
    """One runner per range, each opened on a thread of its own (all closed if one fails).
    Several stop their threads' spinning after each run: they take turns, and one's idle
    threads would take the cores from the next."""
    if len(cuts) == 1:
        return [OrtFragmentRunner(model_dir, *cuts[0], **kw)]
    kw = {**kw, "spin_after_run": False}
    with ThreadPoolExecutor(len(cuts), thread_name_prefix="ncm-open") as pool:  # waits for all
        futures = [pool.submit(OrtFragmentRunner, model_dir, a, b, **kw) for a, b in cuts]
    errors = [f.exception() for f in futures]
    failed = next((e for e in errors if e is not None), None)
    if failed is not None:
        for future, error in zip(futures, errors):
            if error is None:
                future.result().close()
        raise failed
    return [f.result() for f in futures]


def open_chain(model_dir: Path, cuts: list[tuple[int, int]], **kw: Any) -> list[FragmentRunner]:
    """One OrtFragmentRunner per (first, last) range; the ranges must tile all layers in order.

    The runners open side by side, one thread each: onnxruntime repacks a session's quantized
    weights on one core, so a model cut in N ranges loads up to N times faster on N cores.
    If one cannot open, those that did are closed and its error is raised. Several runners
    stop their threads' spinning after each run (see :func:`_open_side_by_side`).
    """
    m = load_manifest(Path(model_dir))
    expect = 0
    for a, b in cuts:
        if a != expect or b < a:
            raise RunnerError(f"cuts {cuts} do not tile layers 0..{m.n_layers - 1} in order")
        expect = b + 1
    if expect != m.n_layers:
        raise RunnerError(f"cuts {cuts} do not cover layers 0..{m.n_layers - 1}")
    return list(_open_side_by_side(Path(model_dir), cuts, kw))


def open_range(model_dir: Path, first_layer: int, last_layer: int, parts: int, **kw: Any) -> FragmentRunner:
    """Layers first_layer..last_layer as one runner: an OrtFragmentRunner, or with ``parts`` > 1
    a :class:`RunnerChain` of that many opened side by side (:func:`load_cuts`: the range loads
    up to ``parts`` times faster on as many cores, and runs as one)."""
    cuts = load_cuts(load_manifest(Path(model_dir)), first_layer, last_layer, max(1, parts))
    runners = _open_side_by_side(Path(model_dir), cuts, kw)
    return runners[0] if len(runners) == 1 else RunnerChain(runners)


class RunnerChain(FragmentRunner):
    """Consecutive runners (layers a..b, b+1..c, ...) served as one range: a step runs through
    each in turn. A step that fails past the first part leaves the parts' caches of that
    session at different lengths: the session is closed everywhere (its next step finds it
    gone and starts again)."""

    def __init__(self, parts: Sequence[FragmentRunner]) -> None:
        if not parts or any(b.first_layer != a.last_layer + 1 for a, b in zip(parts, parts[1:])):
            raise RunnerError("a runner chain needs consecutive ranges")
        self.parts = list(parts)
        self.first_layer, self.last_layer = parts[0].first_layer, parts[-1].last_layer
        self.is_head, self.is_tail = parts[0].is_head, parts[-1].is_tail
        self.provider = parts[0].provider
        self.max_context = min(p.max_context for p in parts)

    def open_session(self, session_id: str) -> None:
        opened: list[FragmentRunner] = []
        try:
            for part in self.parts:
                part.open_session(session_id)
                opened.append(part)
        except BaseException:
            for part in opened:
                part.close_session(session_id)
            raise

    def _through(self, session_ids: Sequence[str], run: Callable[[FragmentRunner, Any], np.ndarray]) -> np.ndarray:
        x = None
        for index, part in enumerate(self.parts):
            try:
                x = run(part, x)
            except BaseException:
                if index:
                    for sid in session_ids:
                        self._forget(sid)
                raise
        return x

    def forward(self, session_id: str, x: np.ndarray, *, last_only: bool = False, hidden: bool = False) -> np.ndarray:
        tail = self.parts[-1]
        return self._through([session_id], lambda part, h: part.forward(
            session_id, x if h is None else h, last_only=last_only, hidden=hidden and part is tail))

    def forward_batch(self, session_ids: Sequence[str], x: np.ndarray) -> np.ndarray:
        return self._through(session_ids, lambda part, h: part.forward_batch(session_ids, x if h is None else h))

    def reads_prompts_together(self, session_ids: Sequence[str]) -> bool:
        return all(part.reads_prompts_together(session_ids) for part in self.parts)

    def forward_prompts(self, session_ids: Sequence[str], x: np.ndarray, lengths: Sequence[int]) -> np.ndarray:
        return self._through(session_ids, lambda part, h: part.forward_prompts(session_ids, x if h is None else h,
                                                                                lengths))

    def _forget(self, session_id: str) -> None:
        for part in self.parts:
            if session_id in part.sessions():
                part.close_session(session_id)

    def session_length(self, session_id: str) -> int:
        return self.parts[0].session_length(session_id)

    def adopt_session(self, cached_id: str, session_id: str, length: int) -> None:
        for index, part in enumerate(self.parts):
            try:
                part.adopt_session(cached_id, session_id, length)
            except BaseException:
                for done in self.parts[:index]:  # the parts agree again: neither session is left
                    done.close_session(session_id)
                self._forget(cached_id)
                raise

    def close_session(self, session_id: str) -> None:
        self.parts[0].session_length(session_id)  # RunnerError if unknown
        self._forget(session_id)

    def sessions(self) -> list[str]:
        return self.parts[0].sessions()

    def memory_bytes(self) -> int:
        return sum(p.memory_bytes() for p in self.parts)

    def close(self) -> None:
        for part in self.parts:
            part.close()

    def builds(self) -> list[Path]:
        return [path for part in self.parts for path in part.builds()]

    def describe(self) -> dict[str, Any]:
        return {**self.parts[0].describe(), "parts": [[p.first_layer, p.last_layer] for p in self.parts]}


def chain_forward(runners: Sequence[FragmentRunner], session_id: str, token_ids: np.ndarray, *,
                  last_only: bool = False) -> np.ndarray:
    """Run token ids through a chain (opening the session where needed); returns logits
    [1, T, vocab] (with ``last_only``, [1, 1, vocab]: the last position's)."""
    x = np.asarray(token_ids, dtype=np.int64)
    if x.ndim == 1:
        x = x[None, :]
    for r in runners:
        if session_id not in r.sessions():
            r.open_session(session_id)
        x = r.forward(session_id, x, last_only=last_only)
    return x
