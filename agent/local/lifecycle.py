"""How the agent's process ends: stopped by a signal, or restarted in place (a join, a new key)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass
class Lifecycle:
    """How the service ends: ``stop`` set by a signal (or a join), ``restart`` to start again."""

    stop: asyncio.Event
    restart: bool = False

    def restart_now(self) -> None:
        """Stop (requests in flight finish first) and start again in the same process."""
        self.restart = True
        self.stop.set()
