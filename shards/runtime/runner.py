"""The FragmentRunner interface: what runs one layer fragment, whatever the backend.

A runner holds one fragment (layers [first_layer, last_layer]) and, per session, the KV cache
of those layers. ``forward`` appends the positions of its input to the session's cache. The
onnxruntime implementation is :mod:`shards.runtime.ort_runner`; a range opened in parts that
runs as one, :mod:`shards.runtime.chain`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shards.errors import RunnerError


def check_prompt_lengths(session_ids: Sequence[str], x: np.ndarray, lengths: Sequence[int]) -> None:
    """RunnerError unless ``x`` has a row and ``lengths`` a length (1..T, the longest T: the
    rest of a row pads it) for each of ``session_ids``, all distinct."""
    x = np.asarray(x)
    if (x.ndim < 2 or len(set(session_ids)) != len(session_ids) or not len(session_ids) == len(x) == len(lengths)
            or not 1 <= min(lengths, default=0) <= max(lengths) == x.shape[1]):
        raise RunnerError(f"prompts need one row and one length (1..T, the longest T) per distinct session, "
                          f"got {x.shape[0] if x.ndim else 0} rows of shape {x.shape}, lengths {list(lengths)} "
                          f"for {len(session_ids)} sessions")


class FragmentRunner(abc.ABC):
    """Runs one fragment and keeps a KV cache per session.

    This is the seam for other backends: the onnxruntime runner is in
    :mod:`shards.runtime.ort_runner`; an RKNN runner
    (``rknn-toolkit-lite2`` with ``.rknn`` files converted from the static flavour) or any
    other accelerator can implement the same methods and slot into a chain.
    """

    first_layer: int
    last_layer: int
    is_head: bool
    is_tail: bool
    provider: str
    max_context: int  # most positions one session can hold

    @abc.abstractmethod
    def open_session(self, session_id: str) -> None:
        """Start an empty KV cache for ``session_id`` (RunnerError if it is already open)."""

    @abc.abstractmethod
    def forward(self, session_id: str, x: np.ndarray, *, last_only: bool = False, hidden: bool = False) -> np.ndarray:
        """Run ``x`` (token ids [1, T] at the head, hidden states [1, T, hidden] elsewhere),
        append its T positions to the session's cache; return logits or hidden states. A tail
        with ``last_only`` returns the last position's logits alone ([1, 1, vocab]): what
        sampling needs, without the output layer's product for the other T - 1 rows; with
        ``hidden``, the final norm's hidden states instead of logits (what an embedding reads)."""

    def forward_batch(self, session_ids: Sequence[str], x: np.ndarray) -> np.ndarray:
        """One decode step of several sessions: row i of ``x`` ([B, 1] token ids or [B, 1,
        hidden] hidden states) belongs to ``session_ids[i]``; returns the rows' outputs. Runners
        that cannot batch run the rows one by one."""
        if not session_ids or len(set(session_ids)) != len(session_ids) or len(session_ids) != len(x):
            raise RunnerError(f"a batch needs one row per distinct session, got {len(x)} rows "
                              f"for {len(session_ids)} sessions")
        for sid in session_ids:  # every row fits before any runs: a refused batch moves no session on
            if self.session_length(sid) + x.shape[1] > self.max_context:
                raise RunnerError(f"context overflow: session {sid!r} holds {self.session_length(sid)} positions "
                                  f"of max_context {self.max_context}")
        return np.concatenate([self.forward(sid, x[i:i + 1]) for i, sid in enumerate(session_ids)])

    def reads_prompts_together(self, session_ids: Sequence[str]) -> bool:
        """Whether :meth:`forward_prompts` reads the prompts of these sessions in one call
        (runners that cannot read them one by one)."""
        return False

    def forward_prompts(self, session_ids: Sequence[str], x: np.ndarray, lengths: Sequence[int]) -> np.ndarray:
        """The prompts of several empty sessions: row i of ``x`` ([B, T] token ids or [B, T,
        hidden] hidden states) belongs to ``session_ids[i]``, its first ``lengths[i]`` positions
        (the rest pads it to T). A tail returns each row's last position's logits [B, 1, vocab],
        other fragments the hidden states [B, T, hidden] (past a row's length: padding)."""
        check_prompt_lengths(session_ids, x, lengths)
        outs = [self.forward(sid, x[i:i + 1, :n], last_only=True)
                for i, (sid, n) in enumerate(zip(session_ids, lengths))]
        if self.is_tail:
            return np.concatenate(outs)
        padded = np.zeros((len(outs), x.shape[1], outs[0].shape[2]), outs[0].dtype)
        for i, out in enumerate(outs):
            padded[i, :out.shape[1]] = out[0]
        return padded

    @abc.abstractmethod
    def session_length(self, session_id: str) -> int:
        """Positions cached for ``session_id``."""

    def adopt_session(self, cached_id: str, session_id: str, length: int) -> None:
        """``session_id`` (not open) takes over the cache of ``cached_id`` (which is gone
        then), cut to its first ``length`` positions: a prompt cache's reuse, or its keeping
        under a new name; with ``session_id`` == ``cached_id``, the session cut back in place
        (the drafted positions a speculative step did not keep). RunnerError where the
        runner cannot."""
        raise RunnerError(f"{type(self).__name__} cannot hand a session's cache over")

    @abc.abstractmethod
    def close_session(self, session_id: str) -> None:
        """Free the session's KV cache (RunnerError if unknown)."""

    @abc.abstractmethod
    def sessions(self) -> list[str]:
        """Ids of the open sessions."""

    @abc.abstractmethod
    def memory_bytes(self) -> int:
        """Weights plus live KV caches, in bytes."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the runtime and every session."""

    def describe(self) -> dict[str, Any]:
        """Where the fragment runs (backend, provider, kind, flavour) and what fell back."""
        return {"provider": self.provider}

    def builds(self) -> list[Path]:
        """The fragment files this runner opened (deleted when it computes garbage)."""
        return []
