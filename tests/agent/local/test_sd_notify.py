"""agent.local.sd_notify against a real AF_UNIX datagram notification socket."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.local import sd_notify
from agent.local.sd_notify import SystemdNotifier, format_status, run_watchdog, watchdog_interval_s


class NotifySocket:
    """The receiving end, as systemd holds it."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)

    def receive(self, timeout: float = 5.0) -> dict[str, str]:
        self.sock.settimeout(timeout)
        data = self.sock.recv(4096).decode()
        return dict(line.split("=", 1) for line in data.split("\n"))

    def nothing_within(self, seconds: float) -> bool:
        self.sock.settimeout(seconds)
        try:
            self.sock.recv(4096)
        except TimeoutError:
            return True
        return False

    def drain(self) -> int:
        self.sock.setblocking(False)
        count = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                self.sock.recv(4096)
                count += 1
        return count

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NotifySocket]:
    if request.param == "path":
        address = str(tmp_path / "notify")
    else:
        address = f"@ncm-test-{uuid.uuid4().hex}"
    receiver = NotifySocket(address)
    yield receiver
    receiver.close()


def test_from_env_is_none_without_systemd() -> None:
    assert SystemdNotifier.from_env({}) is None
    assert SystemdNotifier.from_env({"NOTIFY_SOCKET": ""}) is None
    assert SystemdNotifier.from_env({"NOTIFY_SOCKET": "relative/path"}) is None


def test_messages_reach_the_socket(notify_socket: NotifySocket) -> None:
    notifier = SystemdNotifier.from_env({"NOTIFY_SOCKET": notify_socket.address})
    assert notifier is not None
    with notifier:
        assert notifier.ready(status="serving smollm2-135m")
        assert notify_socket.receive() == {"READY": "1", "STATUS": "serving smollm2-135m"}
        assert notifier.status("discovering\npeers")
        assert notify_socket.receive() == {"STATUS": "discovering peers"}
        assert notifier.watchdog()
        assert notify_socket.receive() == {"WATCHDOG": "1"}
        assert notifier.extend_timeout(2.5)
        assert notify_socket.receive() == {"EXTEND_TIMEOUT_USEC": "2500000"}
        assert notifier.stopping()
        assert notify_socket.receive() == {"STOPPING": "1"}


def test_a_missing_socket_only_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    notifier = SystemdNotifier(str(tmp_path / "gone"))
    assert notifier.ready() is False
    assert notifier.watchdog() is False
    assert notifier.notify(**{"bad key": 1}) is False
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2  # one for the socket (not repeated), one for the bad field
    notifier.close()


def test_watchdog_interval_is_half_the_timeout() -> None:
    pid = os.getpid()
    assert watchdog_interval_s({}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(pid)}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(pid + 1)}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "soon"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "10", "WATCHDOG_PID": "x"}) is None


def test_format_status() -> None:
    assert format_status("discovering") == "discovering"
    assert format_status("serving", model="smollm2-135m", layers=(0, 14), peers=2) == (
        "serving smollm2-135m on layers 0–14 · 2 peers"
    )
    assert format_status("degraded", model="ncm-tiny", peers=1, detail="node b lost") == (
        "degraded ncm-tiny · 1 peer · node b lost"
    )
    assert len(format_status("x" * 500)) == sd_notify.MAX_STATUS_CHARS


def test_run_watchdog_without_notifier_returns() -> None:
    asyncio.run(run_watchdog(None, 1.0))
    asyncio.run(run_watchdog(SystemdNotifier("/nonexistent"), None))


class LoopThread:
    """An event loop running in a thread, standing in for the agent's loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


def test_watchdog_pings_from_the_loop_and_stop_when_it_is_blocked(notify_socket: NotifySocket) -> None:
    interval = 0.05
    notifier = SystemdNotifier(notify_socket.address)
    runner = LoopThread()
    release = threading.Event()
    try:
        task = asyncio.run_coroutine_threadsafe(run_watchdog(notifier, interval), runner.loop)
        # Pings keep coming while the loop runs.
        for _ in range(3):
            assert notify_socket.receive(timeout=5) == {"WATCHDOG": "1"}

        # A stuck loop: a callback that blocks it until the test releases it.
        blocked = threading.Event()

        def hang() -> None:
            blocked.set()
            release.wait(timeout=30)

        runner.loop.call_soon_threadsafe(hang)
        assert blocked.wait(timeout=5)
        notify_socket.drain()  # a ping may have been sent just before the hang began
        assert notify_socket.nothing_within(interval * 10), "watchdog pinged while the loop was blocked"

        release.set()
        assert notify_socket.receive(timeout=5) == {"WATCHDOG": "1"}

        task.cancel()
        deadline = time.monotonic() + 5
        while not task.done() and time.monotonic() < deadline:
            notify_socket.nothing_within(interval)
        assert task.cancelled()
        notify_socket.drain()
        assert notify_socket.nothing_within(interval * 5), "watchdog pinged after it was cancelled"
    finally:
        release.set()
        runner.stop()
        notifier.close()
