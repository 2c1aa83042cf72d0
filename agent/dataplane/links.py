"""Persistent links between nodes: one WebSocket per (this node, other node) carrying steps,
closes, results and failures one way and pings both ways, shared by every request; and the
results and failures stages send straight to the orchestrator (:class:`Replies`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import aiohttp
import numpy as np

from agent.cluster.peer_client import PeerClient, PeerError
from agent.core.errors import NcmError, PublicAnswer, WireError, without_addresses
from agent.core.protocol import STREAM_PATH, ErrorFrame, PingFrame, PongFrame, ResultFrame, StepFrame
from agent.core.wire import decode_frame, encode_frame
from agent.local.compat import timeout

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 5.0
SILENCE_S = 1.5  # a step's result this late: the route's stages are pinged; one that does not answer this soon is frozen
SEND_TIMEOUT_S = 30.0  # a frame the peer's socket does not take in this long: the peer is frozen


class StageError(NcmError):
    """A stage could not run a step. ``node`` is the node that failed (None: the caller's fault)."""

    def __init__(self, code: str, message: str, node: str | None) -> None:
        super().__init__(message)
        self.code = code
        self.node = node

    def answer(self) -> PublicAnswer:
        """A caller's bad step is a 400; a stage that failed is a 503 worth retrying soon (the
        route fails over). Node addresses are never shown."""
        message = without_addresses(str(self))
        if self.node is None and self.code == "bad_request":
            return PublicAnswer(400, self.code, message)
        return PublicAnswer(503, self.code, f"{message} (retry in a moment)", retry_after_s=2.0)

    def frame(self, step: StepFrame) -> ErrorFrame:
        """The error frame of ``step``."""
        return ErrorFrame(step.sid, step.seq, self.code, str(self), self.node)

    @classmethod
    def of(cls, frame: ErrorFrame) -> StageError:
        """The error an error frame tells of."""
        return cls(frame.code, frame.message, frame.node)


class StageLink:
    """A WebSocket to one peer's data plane, reconnected on demand."""

    def __init__(self, client: PeerClient, node_id: str, url: str,
                 on_lost: Callable[[str], None] = lambda node_id: None) -> None:
        self.client = client
        self._on_lost = on_lost  # told the node id each time a connection to it ends
        self.node_id = node_id
        self.url = url
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pongs: dict[int, asyncio.Future[None]] = {}  # by the cid of the ping they answer
        self._next_cid = 0
        self._connect_lock = asyncio.Lock()

    async def connect(self) -> None:
        """Open the link now (it opens on first use otherwise); a :class:`StageError` when the
        peer is unreachable."""
        await self._connection()

    async def _connection(self) -> aiohttp.ClientWebSocketResponse:
        async with self._connect_lock:
            if self._ws is None or self._ws.closed:
                try:
                    self._ws = await self.client.ws_connect(self.url, STREAM_PATH, target=self.node_id,
                                                          timeout_s=CONNECT_TIMEOUT_S)
                except PeerError as error:
                    raise StageError("stage_unreachable", f"node {self.node_id} is unreachable: {error}", self.node_id) from None
                self._reader = asyncio.create_task(self._read(self._ws), name=f"link-reader-{self.node_id}")
            return self._ws

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        try:
            async for message in ws:
                if message.type != aiohttp.WSMsgType.BINARY:
                    continue
                try:
                    header, _ = decode_frame(message.data)
                except WireError as error:
                    log.warning("bad frame from %s: %s", self.node_id, error)
                    continue
                pong = self._pongs.pop(PongFrame.from_header(header).cid, None) if header["kind"] == "pong" else None
                if pong is not None and not pong.done():
                    pong.set_result(None)
        finally:
            self._on_lost(self.node_id)
            failure = StageError("stage_unreachable", f"connection to node {self.node_id} was lost", self.node_id)
            for pong in self._pongs.values():
                if not pong.done():
                    pong.set_exception(failure)
            self._pongs.clear()

    async def post(self, header: dict[str, Any], tensor: np.ndarray | None = None) -> None:
        """Send a frame that nothing answers on this link (a step naming its reply node, a
        result or failure sent to it, a close); a :class:`StageError` when the peer cannot take it."""
        try:
            ws = await self._connection()
            async with timeout(SEND_TIMEOUT_S):
                await ws.send_bytes(encode_frame(header, tensor))
        except asyncio.TimeoutError:
            raise StageError("stage_timeout", f"node {self.node_id} took no frame for {SEND_TIMEOUT_S:g} s",
                             self.node_id) from None
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as error:
            raise StageError("stage_unreachable", f"node {self.node_id}: {error}", self.node_id) from None

    async def send(self, header: dict[str, Any]) -> None:
        """:meth:`post`, a failure only logged (a close: the peer frees idle sessions itself)."""
        try:
            await self.post(header)
        except StageError as error:
            log.debug("could not send %s to %s: %s", header["kind"], self.node_id, error)

    async def ping(self, timeout_s: float) -> None:
        """A :class:`StageError` unless the peer answers a ping within ``timeout_s``."""
        ws = await self._connection()
        self._next_cid += 1
        key = self._next_cid
        pong: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pongs[key] = pong
        try:
            async with timeout(timeout_s):
                await ws.send_bytes(encode_frame(PingFrame(key).header()))
                await pong
        except asyncio.TimeoutError:
            raise StageError("stage_timeout", f"node {self.node_id} did not answer a ping within {timeout_s:g} s "
                             "(frozen or gone)", self.node_id) from None
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as error:
            raise StageError("stage_unreachable", f"node {self.node_id}: {error}", self.node_id) from None
        finally:
            self._pongs.pop(key, None)

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass


class Replies:
    """The steps this node (as orchestrator) awaits: a future per (session, step), settled by
    the first result or error frame a stage sends for it straight here."""

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, int], asyncio.Future[ResultFrame]] = {}

    def expect(self, sid: str, seq: int) -> asyncio.Future[ResultFrame]:
        future: asyncio.Future[ResultFrame] = asyncio.get_running_loop().create_future()
        self._waiting[(sid, seq)] = future
        return future

    def deliver(self, header: dict[str, Any]) -> None:
        """A result frame (the tail's) or an error frame (from the stage that saw the failure)
        settles the step awaiting it; one nobody awaits (any more) is dropped."""
        future = self._waiting.pop((header["sid"], header["seq"]), None)
        if future is None or future.done():
            return
        if header["kind"] == "error":
            future.set_exception(StageError.of(ErrorFrame.from_header(header)))
            return
        try:
            future.set_result(ResultFrame.from_header(header))
        except WireError as error:
            future.set_exception(StageError("bad_result", str(error), None))

    def forget(self, sid: str, seq: int) -> None:
        future = self._waiting.pop((sid, seq), None)
        if future is not None:
            future.cancel()


class Links:
    """The links this node keeps to the stages it forwards to."""

    def __init__(self, client: PeerClient) -> None:
        self.client = client
        self._links: dict[str, StageLink] = {}
        self._loss: asyncio.Future[str] | None = None

    def loss(self) -> asyncio.Future[str]:
        """Resolves with the node id of the next link whose connection ends (shared: never
        cancel it)."""
        if self._loss is None or self._loss.done():
            self._loss = asyncio.get_running_loop().create_future()
        return self._loss

    def _lost(self, node_id: str) -> None:
        if self._loss is not None and not self._loss.done():
            self._loss.set_result(node_id)

    async def get(self, node_id: str, url: str) -> StageLink:
        link = self._links.get(node_id)
        if link is not None and link.url != url:
            await link.close()
            link = None
        if link is None:
            link = self._links[node_id] = StageLink(self.client, node_id, url, self._lost)
        return link

    async def close(self) -> None:
        for link in list(self._links.values()):
            await link.close()
        self._links.clear()
