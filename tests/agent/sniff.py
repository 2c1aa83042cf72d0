"""A packet capture of the loopback interface (AF_PACKET, needs root): the TCP payloads that
cross it while the capture runs, with their ports. For checking what travels in clear."""

from __future__ import annotations

import select
import socket
import struct
import threading
from dataclasses import dataclass, field

ETH_P_ALL = 0x0003
ETHERNET_HEADER = 14


@dataclass
class LoopbackCapture:
    """``with LoopbackCapture() as capture: ...`` then ``capture.segments``."""

    segments: list[tuple[int, int, bytes]] = field(default_factory=list)  # (source port, dest port, payload)

    def __enter__(self) -> LoopbackCapture:
        self._socket = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(ETH_P_ALL))
        self._socket.bind(("lo", 0))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._socket.close()

    def _read(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._socket], [], [], 0.1)
            if not ready:
                continue
            frame = self._socket.recv(262144)
            ip = frame[ETHERNET_HEADER:]
            if len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != socket.IPPROTO_TCP:
                continue
            tcp = ip[(ip[0] & 0x0F) * 4:]
            if len(tcp) < 20:
                continue
            source, destination = struct.unpack("!HH", tcp[:4])
            payload = tcp[(tcp[12] >> 4) * 4:]
            if payload:
                self.segments.append((source, destination, bytes(payload)))

    def ports_carrying(self, needle: bytes) -> set[int]:
        """The ports of every segment whose payload holds ``needle``."""
        return {port for source, destination, payload in self.segments if needle in payload
                for port in (source, destination)}
