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
class EarlyBuild:
    """``image/build debian-generic --arch arm64 --rootfs-only`` running in ``base``."""

    process: subprocess.Popen[bytes]
    base: Path  # out/ (the root file system), work/ (the build cache), build.log
    started_s: float

    @property
    def out(self) -> Path:
        return self.base / "out"

    def wait(self, timeout_s: float) -> tuple[float, str]:
        """(seconds since it started, its log) once it ended; pytest.fail when it failed."""
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            code = None
        seconds = time.monotonic() - self.started_s
        log = (self.base / "build.log").read_text(errors="replace")
        if code != 0:
            pytest.fail(f"image/build (arm64 root file system) failed ({code}) after {seconds:.0f} s:\n{log[-6000:]}")
        return seconds, log

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the build and the chroot commands it runs
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


ARM64_BUILD = pytest.StashKey[EarlyBuild]()


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly or not any(
            "arm64_rootfs" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    if os.geteuid() != 0 or not ARM64_BINFMT.exists() or shutil.which("mmdebstrap") is None:
        return  # the fixture skips or fails with the reason
    base = Path(tempfile.mkdtemp(prefix="ncm-arm64-rootfs-"))
    with (base / "build.log").open("wb") as log:
        process = subprocess.Popen(
            ["bash", str(BUILD), "debian-generic", "--out", str(base / "out"), "--work", str(base / "work"),
             "--arch", "arm64", "--rootfs-only"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "PYTHON": sys.executable})
    session.config.stash[ARM64_BUILD] = EarlyBuild(process, base, time.monotonic())


def pytest_sessionfinish(session: pytest.Session) -> None:
    early = session.config.stash.get(ARM64_BUILD, None)
    if early is not None:
        early.stop()
        shutil.rmtree(early.base, ignore_errors=True)  # gigabytes
