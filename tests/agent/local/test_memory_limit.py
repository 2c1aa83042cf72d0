"""The agent's memory within its cgroup limit: the two cgroup layouts as the kernel writes them,
and a real process in a real memory-capped group where this machine lets tests make one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from agent.local.memory_limit import UNLIMITED_BYTES, cgroup_memory, memory_view

GIB = 1024**3


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2_tree(root: Path, group: str, levels: dict[str, tuple[str, int, int]]) -> Path:
    """A v2 hierarchy under ``root``; ``levels`` maps a group path to (memory.max, current, inactive_file)."""
    for path, (limit, current, inactive) in levels.items():
        folder = root / path.lstrip("/")
        write(folder / "memory.max", f"{limit}\n")
        write(folder / "memory.current", f"{current}\n")
        write(folder / "memory.stat", f"anon 1\ninactive_file {inactive}\nactive_file 7\n")
    cgroup_file = root / "self-cgroup"
    write(cgroup_file, f"0::{group}\n")
    return cgroup_file


def test_a_v2_limit_narrows_the_memory_and_drops_the_cache_it_can_drop(tmp_path: Path) -> None:
    cgroup_file = v2_tree(tmp_path, "/system.slice/ncm.service",
                          {"/system.slice/ncm.service": (str(2 * GIB), GIB, GIB // 4)})
    found = cgroup_memory(tmp_path, cgroup_file)
    assert found is not None and found.limit_bytes == 2 * GIB
    assert found.used_bytes == GIB - GIB // 4 and found.available_bytes == GIB + GIB // 4
    view = memory_view(tmp_path, cgroup_file)
    assert view.total_bytes == 2 * GIB and view.available_bytes == GIB + GIB // 4


def test_the_tightest_group_on_the_way_up_holds(tmp_path: Path) -> None:
    cgroup_file = v2_tree(tmp_path, "/slice/unit", {"/slice/unit": ("max", GIB, 0), "/slice": (str(3 * GIB), 2 * GIB, 0)})
    found = cgroup_memory(tmp_path, cgroup_file)
    assert found is not None and (found.limit_bytes, found.available_bytes) == (3 * GIB, GIB)


def test_no_limit_leaves_the_machines_memory(tmp_path: Path) -> None:
    cgroup_file = v2_tree(tmp_path, "/", {"/": ("max", GIB, 0)})
    assert cgroup_memory(tmp_path, cgroup_file) is None
    assert cgroup_memory(tmp_path, tmp_path / "missing") is None  # not Linux, or no /proc
    view, machine = memory_view(tmp_path, cgroup_file), psutil.virtual_memory()
    assert view.total_bytes == machine.total and 0 < view.available_bytes <= machine.total


def test_a_v1_memory_controller_is_read_too(tmp_path: Path) -> None:
    folder = tmp_path / "memory" / "ncm"
    write(folder / "memory.limit_in_bytes", str(GIB))
    write(folder / "memory.usage_in_bytes", str(GIB // 2))
    write(folder / "memory.stat", f"cache 5\ntotal_inactive_file {GIB // 8}\n")
    write(tmp_path / "memory" / "memory.limit_in_bytes", str(UNLIMITED_BYTES + 4096))  # v1's "no limit"
    write(tmp_path / "memory" / "memory.usage_in_bytes", str(8 * GIB))
    cgroup_file = tmp_path / "self-cgroup"
    write(cgroup_file, "12:pids:/ncm\n9:memory:/ncm\n1:name=systemd:/ncm\n")
    found = cgroup_memory(tmp_path, cgroup_file)
    assert found is not None and found.limit_bytes == GIB and found.used_bytes == GIB // 2 - GIB // 8


def test_unreadable_values_are_no_limit(tmp_path: Path) -> None:
    cgroup_file = v2_tree(tmp_path, "/a", {"/a": ("garbage", GIB, 0)})
    assert cgroup_memory(tmp_path, cgroup_file) is None


REPORT = """
import json
from agent.local.memory_limit import memory_view
from agent.local.probe import detect_capacity, device_memory
view = memory_view()
print(json.dumps({"total": view.total_bytes, "available": view.available_bytes,
                  "ram_gib": detect_capacity("n").ram_gib,
                  "device": device_memory(vram_gib=None, ram_gib=None, held_bytes=0)}))
"""


def make_capped_group(limit_bytes: int) -> tuple[Path, Path]:
    """A real memory-capped group (v2, else v1's memory controller); (folder, its cgroup.procs)."""
    name = f"ncm-test-{uuid.uuid4().hex[:8]}"
    v2_root = Path("/sys/fs/cgroup")
    if (v2_root / "cgroup.controllers").is_file():
        own = Path("/proc/self/cgroup").read_text().splitlines()[0].split(":", 2)[2]
        folder = v2_root / own.lstrip("/") / name
        folder.mkdir()
        (folder / "memory.max").write_text(str(limit_bytes))
    else:
        folder = v2_root / "memory" / name
        folder.mkdir()
        (folder / "memory.limit_in_bytes").write_text(str(limit_bytes))
    return folder, folder / "cgroup.procs"


def test_a_process_in_a_capped_group_sees_the_cap() -> None:
    limit = 1536 * 1024**2
    try:
        folder, procs = make_capped_group(limit)
    except OSError as error:
        pytest.skip(f"this machine does not let tests make a memory cgroup: {error}")
    try:
        def enter() -> None:
            procs.write_text(str(os.getpid()))

        result = subprocess.run([sys.executable, "-c", REPORT], capture_output=True, text=True, timeout=120,
                                preexec_fn=enter, cwd=Path(__file__).resolve().parents[3])
        assert result.returncode == 0, result.stderr
        seen = json.loads(result.stdout)
        assert seen["total"] == limit and 0 < seen["available"] < limit
        assert seen["ram_gib"] <= 1.5  # what the plan is told: the cap, not the machine's free RAM
        assert seen["device"]["total_bytes"] == limit
    finally:
        folder.rmdir()
