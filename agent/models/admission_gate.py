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
            self._wake(self.admission.leave(ticket, now=time.monotonic()))

    def set_in_flight(self, name: str, max_requests_in_flight: int) -> None:
        """``name`` runs at most ``max_requests_in_flight`` requests at once from now on; the
        waiting requests a higher count admits go on."""
        self._wake(self.admission.set_in_flight(name, max_requests_in_flight, now=time.monotonic()))

    def _wake(self, tickets: list[AdmissionTicket]) -> None:
        for ticket in tickets:
            waiting = self._admitted.pop(ticket, None)
            if waiting is not None and not waiting.done():
                waiting.set_result(None)
