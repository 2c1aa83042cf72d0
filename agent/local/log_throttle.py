"""Warnings that strangers can cause at will (refused invites, unsigned internal requests,
dropped connections) are logged once, then summed up in one line per interval, so a flood
cannot grow the log without bound."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class ThrottledWarning:
    """``warn`` logs the first of its kind at once and counts the others; the next ``warn``
    after ``interval_s`` logs how many there were (and the latest) in one line."""

    def __init__(self, logger: logging.Logger, what: str, *, interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.what, self.interval_s, self.clock = logger, what, interval_s, clock
        self._since: float | None = None
        self._held = 0
        self._sources: set[str] = set()

    def warn(self, source: str, message: str) -> None:
        now = self.clock()
        if self._since is None or now - self._since >= self.interval_s:
            if self._held:
                self.logger.warning("%s: %d more in the last %.0f s from %d address(es); the latest from %s: %s",
                                    self.what, self._held, now - self._since, len(self._sources), source, message)
            else:
                self.logger.warning("%s from %s: %s", self.what, source, message)
            self._since, self._held, self._sources = now, 0, set()
            return
        self._held += 1
        if len(self._sources) < 1024:
            self._sources.add(source)
