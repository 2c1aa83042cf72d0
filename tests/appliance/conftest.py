"""The arm64 root file system (image/build under qemu-user: about ten minutes, one core) starts
building as soon as the session knows that a selected test needs it, and builds alongside the
tests that run before that one instead of after them; the ``arm64_rootfs`` fixture waits for
it. Where the machine cannot build it, nothing starts and the fixture says why."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "image" / "build"
ARM64_BINFMT = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")


@dataclass
class ImageBuild:
    """``image/build debian-generic --out OUT --work WORK ARGS...`` running, its output in
    OUT/build-ARGS.log."""

    process: subprocess.Popen[bytes]
    out: Path
    log_path: Path
    started_s: float

    @classmethod
    def start(cls, out: Path, work: Path, *args: str) -> ImageBuild:
        out.mkdir(parents=True, exist_ok=True)
        log_path = out / f"build-{'-'.join(a.strip('-') for a in args)}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                ["bash", str(BUILD), "debian-generic", "--out", str(out), "--work", str(work), *args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "PYTHON": sys.executable})
        return cls(process, out, log_path, time.monotonic())

    def wait(self, timeout_s: float) -> tuple[float, str]:
        """(seconds since it started, its log) once it ended; pytest.fail when it failed."""
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            code = None
        seconds = time.monotonic() - self.started_s
        log = self.log_path.read_text(errors="replace")
        if code != 0:
            pytest.fail(f"image/build failed ({code}) after {seconds:.0f} s:\n{log[-6000:]}")
        return seconds, log

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the build and the chroot commands it runs
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


ARM64_BUILD = pytest.StashKey[ImageBuild]()


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly or not any(
            "arm64_rootfs" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    if os.geteuid() != 0 or not ARM64_BINFMT.exists() or shutil.which("mmdebstrap") is None:
        return  # the fixture skips or fails with the reason
    base = Path(tempfile.mkdtemp(prefix="ncm-arm64-rootfs-"))
    session.config.stash[ARM64_BUILD] = ImageBuild.start(base / "out", base / "work", "--arch", "arm64",
                                                         "--rootfs-only")


def pytest_sessionfinish(session: pytest.Session) -> None:
    early = session.config.stash.get(ARM64_BUILD, None)
    if early is not None:
        early.stop()
        shutil.rmtree(early.out.parent, ignore_errors=True)  # gigabytes
