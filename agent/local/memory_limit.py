"""The memory this agent may use: the machine's, narrowed by the control group it runs in.

An agent started by systemd with ``MemoryMax=`` (or in a container with a memory limit) is
killed by the kernel past that limit, whatever the machine has free; the capacity it
advertises, and so the share of a model the plan gives it, must follow the limit. Both cgroup
versions are read: v2's ``memory.max`` / ``memory.current`` and v1's ``memory.limit_in_bytes``
/ ``memory.usage_in_bytes``, on the agent's own group and every group above it (the tightest
limit holds). Page cache the kernel can drop (``inactive_file``) does not count as used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
# v1 reports "no limit" as a huge number rounded to the page size; anything this large is none
UNLIMITED_BYTES = 1 << 60


@dataclass(frozen=True)
class CgroupMemory:
    """The tightest limit over the agent's control group and its ancestors, and what that group uses."""

    limit_bytes: int
    used_bytes: int  # charged to the group, less the page cache it can drop

    @property
    def available_bytes(self) -> int:
        return max(0, self.limit_bytes - self.used_bytes)


@dataclass(frozen=True)
class MemoryView:
    """What the agent may count on: the machine's memory, narrowed by its group's limit."""

    total_bytes: int
    available_bytes: int


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED_BYTES
    try:
        return int(text)
    except ValueError:
        return None


def _droppable_cache_bytes(stat_path: Path, key: str) -> int:
    try:
        for line in stat_path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _group_paths(cgroup_text: str) -> tuple[str | None, str | None]:
    """The v2 group path and the v1 memory controller's group path of /proc/self/cgroup."""
    unified, memory = None, None
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            unified = path
        elif "memory" in controllers.split(","):
            memory = path
    return unified, memory


def _tightest(base: Path, group: str, limit_file: str, usage_file: str, stat_key: str) -> CgroupMemory | None:
    """The group from ``group`` up to ``base`` with the least room under its limit (its limit and
    usage). A group path the agent cannot see (a container's namespace shows "/") falls back to ``base``."""
    path = PurePosixPath(group)
    best: CgroupMemory | None = None
    for level in (path, *path.parents):
        folder = base / str(level).lstrip("/")
        limit = _read_int(folder / limit_file)
        usage = _read_int(folder / usage_file)
        if limit is None or usage is None or limit >= UNLIMITED_BYTES:
            continue
        used = max(0, usage - _droppable_cache_bytes(folder / "memory.stat", stat_key))
        found = CgroupMemory(limit, used)
        if best is None or found.available_bytes < best.available_bytes:
            best = found
    return best


def cgroup_memory(root: Path = CGROUP_ROOT, cgroup_file: Path = PROC_SELF_CGROUP) -> CgroupMemory | None:
    """This process's cgroup memory limit and use, or None where no limit applies (or none is readable)."""
    try:
        text = cgroup_file.read_text()
    except OSError:
        return None
    unified, memory = _group_paths(text)
    found = []
    if unified is not None:
        found.append(_tightest(root, unified, "memory.max", "memory.current", "inactive_file"))
    if memory is not None:
        found.append(_tightest(root / "memory", memory, "memory.limit_in_bytes", "memory.usage_in_bytes",
                               "total_inactive_file"))
    limits = [f for f in found if f is not None]
    return min(limits, key=lambda f: f.available_bytes) if limits else None


def memory_view(root: Path = CGROUP_ROOT, cgroup_file: Path = PROC_SELF_CGROUP) -> MemoryView:
    """The machine's memory (psutil), narrowed by this process's cgroup limit where one applies."""
    machine = psutil.virtual_memory()
    group = cgroup_memory(root, cgroup_file)
    if group is None:
        return MemoryView(machine.total, machine.available)
    return MemoryView(min(machine.total, group.limit_bytes), min(machine.available, group.available_bytes))
