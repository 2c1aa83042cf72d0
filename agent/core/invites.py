"""Invites: how a new device gets the cluster key without anyone typing it.

A member issues an invite (`ncm invite`): an id, a random secret, an expiry and a number of
uses, and hands out a *join string* holding the cluster name, the member's URL, the invite
id and secret, and the cluster's fingerprint. The new device proves it holds the secret
(an HMAC over a nonce of its own), receives the cluster key sealed with a key derived from
the secret, and checks the fingerprint before it trusts what it got. The secret itself never
travels after the join string was handed out.

Pure: time, the secret and the nonce are passed in; :class:`InviteBook` is the bookkeeping.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from dataclasses import dataclass, replace
from typing import Any

from agent.core.errors import InvalidRequestError, InviteError, InviteNotFoundError

JOIN_PREFIX = "ncm1."
DEFAULT_INVITE_TTL_S = 3600.0
MAX_INVITES = 256


def fingerprint(cluster_key: bytes) -> str:
    """What a newcomer checks the delivered key against (reveals nothing of the key)."""
    return hmac.new(cluster_key, b"ncm cluster fingerprint", hashlib.sha256).hexdigest()[:32]


def pairing_proof(secret: bytes, invite_id: str, nonce: str) -> str:
    """The newcomer's proof that it holds the invite's secret."""
    return hmac.new(secret, f"ncm pair\n{invite_id}\n{nonce}".encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class JoinString:
    """What a new device needs to join: where, which invite, its secret, what to expect."""

    cluster: str
    url: str
    invite_id: str
    secret: bytes
    fingerprint: str

    def __post_init__(self) -> None:
        if not self.cluster or len(self.cluster) > 63:
            raise InviteError("the join string names no valid cluster")
        if not self.url.startswith(("http://", "https://")) or len(self.url) > 255:
            raise InviteError("the join string holds no valid http(s) URL of a member")
        if not self.invite_id.isalnum() or not 8 <= len(self.invite_id) <= 64:
            raise InviteError("the join string holds no valid invite id")
        if len(self.secret) < 16:
            raise InviteError("the join string's secret is too short")
        if len(self.fingerprint) != 32:
            raise InviteError("the join string holds no valid cluster fingerprint")

    def encode(self) -> str:
        body = {"c": self.cluster, "u": self.url, "i": self.invite_id, "s": self.secret.hex(), "f": self.fingerprint}
        return JOIN_PREFIX + base64.urlsafe_b64encode(json.dumps(body, separators=(",", ":")).encode()).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> JoinString:
        text = text.strip()
        if not text.startswith(JOIN_PREFIX):
            raise InviteError(f"a join string starts with {JOIN_PREFIX!r} (`ncm invite` on a member prints one)")
        payload = text[len(JOIN_PREFIX):]
        try:
            body = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
            return cls(str(body["c"]), str(body["u"]), str(body["i"]), bytes.fromhex(body["s"]), str(body["f"]))
        except InviteError:
            raise
        except (ValueError, KeyError, TypeError, binascii.Error):
            raise InviteError("the join string is damaged (copy it again, whole)") from None


@dataclass(frozen=True)
class Invite:
    invite_id: str
    secret: bytes
    created_at: float  # wall-clock seconds
    expires_at: float
    uses_left: int
    key_fingerprint: str  # the cluster key it hands out: void once the key changes (a removal)

    def public(self, now: float) -> dict[str, Any]:
        """What listing an invite shows (never the secret)."""
        return {"id": self.invite_id, "created_at": self.created_at, "expires_at": self.expires_at,
                "expires_in_s": max(0.0, round(self.expires_at - now, 1)), "uses_left": self.uses_left}

    def to_json(self) -> dict[str, Any]:
        return {"id": self.invite_id, "secret": self.secret.hex(), "created_at": self.created_at,
                "expires_at": self.expires_at, "uses_left": self.uses_left, "key_fingerprint": self.key_fingerprint}

    @classmethod
    def from_json(cls, data: Any) -> Invite:
        try:
            # An invite stored before invites named their key is taken as issued under none: void.
            return cls(str(data["id"]), bytes.fromhex(data["secret"]), float(data["created_at"]),
                       float(data["expires_at"]), int(data["uses_left"]), str(data.get("key_fingerprint", "")))
        except (KeyError, TypeError, ValueError) as error:
            raise InviteError(f"malformed stored invite: {error}") from None


class InviteBook:
    """The invites a member has issued: created, listed, revoked and redeemed."""

    def __init__(self, invites: list[Invite] | None = None) -> None:
        self._invites: dict[str, Invite] = {i.invite_id: i for i in invites or []}

    def create(self, invite_id: str, secret: bytes, *, now: float, key_fingerprint: str,
               ttl_s: float = DEFAULT_INVITE_TTL_S, uses: int = 1) -> Invite:
        if not 0 < ttl_s <= 30 * 86400:
            raise InvalidRequestError("an invite lasts more than 0 s and at most 30 days", "ttl_s")
        if not 1 <= uses <= 100:
            raise InvalidRequestError("an invite can be used 1 to 100 times", "uses")
        self.expire(now)
        if len(self._invites) >= MAX_INVITES:
            raise InvalidRequestError(f"{MAX_INVITES} invites are open already; revoke some first", code="too_many_invites",
                                      status=409)
        invite = Invite(invite_id, secret, now, now + ttl_s, uses, key_fingerprint)
        self._invites[invite_id] = invite
        return invite

    def expire(self, now: float) -> None:
        for invite_id in [i for i, invite in self._invites.items() if invite.expires_at <= now]:
            del self._invites[invite_id]

    def active(self, now: float) -> list[Invite]:
        self.expire(now)
        return sorted(self._invites.values(), key=lambda i: i.created_at)

    def revoke(self, invite_id: str) -> None:
        if self._invites.pop(invite_id, None) is None:
            raise InviteNotFoundError(f"no open invite {invite_id!r}")

    def revoke_all(self) -> None:
        """Every open invite is void: the cluster key changed (a device was removed)."""
        self._invites.clear()

    def redeem(self, invite_id: str, nonce: str, proof: str, *, now: float, key_fingerprint: str,
               claimed_fingerprint: str | None = None) -> Invite:
        """Use the invite once, if ``proof`` shows the secret and the invite was issued under
        the key ``key_fingerprint`` names (the one it would hand out); returns it (to seal the key).
        ``claimed_fingerprint``, what the newcomer's join string says, must be that key's too:
        a string altered on the way is refused before the invite is used up."""
        invite = self._invites.get(invite_id)
        if invite is None:
            raise InviteError("this invite does not exist: it expired, was revoked or used up "
                              "(ask a member for a new one: `ncm invite`)")
        if invite.expires_at <= now:
            del self._invites[invite_id]
            raise InviteError("this invite has expired (ask a member for a new one: `ncm invite`)")
        if not hmac.compare_digest(invite.key_fingerprint, key_fingerprint):
            del self._invites[invite_id]
            raise InviteError("this invite was issued before the cluster key changed (a device was removed) "
                              "and is void (ask a member for a new one: `ncm invite`)")
        if not (8 <= len(nonce) <= 64 and nonce.isalnum()):
            raise InviteError("malformed nonce")
        if not hmac.compare_digest(pairing_proof(invite.secret, invite_id, nonce), proof):
            raise InviteError("wrong invite secret")
        if claimed_fingerprint is not None and not hmac.compare_digest(claimed_fingerprint, key_fingerprint):
            raise InviteError("the join string was altered: its cluster fingerprint is not this cluster's "
                              "(copy the join string again, whole); the invite is still open")
        if invite.uses_left <= 1:
            del self._invites[invite_id]
        else:
            self._invites[invite_id] = replace(invite, uses_left=invite.uses_left - 1)
        return invite

    def to_json(self) -> list[dict[str, Any]]:
        return [invite.to_json() for invite in self._invites.values()]
