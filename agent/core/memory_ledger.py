"""The model router's two capacity ledgers (design §10). Pure.

``models_max`` counts the models loading or ready across the cluster (0 = no limit). Device
memory: every device has ``total - external - margin`` bytes for models; a loading model
reserves its measured minimum, a ready one holds what its workers reported (effective). When a
load does not fit, the least recently used idle models are the victims, as few as make it fit;
when none can, :meth:`MemoryLedger.refusal` says why, with the real reason: which device lacks
how much, what evicting the idle models would free, and which models hold the rest and why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from agent.core.errors import CapacityError, RouterError

RETRY_AFTER_BUSY_S = 10.0
MIB = 1024 * 1024


@dataclass(frozen=True)
class DeviceMemory:
    """What a device has: its total memory and what other programs use of it."""

    total_bytes: int
    external_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("total_bytes", "external_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise RouterError(f"device memory: {name} must be an integer >= 0, got {value!r}")


class Holder(Protocol):
    """A model as the ledgers see it."""

    name: str

    def held_bytes(self) -> Mapping[str, int]: ...

    def counted(self) -> bool: ...


@dataclass
class MemoryLedger:
    """Both ledgers over ``models`` (the registry's entries, shared, read only here)."""

    models: Mapping[str, Holder]
    models_max: int = 0
    memory_margin_bytes: int = 0
    devices: dict[str, DeviceMemory] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.models_max < 0 or self.memory_margin_bytes < 0:
            raise RouterError("models_max and memory_margin_bytes must be >= 0")

    def loaded_count(self) -> int:
        return sum(1 for m in self.models.values() if m.counted())

    def budget_bytes(self, node: str) -> int | None:
        """Memory of ``node`` usable by models (None: the node never reported, no limit)."""
        device = self.devices.get(node)
        if device is None:
            return None
        return device.total_bytes - device.external_bytes - self.memory_margin_bytes

    def held_bytes(self, node: str, *, without: Iterable[str] = ()) -> int:
        skip = set(without)
        return sum(m.held_bytes().get(node, 0) for m in self.models.values() if m.name not in skip)

    def shortfall(self, need: Mapping[str, int], *, without: Iterable[str] = ()) -> dict[str, int]:
        """Per node, how many bytes ``need`` lacks (empty: it fits)."""
        short = {}
        for node, need_bytes in need.items():
            budget = self.budget_bytes(node)
            if budget is None:
                continue
            missing = need_bytes - (budget - self.held_bytes(node, without=without))
            if missing > 0:
                short[node] = missing
        return short

    def sessions_per_node(self, session_bytes: Mapping[str, int], most: int) -> dict[str, int]:
        """Per node, how many requests of a loaded model hold a session there at once when each
        holds ``session_bytes`` (per node: a KV cache at full context) and one is counted in
        what the model holds already: 1 + the sessions its room beside everything held takes,
        1..``most`` (``most`` on a node that reported no memory limit)."""
        counts = {}
        for node, per_session in session_bytes.items():
            budget = self.budget_bytes(node)
            count = most
            if budget is not None and per_session > 0:
                count = min(most, 1 + max(budget - self.held_bytes(node), 0) // per_session)
            counts[node] = max(1, count)
        return counts

    def sessions_fitting(self, session_bytes: Mapping[str, int], most: int, *, one_node_each: bool = False) -> int:
        """How many requests of a loaded model run at once (see :meth:`sessions_per_node`):
        as many as the node with the least room holds, every request holding a session on
        every node of the route; with ``one_node_each`` (a model placed as whole copies,
        design §11: each request holds a session on one of the nodes alone), what all the
        nodes hold together."""
        counts = self.sessions_per_node(session_bytes, most)
        if not counts:
            return max(1, most)
        return sum(counts.values()) if one_node_each else min(counts.values())

    def over_count(self, without: Iterable[str] = ()) -> bool:
        skip = set(without)
        count = sum(1 for m in self.models.values() if m.counted() and m.name not in skip)
        return self.models_max > 0 and count >= self.models_max

    def fits(self, need: Mapping[str, int], gone: Iterable[str]) -> bool:
        """Whether ``need`` fits both ledgers once the models ``gone`` are unloaded."""
        return not self.shortfall(need, without=gone) and not self.over_count(gone)

    def victims(self, need: Mapping[str, int], evictable: Iterable[Holder]) -> list[str]:
        """The first of the ``evictable`` models (least recently used first) whose unloading
        makes ``need`` fit ([] when no such set exists)."""
        gone: list[str] = []
        for candidate in evictable:
            if self.fits(need, gone):
                break
            short = self.shortfall(need, without=gone)
            if self.over_count(gone) or any(candidate.held_bytes().get(n, 0) > 0 for n in short):
                gone.append(candidate.name)
        return gone if self.fits(need, gone) else []

    def refusal(self, name: str, need: Mapping[str, int], idle: list[str],
                why_kept: Callable[[Holder], str]) -> CapacityError:
        """Why model ``name`` (needing ``need``) cannot load now, the ``idle`` models evicted
        or not; ``why_kept`` says why another loaded model cannot be."""
        for node, need_bytes in sorted(need.items()):
            budget = self.budget_bytes(node)
            if budget is not None and need_bytes > budget:
                return CapacityError(
                    f"model {name!r} needs {need_bytes / MIB:.0f} MiB on node {node}, which has "
                    f"{max(budget, 0) / MIB:.0f} MiB for models even with nothing else loaded; "
                    f"add a device or lower the model's context", None)
        kept = sorted((m for m in self.models.values() if m.counted() and m.name != name and m.name not in idle),
                      key=lambda m: m.name)
        reasons = []
        if self.over_count(idle):
            reasons.append(f"models_max={self.models_max} is reached by models that cannot be evicted: "
                           + ", ".join(f"{m.name} ({why_kept(m)})" for m in kept))
        for node, _missing in sorted(self.shortfall(need, without=idle).items()):
            budget = self.budget_bytes(node) or 0
            free = max(budget - self.held_bytes(node), 0)
            idle_here = [n for n in idle if self.models[n].held_bytes().get(node, 0) > 0]
            text = f"it needs {need[node] / MIB:.0f} MiB on node {node}, which has {free / MIB:.0f} MiB free"
            if idle_here:
                freed = sum(self.models[n].held_bytes()[node] for n in idle_here)
                text += (f"; evicting the idle model{'s' if len(idle_here) > 1 else ''} {', '.join(idle_here)} "
                         f"would free only {freed / MIB:.0f} MiB more")
            holders = [m for m in kept if m.held_bytes().get(node, 0) > 0]
            if holders:
                text += "; the rest is held by " + ", ".join(
                    f"{m.name} ({m.held_bytes()[node] / MIB:.0f} MiB, {why_kept(m)})" for m in holders)
            reasons.append(text)
        return CapacityError(f"cannot load model {name!r} now: {'; '.join(reasons) or 'it does not fit'}; "
                             f"retry later", RETRY_AFTER_BUSY_S)
