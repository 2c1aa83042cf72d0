"""The onnxruntime FragmentRunner: one fragment built in its backend's flavour, opened on the
first backend that takes it, with a KV cache per session (rows of a KV pool in the fused
flavours, arrays or device values in the plain ones)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shards.errors import RunnerError
from shards.graph.fragment import DEFAULT_ACTIVATION_BITS, build_fragment, load_manifest
from shards.graph.spec import FINAL_HIDDEN, FUSED_FLAVOURS
from shards.providers.backends import Backend, backend_chain, detect_platform
from shards.providers.rknn import RKNN, RknnSession
from shards.runtime.kv_pool import KvPool
from shards.runtime.runner import FragmentRunner, check_prompt_lengths

log = logging.getLogger(__name__)

# onnxruntime device names for OrtValues kept on the accelerator (IOBinding).
_DEVICES = {"CUDAExecutionProvider": "cuda", "TensorrtExecutionProvider": "cuda", "DmlExecutionProvider": "dml"}


# The fused flavours' KV buffers grow by doubling, from at least this many positions.
KV_GROWTH_POSITIONS = 256


class _Session:
    """KV cache of one session: per layer key/value arrays (numpy or OrtValue; none for the
    fused flavours, whose sessions are rows of the runner's KvPool) and the cached length."""

    def __init__(self, kv: dict[str, Any]) -> None:
        self.kv = kv
        self.length = 0

    def nbytes(self) -> int:
        total = 0
        for a in self.kv.values():
            total += a.nbytes if isinstance(a, np.ndarray) else 4 * int(np.prod(a.shape()))
        return total


class OrtFragmentRunner(FragmentRunner):
    """An onnxruntime session over one fragment, with a KV cache per session.

    Over 250 lines: opening on a backend chain, the KV pool's sessions and the batched step
    all act on one onnxruntime session and its bound buffers.

    The fragment runs on the first of ``backends`` (default: :func:`backend_chain` of this
    machine, restricted to ``providers`` when given) that loads it; each one that cannot is
    logged as a warning and kept in :attr:`fallbacks`. The flavour is the backend's unless
    ``flavour`` is given: "cpu" (fused, dynamic shapes), "gpu" (the same in float16, for
    CUDA), "static" (plain ops, fixed shapes: ``max_context`` KV slots and ``prefill_chunk``
    tokens per run, inputs padded) for NPUs, "portable" (plain ops, dynamic shapes) elsewhere.
    The fused flavours keep each session as a row of a :class:`~shards.runtime.kv_pool.KvPool` that
    each step writes into in place, and run the decode steps of several sessions as one batch
    (:meth:`forward_batch`). On GPU providers the KV cache stays on the device, bound with
    IOBinding (``io_binding`` forces that on or off). ``spinning`` lets onnxruntime's threads
    spin (None: its default); ``spin_after_run=False`` stops them when a run returns, for
    runners that run one after another in one process. ``activation_bits``,
    ``int8_min_weights``: see :func:`~shards.graph.fragment.build_fragment`.
    """

    def __init__(self, model_dir: Path, first_layer: int, last_layer: int, *,
                 providers: Sequence[str] | None = None, backends: Sequence[Backend] | None = None,
                 threads: int | None = None, flavour: str | None = None, max_context: int | None = None,
                 prefill_chunk: int | None = None, cache_dir: Path | None = None,
                 io_binding: bool | None = None, spinning: bool | None = None,
                 spin_after_run: bool = True, activation_bits: int = DEFAULT_ACTIVATION_BITS,
                 int8_min_weights: int | None = None) -> None:
        import onnxruntime as ort

        self.model_dir = Path(model_dir)
        self.manifest = m = load_manifest(self.model_dir)
        self.first_layer, self.last_layer = int(first_layer), int(last_layer)
        self.is_head = self.first_layer == 0
        self.is_tail = self.last_layer == m.n_layers - 1
        self.max_context = int(max_context or m.context_length)
        if backends is None:
            backends, _ = backend_chain(detect_platform(), providers or ())
        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads = int(threads)
        if spinning is not None:  # None: onnxruntime's default (its threads spin between runs)
            so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
        if not spin_after_run:  # threads spin within a run only: the next runner gets the cores
            so.add_session_config_entry("session.force_spinning_stop", "1")
        so.log_severity_level = 3
        failures: list[str] = []
        for backend in backends:
            try:
                self._load(ort, so, backend, flavour, prefill_chunk, cache_dir, activation_bits, int8_min_weights)
                break
            except RunnerError as error:
                failures.append(f"{backend.name}: {error}")
                log.warning("fragment %d-%d cannot run on %s, trying the next backend: %s",
                            self.first_layer, self.last_layer, backend.name, error)
        else:
            raise RunnerError(f"no backend could load fragment {self.first_layer}-{self.last_layer}: "
                              + "; ".join(failures))
        self.fallbacks = tuple(failures)
        if io_binding is None:
            io_binding = self.provider in _DEVICES
        device = _DEVICES.get(self.provider, "cpu") if io_binding else "cpu"
        self._io_device = device if io_binding and self.flavour == "portable" else None
        self._in_name = "input_ids" if self.is_head else "hidden_states"
        self._out_names = [o.name for o in self._sess.get_outputs() if o.name != FINAL_HIDDEN]
        self._layers = list(range(self.first_layer, self.last_layer + 1))
        self._sessions: dict[str, _Session] = {}
        m = self.manifest
        self._pool = KvPool([f"past_{kind}.{li}" for li in self._layers for kind in ("key", "value")],
                            kv_heads=m.n_kv_heads, head_dim=m.head_dim, max_context=self.max_context,
                            growth_positions=KV_GROWTH_POSITIONS,
                            dtype=np.float16 if self.flavour == "gpu" else np.float32,
                            device=device) if self.flavour in FUSED_FLAVOURS else None
        self._lock = threading.Lock()
        log.info("fragment %d-%d on %s (%s, %s flavour)", self.first_layer, self.last_layer, self.backend.name,
                 self.provider, self.flavour)

    def _load(self, ort: Any, so: Any, backend: Backend, flavour: str | None, prefill_chunk: int | None,
              cache_dir: Path | None, activation_bits: int, int8_min_weights: int | None) -> None:
        """Build the fragment in ``backend``'s flavour and open it there (RunnerError if not)."""
        self.backend, self.flavour = backend, flavour or backend.flavour
        self.prefill_chunk = int(prefill_chunk or min(64, self.max_context)) if self.flavour == "static" else 0
        self.path = build_fragment(self.model_dir, self.first_layer, self.last_layer, flavour=self.flavour,
                                   max_context=self.max_context, prefill_chunk=self.prefill_chunk or None,
                                   cache_dir=cache_dir, activation_bits=activation_bits,
                                   int8_min_weights=int8_min_weights)
        info = json.loads((self.path.parent / "fragment.json").read_text(encoding="utf-8"))
        self._weight_bytes = int(info["weight_bytes"])
        if backend.provider == RKNN:  # Rockchip's NPU: the static fragment converted (shards.providers.rknn)
            self._sess = RknnSession(self.path, **dict(backend.options))
            self.provider = RKNN
            return
        try:
            self._sess = ort.InferenceSession(str(self.path), so, providers=backend.providers())
        except Exception as e:  # onnxruntime raises its own exception types
            raise RunnerError(f"cannot load fragment {self.path.name} on {backend.provider}: {e}") from e
        self.provider = self._sess.get_providers()[0]
        if self.provider != backend.provider:
            # onnxruntime falls back to the CPU when a provider fails to start (a missing
            # device or library); that is not the backend that was asked for.
            raise RunnerError(f"onnxruntime could not start {backend.provider} with {dict(backend.options)} "
                              f"(it fell back to {self.provider})")

    def builds(self) -> list[Path]:
        return [self.path]

    def describe(self) -> dict[str, Any]:
        """Where this fragment runs, and the backends that could not load it."""
        return {**self.backend.describe(), "flavour": self.flavour, "fallbacks": list(self.fallbacks)}

    # --- sessions ----------------------------------------------------------------------------
    def _kv_shape(self) -> tuple[int, int, int, int]:
        m = self.manifest
        return (1, m.n_kv_heads, self.max_context if self.flavour == "static" else 0, m.head_dim)

    def open_session(self, session_id: str) -> None:
        with self._lock:
            if self._sess is None:
                raise RunnerError("runner is closed")
            if session_id in self._sessions:
                raise RunnerError(f"session {session_id!r} is already open")
            if self._pool is not None:
                self._pool.add(session_id)
                self._sessions[session_id] = _Session({})
                return
            shape = self._kv_shape()
            names = [f"past_{kind}.{li}" for li in self._layers for kind in ("key", "value")]
            if self._io_device is not None:
                import onnxruntime as ort

                kv = {n: ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32), self._io_device, 0)
                      for n in names}
            else:
                kv = {n: np.zeros(shape, np.float32) for n in names}
            self._sessions[session_id] = _Session(kv)

    def _get(self, session_id: str) -> _Session:
        s = self._sessions.get(session_id)
        if s is None:
            raise RunnerError(f"unknown session {session_id!r}")
        return s

    def session_length(self, session_id: str) -> int:
        return self._get(session_id).length

    def adopt_session(self, cached_id: str, session_id: str, length: int) -> None:
        with self._lock:
            s = self._get(cached_id)
            if session_id in self._sessions and session_id != cached_id:
                raise RunnerError(f"session {session_id!r} is already open")
            if not 0 <= length <= s.length:
                raise RunnerError(f"session {cached_id!r} holds {s.length} positions, not {length}")
            if self._pool is None and self.flavour != "static":  # the plain caches are as long as what they hold
                if any(not isinstance(a, np.ndarray) for a in s.kv.values()):
                    raise RunnerError("a cache kept on the device cannot be cut")
                s.kv = {name: a[:, :, :length] for name, a in s.kv.items()}
            s.length = length  # the pooled and static caches: positions past it are written over
            del self._sessions[cached_id]
            self._sessions[session_id] = s
            if self._pool is not None and session_id != cached_id:
                self._pool.rename(cached_id, session_id)

    def close_session(self, session_id: str) -> None:
        with self._lock:
            self._get(session_id)
            del self._sessions[session_id]
            if self._pool is not None:
                self._pool.remove(session_id)

    def sessions(self) -> list[str]:
        return list(self._sessions)

    def memory_bytes(self) -> int:
        pool = self._pool.nbytes() if self._pool is not None else 0
        return self._weight_bytes + pool + sum(s.nbytes() for s in list(self._sessions.values()))

    def close(self) -> None:
        with self._lock:
            for session_id in list(self._sessions):
                del self._sessions[session_id]
                if self._pool is not None:
                    self._pool.remove(session_id)
            if isinstance(self._sess, RknnSession):
                self._sess.close()  # its worker process or NPU context
            self._sess = None

    # --- forward -----------------------------------------------------------------------------
    def _check(self, x: np.ndarray, rows: int = 1) -> np.ndarray:
        x = np.asarray(x)
        if self.is_head:
            if x.ndim != 2 or x.shape[0] != rows or x.shape[1] < 1 or not np.issubdtype(x.dtype, np.integer):
                raise RunnerError(f"head fragment wants int token ids [{rows}, T], got {x.dtype} {x.shape}")
            if x.min() < 0 or x.max() >= self.manifest.vocab_size:
                raise RunnerError(f"token id out of range 0..{self.manifest.vocab_size - 1}")
            return x.astype(np.int64, copy=False)
        h = self.manifest.hidden_size
        if x.ndim != 3 or x.shape[0] != rows or x.shape[1] < 1 or x.shape[2] != h or x.dtype != np.float32:
            raise RunnerError(f"fragment wants float32 hidden states [{rows}, T, {h}], got {x.dtype} {x.shape}")
        return x

    def forward(self, session_id: str, x: np.ndarray, *, last_only: bool = False, hidden: bool = False) -> np.ndarray:
        if hidden and not self.is_tail:
            raise RunnerError(f"fragment {self.first_layer}-{self.last_layer} is no tail: it has no final hidden states")
        first = FINAL_HIDDEN if hidden else self._out_names[0]
        with self._lock:
            if self._sess is None:
                raise RunnerError("runner is closed")
            s = self._get(session_id)
            x = self._check(x)
            t = x.shape[1]
            if s.length + t > self.max_context:
                raise RunnerError(f"context overflow: {s.length} + {t} positions > max_context {self.max_context}")
            if self._pool is not None:  # the fused graph computes the logits of the rows asked for
                return self._forward_rows([session_id], x, t - 1 if last_only else 0, first)
            out = self._forward_unpooled(s, x, first)
            return out[:, -1:] if last_only and self.is_tail else out

    def _forward_unpooled(self, s: _Session, x: np.ndarray, first: str) -> np.ndarray:
        """``first``: the output returned (logits or the final hidden states at a tail)."""
        if self.flavour == "static":
            return self._forward_static(s, x, first)
        if self._io_device is not None:
            return self._forward_bound(s, x, first)
        feeds: dict[str, Any] = {self._in_name: x, **s.kv}
        outs = self._sess.run([first, *self._out_names[1:]], feeds)
        for name, val in zip(self._out_names[1:], outs[1:]):
            s.kv[name.replace("present_", "past_")] = val
        s.length += x.shape[1]
        return outs[0]

    def forward_batch(self, session_ids: Sequence[str], x: np.ndarray) -> np.ndarray:
        if self._pool is None:
            return super().forward_batch(session_ids, x)
        with self._lock:
            if self._sess is None:
                raise RunnerError("runner is closed")
            if len(set(session_ids)) != len(session_ids) or not session_ids:
                raise RunnerError(f"a batch needs distinct sessions, got {list(session_ids)}")
            x = self._check(x, len(session_ids))
            if x.shape[1] != 1:
                raise RunnerError(f"a batch runs one position per session, got {x.shape[1]}")
            for sid in session_ids:
                if self._get(sid).length + 1 > self.max_context:
                    raise RunnerError(f"context overflow: session {sid!r} holds max_context {self.max_context}")
            return self._forward_rows(session_ids, x)

    def reads_prompts_together(self, session_ids: Sequence[str]) -> bool:
        """A fused flavour reads the prompts of empty sessions as one call when no other
        session's row lies between theirs: GroupQueryAttention reads several rows of several
        positions only when none holds any."""
        with self._lock:
            return self._prompts_fit(session_ids)

    def _prompts_fit(self, session_ids: Sequence[str]) -> bool:
        if self._pool is None or len(session_ids) < 2 or len(set(session_ids)) != len(session_ids):
            return False
        if any(sid not in self._sessions or self._sessions[sid].length for sid in session_ids):
            return False
        return set(self._pool.sessions_in(*self._pool.span(session_ids)).values()) <= set(session_ids)

    def forward_prompts(self, session_ids: Sequence[str], x: np.ndarray, lengths: Sequence[int]) -> np.ndarray:
        if self._pool is None:
            return super().forward_prompts(session_ids, x, lengths)
        with self._lock:
            if self._sess is None:
                raise RunnerError("runner is closed")
            if not self._prompts_fit(session_ids):
                raise RunnerError(f"prompts of sessions {list(session_ids)} cannot be read together: each must be "
                                  "open and empty, and no other session's row between theirs")
            check_prompt_lengths(session_ids, x, lengths)
            x = self._check(x, len(session_ids))
            t, counts = x.shape[1], np.asarray(lengths, np.int64)
            if t > self.max_context:
                raise RunnerError(f"context overflow: {t} positions > max_context {self.max_context}")
            # right-padded: each row's positions past its length are written over by its next step
            logits_from = int(counts.min()) - 1 if self.is_tail else 0
            try:
                out = self._forward_rows(session_ids, x, logits_from)
            except Exception as error:  # onnxruntime's own types: a provider that refuses the batch
                raise RunnerError(f"the provider could not read {len(counts)} prompts together: {error}") from error
            for sid, count in zip(session_ids, counts):
                self._sessions[sid].length = int(count)
            return out[np.arange(len(counts)), counts - 1 - logits_from][:, None] if self.is_tail else out

    def _forward_rows(self, session_ids: Sequence[str], x: np.ndarray, logits_from: int = 0,
                      output: str | None = None) -> np.ndarray:
        """Run row i of ``x`` for ``session_ids[i]`` over the consecutive pool rows that hold
        them; the rows between that are not in the batch get a dummy input at their own next
        position (their next step overwrites it). A fused flavour's present is bound to its
        past, so the run writes the new positions into the pool in place. A tail returns the
        logits (or ``output``, the final hidden states) of positions ``logits_from`` on."""
        output = output or self._out_names[0]
        pool, t = self._pool, x.shape[1]
        assert pool is not None
        first, end = pool.span(session_ids)
        lengths = np.zeros(end - first, np.int64)
        for slot, sid in pool.sessions_in(first, end).items():  # a full session's last position is spent
            lengths[slot - first] = min(self._sessions[sid].length, self.max_context - t)
        rows = [pool.slot_of[sid] - first for sid in session_ids]
        lengths[rows] = [self._sessions[sid].length for sid in session_ids]
        pool.reserve(int(lengths.max()) + t)
        if rows == list(range(end - first)):
            feed = x
        else:
            feed = np.zeros((end - first, *x.shape[1:]), x.dtype)
            feed[rows] = x
        io = pool.binding(self._sess, first, end, output)
        io.bind_cpu_input(self._in_name, feed)
        io.bind_cpu_input("past_length", lengths)
        if self.is_tail:
            io.bind_cpu_input("logits_from", np.array([logits_from], np.int64))
        self._sess.run_with_iobinding(io)
        for sid in session_ids:
            self._sessions[sid].length += t
        out = io.get_outputs()[0].numpy()
        io.bind_output(output, "cpu")  # lets go of this run's output: the next gets a new one
        return out if feed is x else out[rows]

    def _forward_bound(self, s: _Session, x: np.ndarray, first: str) -> np.ndarray:
        """Dynamic flavour with IOBinding: the KV cache never leaves the device."""
        io = self._sess.io_binding()
        io.bind_cpu_input(self._in_name, x)
        for name, val in s.kv.items():
            io.bind_ortvalue_input(name, val)
        io.bind_output(first, "cpu")
        for name in self._out_names[1:]:
            io.bind_output(name, self._io_device, 0)
        self._sess.run_with_iobinding(io)
        outs = io.get_outputs()
        for name, val in zip(self._out_names[1:], outs[1:]):
            s.kv[name.replace("present_", "past_")] = val
        s.length += x.shape[1]
        return outs[0].numpy()

    def _forward_static(self, s: _Session, x: np.ndarray, first: str) -> np.ndarray:
        c, t = self.prefill_chunk, x.shape[1]
        pieces = []
        for start in range(0, t, c):
            chunk = x[:, start:start + c]
            valid = chunk.shape[1]
            if valid < c:
                pad = [(0, 0), (0, c - valid)] + ([(0, 0)] if chunk.ndim == 3 else [])
                chunk = np.pad(chunk, pad)
            feeds = {self._in_name: chunk, "past_length": np.array([s.length], np.int64), **s.kv}
            outs = self._sess.run([first, *self._out_names[1:]], feeds)
            for name, val in zip(self._out_names[1:], outs[1:]):
                s.kv[name.replace("new_", "past_")][:, :, s.length:s.length + valid] = val[:, :, :valid]
            s.length += valid
            pieces.append(outs[0][:, :valid])
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=1)
