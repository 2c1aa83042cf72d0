"""systemd service notifications (``sd_notify``), standard library only.

The agent runs as a ``Type=notify`` unit with ``WatchdogSec=``. systemd passes two things
in the environment:

* ``NOTIFY_SOCKET``: the datagram socket to send ``READY=1``, ``STATUS=...``,
  ``STOPPING=1`` and ``WATCHDOG=1`` to. A leading ``@`` names an abstract socket.
* ``WATCHDOG_USEC`` / ``WATCHDOG_PID``: the watchdog timeout; a service should ping at
  about half of it. ``WATCHDOG_PID`` names the process the watchdog is meant for.

Nothing here ever raises into the caller: a failed send is logged once as a warning and
reported by a ``False`` return value, because losing a status line must never take the
agent down. The watchdog pings come from :func:`run_watchdog`, a coroutine scheduled on
the agent's own event loop, so a loop that is blocked stops the pings and systemd
restarts the service.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)

__all__ = ["SystemdNotifier", "format_status", "run_watchdog", "watchdog_interval_s"]

# STATUS= is shown by `systemctl status`; keep it to one readable line.
MAX_STATUS_CHARS = 200


def _socket_address(raw: str) -> str | None:
    """Turn ``$NOTIFY_SOCKET`` into an address for ``sendto`` (``None`` if unusable)."""
    if not raw:
        return None
    if raw.startswith("@"):
        return "\0" + raw[1:]
    if raw.startswith("/"):
        return raw
    return None  # vsock / relative addresses are not used by service units


def _field_line(key: str, value: object) -> str:
    name = key.upper()
    if not name or not all(ch.isalnum() or ch == "_" for ch in name):
        raise ValueError(f"invalid notification field name: {key!r}")
    if isinstance(value, bool):
        text = "1" if value else "0"
    else:
        text = str(value)
    # One field per line: a newline inside a value would start a bogus field.
    text = " ".join(text.splitlines())
    return f"{name}={text}"


def encode_fields(fields: Mapping[str, object]) -> bytes:
    """Encode ``{"ready": 1, "status": "x"}`` as ``b"READY=1\\nSTATUS=x"`` (pure)."""
    return "\n".join(_field_line(key, value) for key, value in fields.items()).encode("utf-8")


def format_status(
    state: str,
    *,
    model: str | None = None,
    layers: tuple[int, int] | None = None,
    peers: int | None = None,
    detail: str | None = None,
) -> str:
    """One ``STATUS=`` line, e.g. ``serving smollm2-135m on layers 0–14 · 3 peers`` (pure).

    ``layers`` is the inclusive range of layers this node holds.
    """
    text = state
    if model:
        text += f" {model}"
    if layers is not None:
        first, last = layers
        text += f" on layers {first}–{last}"
    extras = []
    if peers is not None:
        extras.append(f"{peers} peer" + ("" if peers == 1 else "s"))
    if detail:
        extras.append(detail)
    if extras:
        text += " · " + " · ".join(extras)
    if len(text) > MAX_STATUS_CHARS:
        text = text[: MAX_STATUS_CHARS - 1] + "…"
    return text


def watchdog_interval_s(environ: Mapping[str, str] | None = None, *, pid: int | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings: half of ``$WATCHDOG_USEC``.

    ``None`` when no watchdog is configured, when the value is malformed, or when
    ``$WATCHDOG_PID`` names another process.
    """
    env = os.environ if environ is None else environ
    raw = env.get("WATCHDOG_USEC", "").strip()
    if not raw:
        return None
    try:
        usec = int(raw)
    except ValueError:
        log.warning("ignoring malformed WATCHDOG_USEC=%r", raw)
        return None
    if usec <= 0:
        return None
    owner = env.get("WATCHDOG_PID", "").strip()
    if owner:
        try:
            owner_pid = int(owner)
        except ValueError:
            log.warning("ignoring malformed WATCHDOG_PID=%r", owner)
            return None
        if owner_pid != (os.getpid() if pid is None else pid):
            return None
    return usec / 2_000_000


class SystemdNotifier:
    """Sends notifications to systemd's notification socket."""

    def __init__(self, address: str) -> None:
        target = _socket_address(address)
        if target is None:
            raise ValueError(f"unsupported NOTIFY_SOCKET address: {address!r}")
        self.address = address
        self._target = target
        self._sock: socket.socket | None = None
        self._warned = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SystemdNotifier | None:
        """The notifier for ``$NOTIFY_SOCKET``, or ``None`` when not run by systemd."""
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET", "")
        if _socket_address(raw) is None:
            if raw:
                log.warning("ignoring unsupported NOTIFY_SOCKET=%r", raw)
            return None
        return cls(raw)

    def notify(self, **fields: object) -> bool:
        """Send ``KEY=value`` lines; ``True`` when the datagram was sent."""
        if not fields:
            return True
        try:
            payload = encode_fields(fields)
        except ValueError as error:
            log.warning("not sending systemd notification: %s", error)
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload, self._target)
        except OSError as error:
            if not self._warned:
                log.warning("cannot notify systemd at %s: %s", self.address, error)
                self._warned = True
            else:
                log.debug("cannot notify systemd at %s: %s", self.address, error)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """``READY=1``: the API listens and the node is advertised."""
        return self.notify(ready=1, **({"status": status} if status else {}))

    def status(self, text: str) -> bool:
        """``STATUS=...``: what the agent is doing, shown by ``systemctl status``."""
        return self.notify(status=text)

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``: a clean shutdown has begun."""
        return self.notify(stopping=1, **({"status": status} if status else {}))

    def reloading(self) -> bool:
        return self.notify(reloading=1)

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: the event loop is alive."""
        return self.notify(watchdog=1)

    def extend_timeout(self, seconds: float) -> bool:
        """``EXTEND_TIMEOUT_USEC=``: ask for more time to start or stop."""
        return self.notify(extend_timeout_usec=int(seconds * 1_000_000))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> SystemdNotifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def run_watchdog(notifier: SystemdNotifier | None, interval_s: float | None) -> None:
    """Ping ``WATCHDOG=1`` every ``interval_s`` from the running event loop until cancelled.

    Run it as a task on the agent's own loop (``asyncio.create_task(run_watchdog(...))``):
    when that loop is blocked the pings stop and systemd restarts the unit. Returns at
    once when there is no notifier or no watchdog.
    """
    if notifier is None or interval_s is None:
        return
    if interval_s <= 0:
        raise ValueError("watchdog interval must be positive")
    while True:
        notifier.watchdog()
        await asyncio.sleep(interval_s)
