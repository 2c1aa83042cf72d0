"""The KV cache of a fused-flavour runner ("cpu", "gpu"): per layer and kind one buffer
[slots, kv_heads, capacity, head_dim] (float32, or float16 for "gpu"), a row (slot) per
session, in host memory or on the fragment's device (a CUDA GPU's: the cache never leaves it).

The fragment writes a step's keys and values into the rows in place (its present is bound to
its past), so a step copies nothing that is already cached. Any run of consecutive rows is one
contiguous view, which is what lets decode steps of several sessions run as one batch: the
rows between them that are not in the batch ride along with a dummy input whose one garbage
position lands where their own next step will write (at their current length).

In host memory the buffers have room for max_context positions from the start: the system
gives a buffer's pages as they are first written, so a row holds the memory of the positions
it wrote, and a cache that grows never stops every stream to copy it (a copy of every row
when a long prompt doubled the capacity stalled them for up to a second). Where that much
address space is refused, and on a device, capacity grows by doubling. Slots grow by
doubling; growing copies the positions written once (through the host for a device buffer:
growth is rare, steps are not).
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Sequence
from typing import Any

import numpy as np

from shards.errors import RunnerError

log = logging.getLogger(__name__)


def allocate(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A zeroed host buffer whose pages the system gives as they are first written, in small
    pages (numpy asks for huge ones, and one position written into a row would take 2 MiB
    then); MemoryError when the system refuses the address space."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if not size:
        return np.zeros(shape, dtype)
    try:
        region = mmap.mmap(-1, size)
    except OSError as error:
        raise MemoryError(f"no address space for {size} bytes: {error}") from None
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        region.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(region, dtype).reshape(shape)


class KvPool:
    """Rows of KV buffers for the sessions of one fragment; lengths are the caller's."""

    def __init__(self, names: Sequence[str], *, kv_heads: int, head_dim: int, max_context: int,
                 growth_positions: int, dtype: Any = np.float32, device: str = "cpu") -> None:
        self.names = list(names)
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.max_context, self.growth_positions = max_context, growth_positions
        self.dtype, self.device = np.dtype(dtype), device
        self.written = 0  # positions any row may have written: what a copy keeps and the memory counts
        # numpy arrays in host memory; onnxruntime OrtValues on another device
        self.arrays: dict[str, Any] = {n: self._empty(0, 0) for n in self.names}
        self.slot_of: dict[str, int] = {}
        # (first row, end row) -> an IOBinding over their views, with the OrtValues it binds
        self._bindings: dict[tuple[int, int, str], tuple[Any, list[Any]]] = {}

    def _empty(self, slots: int, capacity: int) -> Any:
        return self._placed(allocate((slots, self.kv_heads, capacity, self.head_dim), self.dtype))

    def _placed(self, array: np.ndarray) -> Any:
        """``array``, or a copy of it on the device."""
        if self.device == "cpu":
            return array
        import onnxruntime as ort

        return ort.OrtValue.ortvalue_from_numpy(array, self.device, 0)

    def _host(self, name: str) -> np.ndarray:
        buffer = self.arrays[name]
        return buffer if isinstance(buffer, np.ndarray) else buffer.numpy()

    def _shape(self) -> tuple[int, ...]:
        buffer = self.arrays[self.names[0]]
        return tuple(buffer.shape if isinstance(buffer, np.ndarray) else buffer.shape())

    @property
    def slots(self) -> int:
        return self._shape()[0] if self.names else 0

    @property
    def capacity(self) -> int:
        return self._shape()[2] if self.names else 0

    def nbytes(self) -> int:
        """The buffers' memory: slots x capacity on a device; in host memory, slots x the
        positions written (in steps of growth_positions), whatever the sessions hold."""
        if not self.slot_of:
            return 0
        slots, heads, capacity, head_dim = self._shape()
        if self.device == "cpu":
            capacity = min(capacity, -(-self.written // self.growth_positions) * self.growth_positions)
        return len(self.names) * slots * heads * capacity * head_dim * self.dtype.itemsize

    def add(self, session_id: str) -> int:
        """Give ``session_id`` a free row (more rows when none is free); returns it."""
        used = set(self.slot_of.values())
        slot = next((s for s in range(self.slots) if s not in used), None)
        if slot is None:
            slot = self.slots
            self._resize(max(1, 2 * self.slots), self.capacity)
        self.slot_of[session_id] = slot
        return slot

    def rename(self, session_id: str, new_id: str) -> None:
        """The row of ``session_id`` is ``new_id``'s from now on."""
        self.slot_of[new_id] = self.slot_of.pop(session_id)

    def remove(self, session_id: str) -> None:
        """Free the session's row; the buffers go when the last session does."""
        del self.slot_of[session_id]
        if not self.slot_of:
            self._resize(0, 0)

    def reserve(self, positions: int) -> None:
        """Room for ``positions`` in every row (doubling, in steps of ``growth_positions``, up
        to max_context)."""
        if positions > self.max_context:
            raise RunnerError(f"context overflow: {positions} positions > max_context {self.max_context}")
        self.written = max(self.written, positions)
        if positions <= self.capacity:
            return
        if self.device == "cpu":
            try:  # address space only: pages come as rows write them
                self._resize(self.slots, self.max_context)
                return
            except MemoryError:
                log.info("no address space for a KV buffer of %d positions: it grows as it fills", self.max_context)
        grown = max(positions, 2 * self.capacity, self.growth_positions)
        step = self.growth_positions
        self._resize(self.slots, min(-(-grown // step) * step, self.max_context))

    def _resize(self, slots: int, capacity: int) -> None:
        """New buffers of ``slots`` x ``capacity``, with the positions written copied over (all
        of them or none: MemoryError leaves the old buffers as they were)."""
        rows, keep = min(slots, self.slots), min(capacity, self.capacity, self.written)
        fresh = {}
        for name in self.names:
            new = allocate((slots, self.kv_heads, capacity, self.head_dim), self.dtype)
            if rows and keep:
                new[:rows, :, :keep] = self._host(name)[:rows, :, :keep]
            fresh[name] = new
        self._bindings.clear()
        self.arrays = {name: self._placed(new) for name, new in fresh.items()}
        if not slots:
            self.written = 0

    def span(self, session_ids: Sequence[str]) -> tuple[int, int]:
        """The consecutive rows [first, end) that hold every one of ``session_ids``."""
        slots = [self.slot_of[s] for s in session_ids]
        return min(slots), max(slots) + 1

    def sessions_in(self, first: int, end: int) -> dict[int, str]:
        """Row -> session for the occupied rows of [first, end)."""
        return {slot: sid for sid, slot in self.slot_of.items() if first <= slot < end}

    def binding(self, session: Any, first: int, end: int, logits_name: str) -> Any:
        """An IOBinding of ``session`` (an onnxruntime InferenceSession) whose past and present
        are rows [first, end) of the buffers; its first output is ``logits_name``, which the
        caller binds anew after reading it. Kept until the buffers are resized.

        Rows are the outermost dimension, so rows [first, end) are one contiguous piece of a
        buffer, bound by its address: the same on the host and on a device."""
        key = (first, end, logits_name)
        if key not in self._bindings:
            io = session.io_binding()
            io.bind_output(logits_name, "cpu")  # first: get_outputs() keeps binding order
            shape = (end - first, *self._shape()[1:])
            row_bytes = int(np.prod(shape[1:])) * self.dtype.itemsize
            for name, buffer in self.arrays.items():
                base = buffer.ctypes.data if isinstance(buffer, np.ndarray) else buffer.data_ptr()
                address = base + first * row_bytes
                io.bind_input(name, self.device, 0, self.dtype, shape, address)
                io.bind_output(name.replace("past_", "present_"), self.device, 0, self.dtype, shape, address)
            self._bindings[key] = (io, list(self.arrays.values()))  # the buffers live as long as it
        return self._bindings[key][0]
