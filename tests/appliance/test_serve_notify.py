"""`ncm serve` talks to systemd as ncm-agent.service expects: READY=1 once /health answers,
STATUS= lines, WATCHDOG=1 at half of WATCHDOG_USEC, STOPPING=1 and exit 0 on SIGTERM.

The agent runs as a real process with a real AF_UNIX datagram socket as NOTIFY_SOCKET.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.appliance.vm import free_port, http_json
from tests.deadlines import Deadline

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # a real `ncm serve` process each: the end-to-end layer


def _receive_until(sock: socket.socket, wanted: str, deadline_s: float, seen: list[dict[str, str]]) -> dict[str, str]:
    deadline = Deadline(deadline_s)
    while True:
        if deadline.expired():
            raise AssertionError(f"no {wanted} within {deadline.describe()}; got {seen}")
        sock.settimeout(1.0)
        try:
            data = sock.recv(4096).decode()
        except TimeoutError:
            continue
        message = dict(line.split("=", 1) for line in data.split("\n") if "=" in line)
        seen.append(message)
        if wanted in message:
            return message


def test_serve_notifies_systemd(tmp_path: Path) -> None:
    address = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    port = free_port()
    env = {
        **os.environ,
        "NOTIFY_SOCKET": address,
        "WATCHDOG_USEC": "1000000",  # 1 s: the agent should ping about every 0.5 s
        "NCM_HOME": str(tmp_path / "home"),
        "PYTHONPATH": str(REPO),
    }
    env.pop("WATCHDOG_PID", None)
    command = [sys.executable, "-m", "agent.cli", "serve", "--port", str(port), "--host", "127.0.0.1",
               "--state-dir", str(tmp_path / "state"), "--no-mdns", "--cluster-name", "notify-test"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)
    seen: list[dict[str, str]] = []
    try:
        ready = _receive_until(sock, "READY", 120, seen)
        assert ready["READY"] == "1"
        # READY=1 promises that the API listens.
        health = http_json(f"http://127.0.0.1:{port}/health")
        assert health is not None and health[0] == 200 and health[1]["status"] == "ok"
        assert any("STATUS" in message for message in seen)

        first = _receive_until(sock, "WATCHDOG", 5, seen)
        assert first["WATCHDOG"] == "1"
        started = time.monotonic()
        for _ in range(3):
            _receive_until(sock, "WATCHDOG", 5, seen)
        interval = (time.monotonic() - started) / 3
        assert 0.2 < interval < 1.0, f"watchdog pings every {interval:.2f} s with WATCHDOG_USEC=1 s"

        process.send_signal(signal.SIGTERM)
        stopping = _receive_until(sock, "STOPPING", 30, seen)
        assert stopping["STOPPING"] == "1"
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        output = process.stdout.read().decode("utf-8", "replace") if process.stdout else ""
        sock.close()
    assert "Traceback" not in output, output


def test_serve_without_systemd_sends_nothing(tmp_path: Path) -> None:
    """No NOTIFY_SOCKET: the agent runs as a plain foreground program."""
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env.update(NCM_HOME=str(tmp_path / "home"), PYTHONPATH=str(REPO))
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "agent.cli", "serve", "--port", str(port), "--host", "127.0.0.1",
                                "--state-dir", str(tmp_path / "state"), "--no-mdns"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline = Deadline(120)
        while (answer := http_json(f"http://127.0.0.1:{port}/health", timeout=2)) is None:
            if process.poll() is not None:
                pytest.fail(process.stdout.read().decode() if process.stdout else "serve exited")
            assert not deadline.expired(), f"serve did not answer /health within {deadline.describe()}"
            time.sleep(0.2)
        assert answer[0] == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
