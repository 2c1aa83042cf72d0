"""Pairing: invites kept on disk by the member that issued them, the sealed delivery of the
cluster key (AES-GCM with a key derived from the invite's secret and the newcomer's nonce),
and the newcomer's side: redeem a join string, check the fingerprint, keep what it got.

The bookkeeping and the join string are pure (:mod:`agent.core.invites`); this module does
the randomness, the clock, the files and the HTTP call.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from agent.core.errors import InviteError, KeyChangeRefusedError, MemberUnreachable, WireError
from agent.core.invites import Invite, InviteBook, JoinString, fingerprint, pairing_proof
from agent.core.protocol import PAIR_PATH, REKEY_PATH, PairAnswer, PairRequest, RekeyOrder
from agent.local.config import JOINED_FILE, PENDING_JOIN_FILE, AgentConfig, write_config_file
from agent.local.files import write_private
from agent.local.lifecycle import Lifecycle

if TYPE_CHECKING:
    from agent.cluster.membership import Membership
    from agent.cluster.peer_client import PeerClient

log = logging.getLogger(__name__)
INVITES_FILE = "invites.json"
PENDING_RETRY_S = 10.0
PAIR_TIMEOUT_S = 30.0


def _sealing_key(secret: bytes, nonce: str) -> AESGCM:
    return AESGCM(HKDF(algorithm=hashes.SHA256(), length=32, salt=nonce.encode(), info=b"ncm pairing").derive(secret))


def seal(secret: bytes, nonce: str, invite_id: str, cluster_key: bytes) -> tuple[str, str]:
    """The cluster key sealed with an invite's secret: (iv, sealed key), hex."""
    iv = secrets.token_bytes(12)
    return iv.hex(), _sealing_key(secret, nonce).encrypt(iv, cluster_key, invite_id.encode()).hex()


def unseal(secret: bytes, nonce: str, invite_id: str, answer: PairAnswer) -> bytes:
    try:
        return _sealing_key(secret, nonce).decrypt(bytes.fromhex(answer.iv), bytes.fromhex(answer.sealed_key),
                                                   invite_id.encode())
    except Exception:  # noqa: BLE001 - InvalidTag, bad hex, missing fields: all the same to the user
        raise InviteError("the member's answer does not open with this invite's secret") from None


class InviteStore:
    """The invites this member issued under the cluster key ``key``, kept in
    ``state_dir/invites.json`` (0600). An invite hands out the key it was issued under and no
    other: after a removal changed the key, the invites issued before it are void."""

    def __init__(self, state_dir: Path, key: bytes) -> None:
        self.path = state_dir / INVITES_FILE
        self.key_fingerprint = fingerprint(key)
        invites = []
        if self.path.exists():
            try:
                invites = [Invite.from_json(i) for i in json.loads(self.path.read_text(encoding="utf-8"))]
            except (InviteError, ValueError, TypeError) as error:
                log.warning("ignoring unreadable %s: %s", self.path, error)
        self.book = InviteBook(invites)

    def _save(self) -> None:
        write_private(self.path, json.dumps(self.book.to_json()))

    def create(self, *, ttl_s: float, uses: int) -> Invite:
        invite = self.book.create(secrets.token_hex(8), secrets.token_bytes(24), now=time.time(),
                                  key_fingerprint=self.key_fingerprint, ttl_s=ttl_s, uses=uses)
        self._save()
        return invite

    def active(self) -> list[Invite]:
        return self.book.active(time.time())

    def revoke(self, invite_id: str) -> None:
        self.book.revoke(invite_id)
        self._save()

    def revoke_all(self) -> None:
        self.book.revoke_all()
        self._save()

    def redeem(self, request: PairRequest) -> Invite:
        try:
            return self.book.redeem(request.invite, request.nonce, request.proof, now=time.time(),
                                    key_fingerprint=self.key_fingerprint, claimed_fingerprint=request.fingerprint)
        finally:
            self._save()


async def redeem(session: aiohttp.ClientSession, join: JoinString) -> tuple[bytes, list[str]]:
    """Ask the member named in ``join`` for the cluster key; returns it, checked against the
    fingerprint, and the live members' URLs."""
    nonce = secrets.token_hex(16)
    body = PairRequest(join.invite_id, nonce, pairing_proof(join.secret, join.invite_id, nonce), join.cluster,
                       join.fingerprint).to_json()
    try:
        async with session.post(join.url.rstrip("/") + PAIR_PATH, json=body,
                                timeout=aiohttp.ClientTimeout(total=PAIR_TIMEOUT_S)) as response:
            answer = await response.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as error:
        raise MemberUnreachable(f"cannot reach the member at {join.url}: {type(error).__name__}: {error}") from None
    if response.status != 200:  # the OpenAI error shape of the public port
        error = answer.get("error") if isinstance(answer, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        raise InviteError(f"the member at {join.url} refused the invite: "
                          f"{message if isinstance(message, str) else f'HTTP {response.status}'}")
    try:
        sealed = PairAnswer.from_json(answer)
    except WireError as error:
        raise InviteError(f"the member at {join.url} answered the invite with {error}") from None
    key = unseal(join.secret, nonce, join.invite_id, sealed)
    if fingerprint(key) != join.fingerprint or sealed.cluster != join.cluster:
        raise InviteError(f"the member at {join.url} is not of the cluster the join string names")
    return key, [join.url, *sealed.peers][:16]


def keep_membership(config: AgentConfig, cluster: str, key: bytes, peers: list[str]) -> None:
    """Write what a join or a rekey brought where this agent reads it when it starts:
    ``joined.toml`` in its state directory (0600), above its configuration file, below
    environment and flags. The invites issued under the old key go: they would let a removed
    device (or anyone holding one) into the cluster under its new key."""
    write_config_file(config.state_dir / JOINED_FILE, {"cluster_name": cluster, "cluster_key": key.decode(),
                                                       "peers": list(peers)}, mode=0o600)
    (config.state_dir / INVITES_FILE).unlink(missing_ok=True)


def check_environment_allows_a_new_key() -> None:
    """KeyChangeRefusedError when this process's environment sets what a join or rekey would change."""
    overridden = [name for name in ("NCM_CLUSTER_KEY", "NCM_CLUSTER_NAME") if os.environ.get(name)]
    if overridden:
        raise KeyChangeRefusedError(f"{' and '.join(overridden)} in the environment would override the new cluster key; "
                          "remove them to join by invite or take part in a removal")


async def join_by_invite(config: AgentConfig, session: aiohttp.ClientSession, text: str) -> tuple[str, list[str]]:
    """Redeem the join string ``text`` and keep the membership it brings; returns the cluster
    name and its members' URLs. The agent must restart to act as the member it now is."""
    check_environment_allows_a_new_key()
    join = JoinString.decode(text)
    key, peers = await redeem(session, join)
    await asyncio.to_thread(keep_membership, config, join.cluster, key, peers)
    return join.cluster, peers


async def join_pending(config: AgentConfig, session: aiohttp.ClientSession, lifecycle: Lifecycle,
                       retry_s: float = PENDING_RETRY_S) -> None:
    """First boot: a join string from ``ncm-setup.txt`` waits in ``state_dir/pending-join``
    until the member it names answers (the network may come up late); then the agent
    restarts as a member. A refused invite is kept as ``pending-join.refused`` with why."""
    path = config.state_dir / PENDING_JOIN_FILE
    if not path.exists():
        return
    text = path.read_text(encoding="utf-8").strip()
    while True:
        try:
            cluster, _ = await join_by_invite(config, session, text)
        except MemberUnreachable as error:
            log.warning("%s; trying again in %g s", error, retry_s)
            await asyncio.sleep(retry_s)
            continue
        except InviteError as error:
            log.error("the join string from the setup file was refused: %s", error)
            path.replace(path.with_name(PENDING_JOIN_FILE + ".refused"))
            return
        path.unlink(missing_ok=True)
        log.info("joined cluster %r with the join string from the setup file: restarting as its member", cluster)
        lifecycle.restart_now()
        return


REKEY_TIMEOUT_S = 10.0


def take_new_key(config: AgentConfig, order: RekeyOrder) -> None:
    """Keep the new key of a rekey order (the orchestrator removed a node); the agent must
    restart to use it. KeyChangeRefusedError when the environment forbids it."""
    check_environment_allows_a_new_key()
    keep_membership(config, order.cluster, order.key.encode(), list(order.peers))


async def rotate_key(membership: Membership, client: PeerClient, config: AgentConfig, lifecycle: Lifecycle,
                     removed: str) -> dict[str, Any]:
    """Shut ``removed`` out: hand a new cluster key to every other live member over the
    authenticated, encrypted peer link, then take it here too; every member restarts with it,
    and the old key (the removed node's) opens nothing any more."""
    new_key = secrets.token_hex(32)
    stays = removed != membership.node_id  # this node keeps its membership (it is not the one removed)
    members = [n for n in membership.alive_nodes() if n not in (removed, membership.node_id)]
    others = membership.live_peer_urls(without=removed)
    order = RekeyOrder(config.cluster_name, new_key, tuple(others + ([membership.self_url()] if stays else [])))

    async def hand_over(node_id: str) -> None:
        await client.request_json("POST", membership.peer_address_of(node_id), REKEY_PATH, order.to_json(), target=node_id,
                                  timeout_s=REKEY_TIMEOUT_S)

    results = await asyncio.gather(*(hand_over(n) for n in members), return_exceptions=True)
    failed = {n: str(r) for n, r in zip(members, results) if isinstance(r, BaseException)}
    for node_id, reason in failed.items():
        log.warning("could not hand the new cluster key to %s (it has to be paired again): %s", node_id, reason)
    rekeyed = [n for n in members if n not in failed]
    if stays:
        await asyncio.to_thread(keep_membership, config, config.cluster_name, new_key.encode(), others)
        lifecycle.restart_now()
        rekeyed.append(membership.node_id)
    log.info("removed %s: new cluster key handed to %s", removed, ", ".join(rekeyed))
    return {"removed": removed, "rekeyed": sorted(rekeyed), "unreachable": failed}
