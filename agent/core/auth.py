"""Signing of internal requests and of their answers with the cluster key (HMAC-SHA256).

A request is signed over its method, its whole URL path and query, the node it is meant for
(so it cannot be replayed to another node), a timestamp, a nonce and its body. The answer is
signed over the request's nonce, the answering node, the status and the body, so a node
acts on no answer (a describe, an acknowledgement, a model listing) that a holder of the
cluster key did not give to that very request.

Pure: the caller passes the current time and the nonce; :class:`ReplayGuard` remembers the
nonces it has seen inside the replay window.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping

from agent.core.errors import AuthError, StaleRequestError

HEADER_NODE = "X-Ncm-Node"
HEADER_TARGET = "X-Ncm-Target"
HEADER_TIMESTAMP = "X-Ncm-Timestamp"
HEADER_NONCE = "X-Ncm-Nonce"
HEADER_SIGNATURE = "X-Ncm-Signature"
ANY_NODE = "*"
REPLAY_WINDOW_S = 30.0
MAX_REMEMBERED_NONCES = 100_000
STREAMED = "streamed"  # the body digest of an answer whose body is not known when its headers go out


def _mac(key: bytes, *parts: str) -> str:
    return hmac.new(key, "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def _request_mac(key: bytes, method: str, path_qs: str, target: str, timestamp: str, nonce: str, body: bytes) -> str:
    return _mac(key, "request", method.upper(), path_qs, target, timestamp, nonce, hashlib.sha256(body).hexdigest())


def sign(key: bytes, method: str, path_qs: str, body: bytes, *, now: float, nonce: str, node_id: str,
         target: str) -> dict[str, str]:
    """Headers that prove the sender holds ``key``, for a request to node ``target``
    (:data:`ANY_NODE` when the sender does not know yet which node answers at that URL)."""
    timestamp = f"{now:.3f}"
    digest = _request_mac(key, method, path_qs, target, timestamp, nonce, body)
    return {HEADER_NODE: node_id, HEADER_TARGET: target, HEADER_TIMESTAMP: timestamp, HEADER_NONCE: nonce,
            HEADER_SIGNATURE: digest}


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
            raise StaleRequestError("replayed request: this nonce was already used")
        self._seen[nonce] = max(timestamp, now)


def verify(
    key: bytes,
    method: str,
    path_qs: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    now: float,
    guard: ReplayGuard,
    node_id: str,
    any_target: bool = False,
) -> str:
    """Check a signed request addressed to ``node_id``; returns the sender's node id.

    ``any_target``: the request may be addressed to :data:`ANY_NODE` (a first contact, which
    only reads). Raises :class:`AuthError` when the sender does not prove it holds ``key``,
    and :class:`StaleRequestError` when it does but the request is stale, a replay or meant
    for another node (then the refusal may be signed: the sender is a member).
    """
    try:
        sender = headers[HEADER_NODE]
        target = headers[HEADER_TARGET]
        timestamp = headers[HEADER_TIMESTAMP]
        nonce = headers[HEADER_NONCE]
        signature = headers[HEADER_SIGNATURE]
    except KeyError as missing:
        raise AuthError(f"missing {missing.args[0]} header: internal endpoints need the cluster key") from None
    check_nonce(nonce)
    expected = _request_mac(key, method, path_qs, target, timestamp, nonce, body)
    if not hmac.compare_digest(expected, signature):
        raise AuthError("bad signature: the sender does not hold this cluster's key")
    try:
        sent_at = float(timestamp)
    except ValueError:
        raise AuthError("malformed timestamp") from None
    if abs(now - sent_at) > guard.window_s:
        raise StaleRequestError(f"request timestamp is {now - sent_at:+.1f} s off (clocks out of sync, or a replay)")
    if target != node_id and not (any_target and target == ANY_NODE):
        raise StaleRequestError(f"request is addressed to node {target}, not to {node_id}")
    guard.check_and_remember(nonce, sent_at, now)
    return sender


def admin_token(key: bytes) -> str:
    """The cluster's admin token: derived from the cluster key, so every member accepts the
    same one (a request may be passed on to the orchestrator) and a new key replaces it."""
    return "ncm-admin-" + _mac(key, "admin token")[:40]


def check_nonce(nonce: str) -> None:
    if not (8 <= len(nonce) <= 64) or not nonce.isalnum():
        raise AuthError("malformed nonce")


def sign_answer(key: bytes, *, responder: str, nonce: str, status: int, body: bytes | None) -> dict[str, str]:
    """Headers that prove the answer to the request with ``nonce`` comes from a holder of
    ``key``. ``body`` None: a streamed answer (a file, a WebSocket), signed without its body."""
    digest = STREAMED if body is None else hashlib.sha256(body).hexdigest()
    return {HEADER_NODE: responder, HEADER_SIGNATURE: _mac(key, "answer", responder, nonce, str(status), digest)}


def verify_answer(key: bytes, headers: Mapping[str, str], *, nonce: str, status: int, body: bytes | None,
                  responder: str) -> str:
    """Check the answer to our request with ``nonce``; returns the answering node's id.

    ``responder``: the node the request was addressed to, or :data:`ANY_NODE` for any member.
    """
    try:
        answered_by = headers[HEADER_NODE]
        signature = headers[HEADER_SIGNATURE]
    except KeyError:
        raise AuthError(f"unsigned answer (HTTP {status}): the peer does not hold this cluster's key") from None
    expected = sign_answer(key, responder=answered_by, nonce=nonce, status=status, body=body)[HEADER_SIGNATURE]
    if not hmac.compare_digest(expected, signature):
        raise AuthError(f"bad answer signature (HTTP {status}): the peer does not hold this cluster's key")
    if responder != ANY_NODE and answered_by != responder:
        raise StaleRequestError(f"node {answered_by} answered where node {responder} was expected")
    return answered_by
