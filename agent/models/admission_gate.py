"""The admission of inference requests, as the requests live it: the pure bookkeeping of
:mod:`agent.core.admission` (per model, a limit of requests in flight and a bounded FIFO queue)
with a future per queued request, set when its turn comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from agent.core.admission import Admission, AdmissionLimits, AdmissionTicket


class AdmissionGate:
    def __init__(self, limits: AdmissionLimits) -> None:
        self.admission = Admission(limits)
        self._admitted: dict[AdmissionTicket, asyncio.Future[None]] = {}  # queued requests, woken when admitted

    @contextlib.asynccontextmanager
    async def admit(self, name: str, client: str) -> AsyncIterator[None]:
        """Hold one of ``name``'s slots in flight for a request of ``client``, after waiting in
        its queue when every slot is busy or the client holds its share. A full queue (or the
        client's full share of it) raises TooManyRequestsError (429); a client that leaves
        while queued (its task is cancelled) gives up its place."""
        ticket = self.admission.arrive(name, now=time.monotonic(), client=client)
        try:
            if ticket.state == "queued":
                admitted = asyncio.get_running_loop().create_future()
                self._admitted[ticket] = admitted
                await admitted  # no deadline: the requests ahead are bounded by their own
            yield
        finally:
            self._admitted.pop(ticket, None)
            for next_ticket in self.admission.leave(ticket, now=time.monotonic()):
                waiting = self._admitted.pop(next_ticket, None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(None)
