"""agent.local.files: a file written whole, with its mode from the first byte (whatever the
umask), replacing the old one by a rename (a reader holding the old file reads it whole);
a write that fails (bad data, a file size limit hit half-way, a directory in the way) leaves
the old file as it was and no temporary file behind; the group comes from the caller (as
root) or from the file replaced, and a group the writer cannot give makes the file the owner's
only. ``write_private`` is 0600 whatever the file had."""

from __future__ import annotations

import grp
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.local.files import write_atomic, write_private

REPO = Path(__file__).resolve().parents[3]
NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to own files of other groups)")


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def leftovers(folder: Path, *keep: str) -> list[str]:
    """Names in ``folder`` besides ``keep``: a temporary file left behind would show here."""
    return sorted(name for name in os.listdir(folder) if name not in keep)


@pytest.fixture
def nobodys_folder() -> Iterator[Path]:
    """A folder of user nobody that nobody can reach: in the system's temporary folder (pytest's
    ``tmp_path`` lies under folders only root may enter), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="ncm-test-files-"))
    try:
        if not all(os.stat(parent).st_mode & stat.S_IXOTH for parent in folder.parents):
            pytest.skip(f"other users cannot reach {folder.parent}")
        os.chown(folder, NOBODY, NOBODY)
        yield folder
    finally:
        shutil.rmtree(folder)


def as_other_user(work: Callable[[], None], folder: Path) -> int:
    """Run ``work`` in a forked child that changed into ``folder`` and then became nobody (uid and
    gid 65534, no other groups): its exit status (0: ``work`` returned, 1: it raised)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.chdir(folder)  # before giving up root: the folders above may not be nobody's to enter
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            work()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_new_file_gets_its_content_and_mode_and_its_folders(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "settings.toml"
    write_atomic(target, "port = 9000\nname = \"grenier\"\n", mode=0o644)
    assert target.read_text(encoding="utf-8") == "port = 9000\nname = \"grenier\"\n"
    assert mode_of(target) == 0o644
    assert leftovers(target.parent, "settings.toml") == []


def test_text_is_written_as_utf8_and_bytes_as_they_are(tmp_path: Path) -> None:
    write_atomic(tmp_path / "text", "grenier é ✓")
    assert (tmp_path / "text").read_bytes() == "grenier é ✓".encode()
    write_atomic(tmp_path / "raw", b"\x00\xff\xfe binary")
    assert (tmp_path / "raw").read_bytes() == b"\x00\xff\xfe binary"


def test_the_default_mode_is_the_owners_only(tmp_path: Path) -> None:
    write_atomic(tmp_path / "default", b"x")
    assert mode_of(tmp_path / "default") == 0o600


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=4096), mode=st.integers(0o400, 0o777))
def test_any_content_and_mode_are_what_the_file_ends_with(tmp_path: Path, data: bytes, mode: int) -> None:
    target = tmp_path / "property"
    write_atomic(target, data, mode=mode)
    assert target.read_bytes() == data and mode_of(target) == mode
    assert leftovers(tmp_path, "property") == []


def test_the_mode_does_not_depend_on_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o077)
    try:
        write_atomic(tmp_path / "shared", b"x", mode=0o644)
    finally:
        os.umask(previous)
    assert mode_of(tmp_path / "shared") == 0o644


def test_the_new_file_replaces_the_old_by_a_rename_and_a_reader_of_the_old_reads_it_whole(tmp_path: Path) -> None:
    target = tmp_path / "cluster-key"
    write_atomic(target, b"old " * 1000)
    old_inode = target.stat().st_ino
    with target.open("rb") as reader:
        assert reader.read(4) == b"old "
        write_atomic(target, b"new " * 10)
        assert reader.read() == b"old " * 999  # the old file, not a mix of both
    assert target.read_bytes() == b"new " * 10
    assert target.stat().st_ino != old_inode  # a new file renamed into place, not the old one truncated
    assert leftovers(tmp_path, "cluster-key") == []


def test_replacing_a_file_gives_the_new_one_the_mode_asked_for(tmp_path: Path) -> None:
    target = tmp_path / "node-id"
    write_atomic(target, b"a", mode=0o600)
    write_atomic(target, b"b", mode=0o644)
    assert mode_of(target) == 0o644
    write_atomic(target, b"c", mode=0o640)
    assert mode_of(target) == 0o640


def test_data_that_cannot_be_encoded_leaves_the_old_file_and_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "agent.toml"
    write_atomic(target, "port = 9000\n", mode=0o644)
    with pytest.raises(UnicodeEncodeError):
        write_atomic(target, "name = \"\ud800\"\n")  # a lone surrogate: not UTF-8
    assert target.read_text() == "port = 9000\n" and mode_of(target) == 0o644
    assert leftovers(tmp_path, "agent.toml") == []


def test_a_write_cut_by_the_file_size_limit_leaves_the_old_file_whole(tmp_path: Path) -> None:
    """A real short write: the child process may write at most 64 KiB per file (as on a full
    disk, the write fails part of the way); the old file stays, the partial one is removed."""
    target = tmp_path / "model.json"
    write_atomic(target, b"{\"old\": true}\n")
    child = (
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "from agent.local.files import write_atomic\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        "try:\n"
        "    write_atomic(Path(sys.argv[1]), b'x' * 1_000_000)\n"
        "except OSError as error:\n"
        "    sys.stdout.write(f'{type(error).__name__} {error.errno}')\n"
    )
    result = subprocess.run([sys.executable, "-c", child, str(target)], capture_output=True, text=True, timeout=60,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["OSError", "27"]  # EFBIG: File too large
    assert target.read_bytes() == b"{\"old\": true}\n"
    assert leftovers(tmp_path, "model.json") == []


def test_a_directory_in_the_way_is_an_error_and_stays_as_it_was(tmp_path: Path) -> None:
    (tmp_path / "taken" / "inside").mkdir(parents=True)
    with pytest.raises(IsADirectoryError):
        write_atomic(tmp_path / "taken", b"data")
    assert (tmp_path / "taken" / "inside").is_dir()
    assert leftovers(tmp_path, "taken") == []


def test_a_private_file_is_the_owners_only_even_where_the_old_one_was_readable(tmp_path: Path) -> None:
    target = tmp_path / "api-token"
    write_atomic(target, b"old", mode=0o644)
    write_private(target, "s3cret-token\n")
    assert target.read_text() == "s3cret-token\n" and mode_of(target) == 0o600
    write_private(tmp_path / "fresh" / "key.pem", b"-----BEGIN-----")
    assert mode_of(tmp_path / "fresh" / "key.pem") == 0o600


@root_only
def test_as_root_the_group_asked_for_owns_the_file_with_the_mode_asked_for(tmp_path: Path) -> None:
    group = next((g for g in grp.getgrall() if g.gr_gid != os.getegid()), None)
    if group is None:
        pytest.skip("this system has a single group")
    target = tmp_path / "shared.toml"
    write_atomic(target, b"x", mode=0o640, group=group.gr_name)
    assert target.stat().st_gid == group.gr_gid and mode_of(target) == 0o640


@root_only
def test_as_root_a_group_that_does_not_exist_leaves_the_file_to_its_owner_only(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    target = tmp_path / "shared.toml"
    with caplog.at_level(logging.WARNING, logger="agent.local.files"):
        write_atomic(target, b"x", mode=0o640, group="ncm-no-such-group")
    assert mode_of(target) == 0o600 and target.stat().st_gid == os.getegid()
    assert "group ncm-no-such-group does not exist" in caplog.text


@root_only
def test_the_new_file_keeps_the_group_of_the_file_it_replaces(tmp_path: Path) -> None:
    target = tmp_path / "agent.toml"
    target.write_bytes(b"old")
    os.chown(target, -1, 4242)  # given to an operator group by hand
    write_atomic(target, b"new", mode=0o640)
    assert target.read_bytes() == b"new"
    assert target.stat().st_gid == 4242 and mode_of(target) == 0o640


@root_only
def test_a_group_the_writer_cannot_give_makes_the_new_file_its_owners_only(nobodys_folder: Path) -> None:
    """The agent runs as a user; the file it replaces belongs to a group that user is not in
    (set up by root): the new file cannot keep that group, so it is readable by the user only."""
    folder = nobodys_folder
    old = folder / "agent.toml"
    old.write_bytes(b"old")
    os.chown(old, NOBODY, 4242)
    old.chmod(0o640)

    status = as_other_user(lambda: write_atomic(Path("agent.toml"), b"new", mode=0o640), folder)
    assert status == 0
    assert old.read_bytes() == b"new"
    assert old.stat().st_uid == NOBODY and old.stat().st_gid == NOBODY and mode_of(old) == 0o600
    assert leftovers(folder, "agent.toml") == []


def test_a_user_that_is_not_root_keeps_its_own_group_whatever_group_is_asked_for(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    def write() -> None:
        write_atomic(Path("shared.toml"), b"x", mode=0o640, group="root")

    if os.geteuid() == 0:
        folder = request.getfixturevalue("nobodys_folder")
        assert as_other_user(write, folder) == 0
        expected_gid = NOBODY
    else:
        folder = tmp_path
        previous = os.getcwd()
        os.chdir(folder)
        try:
            write()
        finally:
            os.chdir(previous)
        expected_gid = os.getegid()
    written = folder / "shared.toml"
    assert written.read_bytes() == b"x"
    assert written.stat().st_gid == expected_gid and mode_of(written) == 0o640
