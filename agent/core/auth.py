"""Signing of internal requests with the cluster key (HMAC-SHA256 over body + time + nonce).

Pure: the caller passes the current time and the nonce; :class:`ReplayGuard` remembers the
nonces it has seen inside the replay window.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping

from agent.core.errors import AuthError

HEADER_NODE = "X-Ncm-Node"
HEADER_TIMESTAMP = "X-Ncm-Timestamp"
HEADER_NONCE = "X-Ncm-Nonce"
HEADER_SIGNATURE = "X-Ncm-Signature"
REPLAY_WINDOW_S = 30.0
MAX_REMEMBERED_NONCES = 100_000


def _message(method: str, path: str, timestamp: str, nonce: str, body: bytes) -> bytes:
    return "\n".join((method.upper(), path, timestamp, nonce, hashlib.sha256(body).hexdigest())).encode()


def sign(key: bytes, method: str, path: str, body: bytes, *, now: float, nonce: str, node_id: str) -> dict[str, str]:
    """Headers that prove the sender holds ``key``."""
    timestamp = f"{now:.3f}"
    digest = hmac.new(key, _message(method, path, timestamp, nonce, body), hashlib.sha256).hexdigest()
    return {HEADER_NODE: node_id, HEADER_TIMESTAMP: timestamp, HEADER_NONCE: nonce, HEADER_SIGNATURE: digest}


@dataclass
class ReplayGuard:
    """Nonces seen within the replay window (bounded memory)."""

    window_s: float = REPLAY_WINDOW_S
    max_nonces: int = MAX_REMEMBERED_NONCES

    def __post_init__(self) -> None:
        self._seen: OrderedDict[str, float] = OrderedDict()

    def check_and_remember(self, nonce: str, timestamp: float, now: float) -> None:
        while self._seen and (next(iter(self._seen.values())) < now - self.window_s or len(self._seen) >= self.max_nonces):
            self._seen.popitem(last=False)
        if nonce in self._seen:
            raise AuthError("replayed request: this nonce was already used")
        self._seen[nonce] = max(timestamp, now)


def verify(
    key: bytes,
    method: str,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    now: float,
    guard: ReplayGuard,
) -> str:
    """Check a signed request; returns the sender's node id or raises AuthError."""
    try:
        node_id = headers[HEADER_NODE]
        timestamp = headers[HEADER_TIMESTAMP]
        nonce = headers[HEADER_NONCE]
        signature = headers[HEADER_SIGNATURE]
    except KeyError as missing:
        raise AuthError(f"missing {missing.args[0]} header: internal endpoints need the cluster key") from None
    if not (8 <= len(nonce) <= 64) or not nonce.isalnum():
        raise AuthError("malformed nonce")
    try:
        sent_at = float(timestamp)
    except ValueError:
        raise AuthError("malformed timestamp") from None
    if abs(now - sent_at) > guard.window_s:
        raise AuthError(f"request timestamp is {now - sent_at:+.1f} s off (clocks out of sync, or a replay)")
    expected = hmac.new(key, _message(method, path, timestamp, nonce, body), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, signature):
        raise AuthError("bad signature: the sender does not hold this cluster's key")
    guard.check_and_remember(nonce, sent_at, now)
    return node_id
