"""The ``ncm`` entry point's environment: huge pages for malloc where the kernel gives them on
request, no OpenBLAS threads, and what the user set wins."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent import __version__
from agent.local.runtime_env import read_thp_mode, runtime_env, thp_mode

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("text,mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                                       ("always madvise [never]", "never"), ("", None), ("always madvise", None)])
def test_the_kernel_mode_is_the_bracketed_word(text: str, mode: str | None) -> None:
    assert thp_mode(text) == mode


def test_no_mode_file_means_no_mode(tmp_path: Path) -> None:
    assert read_thp_mode(tmp_path / "absent") is None


def test_huge_pages_are_asked_for_only_where_the_kernel_gives_them_on_request() -> None:
    assert runtime_env({}, "madvise") == {"OPENBLAS_NUM_THREADS": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    for mode in ("always", "never", None):
        assert runtime_env({"PATH": "/bin"}, mode) == {"PATH": "/bin", "OPENBLAS_NUM_THREADS": "1"}


def test_what_the_user_set_wins_and_other_tunables_stay() -> None:
    env = runtime_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "OPENBLAS_NUM_THREADS": "4"}, "madvise")
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "OPENBLAS_NUM_THREADS": "4"}
    off = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0", "OPENBLAS_NUM_THREADS": "1"}
    assert runtime_env(off, "madvise") == off
    assert runtime_env(env, "madvise") == env  # applied once: the started-again process does not start again


def test_the_entry_point_runs_the_command_in_the_environment_it_asks_for(tmp_path: Path) -> None:
    """`ncm --version` through the entry point (started again where this kernel's mode asks
    for it), and the environment the command then runs in."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "OPENBLAS_NUM_THREADS")}
    env["PYTHONPATH"] = str(REPO)
    script = tmp_path / "ncm"
    script.write_text("import sys\nfrom agent.cli.launch import main\nsys.exit(main())\n")
    result = subprocess.run([sys.executable, str(script), "--version"], capture_output=True, text=True, env=env,
                            timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"ncm {__version__}", result.stderr
    probe = ("import os, sys, types\n"  # the command started: it prints the environment it got
             "cli = types.ModuleType('agent.cli.main')\n"
             "cli.main = lambda: print(os.environ.get('GLIBC_TUNABLES'), os.environ.get('OPENBLAS_NUM_THREADS')) or 0\n"
             "sys.modules['agent.cli.main'] = cli\n"
             "from agent.cli.launch import main\nsys.exit(main())\n")
    script.write_text(probe)
    seen = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    wanted = runtime_env(env, read_thp_mode())
    assert seen.stdout.split() == [str(wanted.get("GLIBC_TUNABLES")), "1"], seen.stderr
