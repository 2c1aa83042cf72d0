"""agent.local.runtime_env as properties (tests/agent/cli/test_launch.py has the examples and
the entry point): the kernel's mode is its bracketed word wherever it stands; the mode file is
read as the kernel writes it, and one that is missing, a folder or not text gives no mode;
the environment made keeps every variable the user set, only adds, asks for huge pages only
where the kernel mode is madvise, and made again changes nothing."""

from __future__ import annotations

import string
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from agent.local.runtime_env import HUGEPAGE_TUNABLE, THP_MODE_FILE, read_thp_mode, runtime_env, thp_mode

WORDS = st.text(string.ascii_lowercase + "_-", min_size=1, max_size=10)
MODES = st.sampled_from(["always", "madvise", "never", None])
NAMES = st.text(string.ascii_uppercase + "_", min_size=1, max_size=12)
VALUES = st.text(string.printable.replace("\x0b", "").replace("\x0c", ""), max_size=30)
TUNABLES = st.lists(st.sampled_from(["glibc.malloc.arena_max=2", "glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=2",
                                     "glibc.pthread.rseq=0", "glibc.malloc.tcache_count=0"]), max_size=3)
environments = st.builds(
    lambda base, tunables, blas: {**base, **({"GLIBC_TUNABLES": ":".join(tunables)} if tunables is not None else {}),
                                  **({"OPENBLAS_NUM_THREADS": blas} if blas is not None else {})},
    st.dictionaries(NAMES, VALUES, max_size=6), st.none() | TUNABLES, st.none() | st.sampled_from(["1", "4", ""]))


@given(st.lists(WORDS, max_size=4), WORDS, st.lists(WORDS, max_size=4), st.sampled_from([" ", "\n", "\t", "  "]))
def test_the_mode_is_the_bracketed_word_wherever_it_stands(before: list[str], mode: str, after: list[str],
                                                           space: str) -> None:
    text = space.join([*before, f"[{mode}]", *after]) + "\n"
    assert thp_mode(text) == mode


@given(st.lists(WORDS, max_size=6))
def test_a_text_without_a_bracketed_word_has_no_mode(words: list[str]) -> None:
    assert thp_mode(" ".join(words)) is None
    assert thp_mode(" ".join(f"[{w}" for w in words)) is None  # half a bracket is no selection


def test_a_mode_file_as_the_kernel_writes_it_is_read(tmp_path: Path) -> None:
    enabled = tmp_path / "enabled"
    enabled.write_bytes(b"always [madvise] never\n")
    assert read_thp_mode(enabled) == "madvise"
    enabled.write_bytes(b"[always] madvise never\n")
    assert read_thp_mode(enabled) == "always"


def test_a_mode_file_that_is_a_folder_or_not_ascii_gives_no_mode(tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    assert read_thp_mode(tmp_path / "folder") is None
    (tmp_path / "binary").write_bytes(b"always [madvise\xff] never\n")
    assert read_thp_mode(tmp_path / "binary") is None


def test_this_machines_mode_is_one_the_kernel_knows_or_none() -> None:
    mode = read_thp_mode()
    assert mode in ("always", "madvise", "never", None)
    if not THP_MODE_FILE.exists():
        assert mode is None


@given(environments, MODES)
def test_the_environment_made_keeps_what_the_user_set_and_only_adds(environ: dict[str, str],
                                                                     thp: str | None) -> None:
    original = dict(environ)
    made = runtime_env(environ, thp)
    assert environ == original and made is not environ  # the caller's mapping is left alone
    assert set(original) <= set(made) and set(made) - set(original) <= {"OPENBLAS_NUM_THREADS", "GLIBC_TUNABLES"}
    for name, value in original.items():
        if name == "GLIBC_TUNABLES":
            assert made[name].startswith(value)  # other tunables stay, in their order
        else:
            assert made[name] == value
    assert "OPENBLAS_NUM_THREADS" in made


@given(environments, MODES)
def test_huge_pages_are_asked_for_exactly_when_the_kernel_gives_them_on_request_and_none_is_set(
        environ: dict[str, str], thp: str | None) -> None:
    made = runtime_env(environ, thp)
    before = environ.get("GLIBC_TUNABLES", "")
    added = made.get("GLIBC_TUNABLES", "") != before
    assert added == (thp == "madvise" and HUGEPAGE_TUNABLE not in before)
    if added:  # after the user's tunables, with no empty entry
        assert made["GLIBC_TUNABLES"] == (f"{before}:" if before else "") + f"{HUGEPAGE_TUNABLE}=1"


@given(environments, MODES)
def test_made_again_the_environment_does_not_change(environ: dict[str, str], thp: str | None) -> None:
    once = runtime_env(environ, thp)
    assert runtime_env(once, thp) == once
