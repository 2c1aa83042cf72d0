"""Test deadlines that follow what they wait for on the machine at hand: a wait's timeout is
what it needs on a quiet machine, stretched by how busy the machine is while it waits (the
load average per core, never below 1, at most MAX_STRETCH). CI may run under load: a test
fails for what it waits for, not for the machine's neighbours."""

from __future__ import annotations

import os
import time

MAX_STRETCH = 8.0


def busy_factor() -> float:
    """The runnable processes per core over the last minute, at least 1 and at most MAX_STRETCH."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this system
        return 1.0
    return min(MAX_STRETCH, max(1.0, load / (os.cpu_count() or 1)))


class Deadline:
    """``timeout_s`` from now, stretched by the busiest the machine has been since."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.started = time.monotonic()
        self.stretch = busy_factor()

    def expired(self) -> bool:
        self.stretch = max(self.stretch, busy_factor())
        return time.monotonic() - self.started > self.timeout_s * self.stretch

    def describe(self) -> str:
        waited = time.monotonic() - self.started
        return f"{waited:.0f} s ({self.timeout_s:g} s stretched x{self.stretch:.1f} for the machine's load)"
