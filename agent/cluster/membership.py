"""Who is in the cluster: the peer table kept fresh by contacting every peer, and the election.

Peers come from static configuration, mDNS and gossip (each describe answer lists the
answering node's live peers, so one `--peer` is enough to join). Each round contacts every
known URL with a signed `POST /internal/describe` (which also tells the peer how to reach this
node, so a node given one peer is known to all); that contact is also the health check
(`failure_threshold` consecutive failures make a peer dead) and the latency measurement.

Contacts go to the peer's TLS port (announced on its public `GET /health`, then in its
advert), where both ends show a certificate of the cluster's CA, and every answer must be
signed with the cluster key for the request it answers: a URL that fails either (a stranger
announced over mDNS, or given to `/cluster/join`) is rejected for good, so no claim of a
non-member reaches the election, the routes or the peer table.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import statistics
import threading
import time
from typing import Callable
from urllib.parse import urlsplit

import aiohttp
import psutil
from yarl import URL

from agent import __version__
from agent.cluster.addresses import choose_addresses
from agent.cluster.peer_client import PeerAuthError, PeerClient, PeerError
from agent.core.advert import NodeAdvert
from agent.core.auth import ANY_NODE
from agent.core.capacity import NodeCapacity, credited_capacity, score
from agent.core.election import Election, elect, newest
from agent.core.errors import NcmError, WireError
from agent.core.node_report import NodeReport
from agent.core.peers import PeerTable
from agent.core.protocol import DESCRIBE_PATH, Description, Introduction
from agent.local.config import AgentConfig
from agent.local.events import EventLog
from agent.local.probe import CPU_ONLY, detect_capacity, find_accelerators

log = logging.getLogger(__name__)
CAPACITY_REFRESH_S = 10.0


def peer_url(api_url: str, peer_port: int) -> str:
    """The internal endpoints' URL of the agent whose public API is at ``api_url``."""
    return str(URL(api_url).with_scheme("https").with_port(peer_port)).rstrip("/")


class Membership:
    """The live view of the cluster from this node.

    Over 250 lines: each round contacts the peers, updates the table, the reports and the
    election together; the parts that decide are pure (``agent.core.peers``, ``election``)."""

    def __init__(self, config: AgentConfig, node_id: str, client: PeerClient, *, api_port: int,
                 peer_port: int, events: EventLog, describe_extra: Callable[[], NodeReport] = NodeReport,
                 held_bytes: Callable[[], int] = lambda: 0) -> None:
        """``describe_extra``: what this node tells peers besides its advert (its models, its
        worker's state, its device memory); ``held_bytes``: the memory its loaded models hold,
        which its capacity counts as usable."""
        self.config = config
        self.events = events
        self.node_id = node_id
        self.client = client
        self.api_port = api_port
        self.peer_port = peer_port
        self.table = PeerTable(node_id, config.cluster_name, failure_threshold=config.failure_threshold)
        self.election: Election | None = None
        # Until the backends' self-tests ran (first thing in run()), only the CPU is credited.
        self.accelerators = CPU_ONLY
        self.detected: NodeCapacity = detect_capacity(node_id)
        self.capacity: NodeCapacity = self._credited(self.detected)
        self.started_at = time.monotonic()
        self._subscribers: list[asyncio.Event] = []
        self._capacity_at = time.monotonic()
        self._describe_extra = describe_extra
        self._held_bytes = held_bytes
        self._reports: dict[str, NodeReport] = {}  # by URL: what each peer said in its last describe
        self._seen_as: str | None = None
        self._refused_as_stale: set[str] = set()  # peers whose refusal of our clock was logged
        for url in config.peers:
            self.table.discovered(url.rstrip("/"), "static", time.monotonic())

    # --- what this node says -------------------------------------------------------------
    @property
    def role(self) -> str:
        return "orchestrator" if self.is_orchestrator else "worker"

    @property
    def is_orchestrator(self) -> bool:
        return self.election is not None and self.election.orchestrator == self.node_id

    def advert(self) -> NodeAdvert:
        return NodeAdvert(
            node_id=self.node_id,
            cluster=self.config.cluster_name,
            api_port=self.api_port,
            peer_port=self.peer_port,
            version=__version__,
            role=self.role,
            capacity=self.capacity,
            election=self.election,
            configured_orchestrator=self.config.orchestrator,
        )

    def live_peer_urls(self, *, without: str | None = None) -> list[str]:
        """The URLs of the live peers (but node ``without``)."""
        return [url for url, e in self.table.entries.items()
                if e.alive and not (without is not None and e.advert is not None and e.advert.node_id == without)]

    def describe(self, caller_host: str | None = None) -> Description:
        """The answer to a peer's describe: my advert, my live peers, how I see the caller, and
        what I report of myself (detected devices, then :class:`NodeReport`)."""
        report = {"detected": self.detected.to_dict(), "accelerators": self.accelerators.to_dict(),
                  **self._describe_extra().to_json()}
        return Description(self.advert().to_json(), tuple(self.live_peer_urls()), caller_host, report)

    def introduction(self) -> Introduction:
        """What a describe request says about the caller: its API port, and its URL if configured."""
        return Introduction(self.api_port, self.self_url() if self.config.advertise_host else None)

    def introduced(self, introduction: Introduction, remote: str | None) -> None:
        """A peer contacted us: learn its URL (given, or its address and API port)."""
        url = introduction.address(remote)
        if url is not None:
            self.discovered(url, "inbound")

    def reachable_url(self) -> str:
        """A URL other devices can reach this node at, for a join string: :meth:`self_url` when
        the address is configured or learned from peers, else the first LAN address."""
        if not (self.config.advertise_host or self._seen_as):
            addresses = choose_addresses(self.config.interfaces)
            if addresses:
                return f"http://{addresses[0]}:{self.api_port}"
        return self.self_url()

    def self_url(self) -> str:
        """The URL peers reach this node at: advertise_host, else the address peers see us from."""
        host = self.config.advertise_host or self._seen_as or "127.0.0.1"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.api_port}"

    def peer_address_of(self, node_id: str) -> str:
        """The URL of ``node_id``'s internal endpoints (TLS, on its peer port)."""
        if node_id == self.node_id:
            return peer_url(self.self_url(), self.peer_port)
        url = self.table.url_of(node_id)
        advert = self.table.entries[url].advert if url is not None else None
        if url is None or advert is None or not advert.peer_port:
            raise KeyError(f"no peer address known for node {node_id}")
        return peer_url(url, advert.peer_port)

    def latency_ms(self, node_id: str) -> float:
        if node_id == self.node_id:
            return 0.0
        latency = self.table.latency_of(node_id)
        return latency if latency is not None else 0.0

    def peer_reports(self) -> dict[str, NodeReport]:
        """node id -> what the live peer said of itself in its last describe beyond its advert."""
        return {
            e.advert.node_id: self._reports.get(url, NodeReport())
            for url, e in self.table.entries.items() if e.alive and e.advert is not None
        }

    # --- the view ---------------------------------------------------------------------------
    def subscribe(self) -> asyncio.Event:
        """An event set whenever membership, election or capacity changes (the subscriber clears it)."""
        event = asyncio.Event()
        event.set()
        self._subscribers.append(event)
        return event

    def unsubscribe(self, event: asyncio.Event) -> None:
        with contextlib.suppress(ValueError):
            self._subscribers.remove(event)

    def _signal(self) -> None:
        for event in self._subscribers:
            event.set()

    def _notify(self, reason: str, kind: str, node: str | None = None) -> None:
        log.info("membership: %s", reason)
        self.events.record(kind, reason, node=node)
        self._signal()

    def agents_on_host(self) -> int:
        """This agent and the live peers that run on the same machine (their URLs name one of its
        addresses): they share its cores."""
        local = _local_addresses() | {host for host in (self.config.advertise_host, self._seen_as) if host}
        return 1 + sum(1 for url, entry in self.table.entries.items()
                       if entry.alive and urlsplit(url).hostname in local)

    def alive_nodes(self) -> dict[str, NodeAdvert]:
        """node id -> advert of every live node, this one included."""
        return {self.node_id: self.advert(), **self.table.alive_adverts()}

    def scores(self) -> dict[str, float]:
        return {node_id: score(advert.capacity) for node_id, advert in self.alive_nodes().items()}

    def discovered(self, url: str, source: str) -> None:
        url = url.rstrip("/")
        if (self._seen_as or self.config.advertise_host) and url == self.self_url():
            return
        known = url in self.table.entries or url in self.table.ignored or url in self.table.rejected
        if self.table.discovered(url, source, time.monotonic()) is not None and not known:
            log.info("found peer %s (%s)", url, source)

    def mark_unreachable(self, node_id: str) -> None:
        """A failed hop is evidence: count it as failed contacts right away."""
        url = self.table.url_of(node_id)
        if url is None:
            return
        became_dead = False
        for _ in range(self.config.failure_threshold):
            became_dead |= self.table.contact_failed(url, time.monotonic())
        if became_dead:
            self._recompute_election()
            self._notify(f"peer {node_id} is unreachable", "death", node_id)

    # --- rounds -----------------------------------------------------------------------------
    async def _peer_port(self, url: str) -> int:
        """The peer port an agent announces on its public `GET /health` (a first contact; a
        stranger may announce anything: the TLS and signed describe that follow tell)."""
        try:
            async with self.client.session.get(url + "/health", timeout=aiohttp.ClientTimeout(
                    total=self.config.peer_timeout_s)) as response:
                answer = await response.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as error:
            raise PeerError(url, f"no health answer: {type(error).__name__}: {error}") from None
        port = answer.get("peer_port") if isinstance(answer, dict) else None
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise PeerAuthError(url, "announces no peer port: it is no ncm agent of this version")
        return port

    def _reject(self, url: str, error: PeerAuthError) -> None:
        was_alive = self.table.reject(url, str(error))
        log.warning("peer %s cannot prove it belongs to cluster %r (%s): ignored, and not contacted again",
                    url, self.config.cluster_name, error)
        if was_alive:
            self._recompute_election()
            self._notify(f"peer {url} was rejected", "death")

    def _warn_if_refused_as_stale(self, url: str, error: NcmError) -> None:
        """A peer that holds the cluster key refuses this node's requests as stale: most likely
        this device's clock is off (the peer's log says so too). Said once per peer until it
        answers again, so a 1-node cluster does not look healthy in this node's own log."""
        answer = getattr(error, "peer_answer", None)
        refusal = answer.get("error") if isinstance(answer, dict) else None
        if isinstance(refusal, dict) and refusal.get("code") == "stale_request" and url not in self._refused_as_stale:
            self._refused_as_stale.add(url)
            log.warning("peer %s refuses this node's requests as stale (%s): check this device's clock "
                        "(NTP); until then it stays out of the cluster", url, refusal.get("message"))

    async def _contact(self, url: str) -> None:
        started = time.monotonic()
        entry = self.table.entries.get(url)
        known = entry.advert if entry is not None else None
        # The first contact is addressed to whichever node answers there; later ones to that node.
        target = known.node_id if known is not None else ANY_NODE
        try:
            # A peer that stopped answering may have come back on another peer port: ask again.
            fresh = known is not None and known.peer_port and entry is not None and entry.alive and not entry.failures
            peer_port = known.peer_port if fresh else await self._peer_port(url)
            answer, responder = await self.client.request_json_from(
                "POST", peer_url(url, peer_port), DESCRIBE_PATH, self.introduction().to_json(), target=target,
                timeout_s=self.config.peer_timeout_s)
            description = Description.from_json(answer)
            advert = NodeAdvert.from_json(description.advert)
            if advert.node_id != responder:
                raise WireError(f"node {responder} describes itself as {advert.node_id}")
        except PeerAuthError as error:
            self._reject(url, error)
            return
        except (PeerError, WireError) as error:
            self._warn_if_refused_as_stale(url, error)
            if self.table.contact_failed(url, time.monotonic()):
                self._notify(f"peer {url} is dead ({error})", "death", known.node_id if known else None)
            else:
                log.debug("contact with %s failed: %s", url, error)
            return
        latency_ms = (time.monotonic() - started) * 1000.0
        self._refused_as_stale.discard(url)
        self._reports[url] = NodeReport.from_json(description.report)
        if description.you is not None and not self._seen_as:
            self._seen_as = description.you
        if self.table.contact_succeeded(url, advert, latency_ms, time.monotonic()):
            self._notify(f"peer {advert.node_id} at {url} is alive", "join", advert.node_id)
        for gossiped in description.peers:
            self.discovered(gossiped, "gossip")

    async def round(self) -> None:
        """Contact every known peer once, then update capacity and the election."""
        urls = list(self.table.entries)
        if urls:
            await asyncio.gather(*(self._contact(url) for url in urls))
        self.table.expire(time.monotonic())
        now = time.monotonic()
        if now - self._capacity_at >= CAPACITY_REFRESH_S:
            self._capacity_at = now
            latencies = [e.latency_ms for e in self.table.entries.values() if e.alive and e.latency_ms is not None]
            self.detected = await asyncio.to_thread(
                detect_capacity, self.node_id, latency_ms=statistics.median(latencies) if latencies else 0.0,
                held_bytes=self._held_bytes())
            self._update_capacity()
        self._recompute_election()

    def _credited(self, detected: NodeCapacity) -> NodeCapacity:
        return credited_capacity(detected, self.accelerators.kinds, measured_npu_tops=self.accelerators.npu_tops,
                                 npu_tops=self.config.npu_tops, vram_gib=self.config.vram_gib,
                                 ram_gib=self.config.ram_gib)

    def _update_capacity(self) -> None:
        capacity = self._credited(self.detected)
        if capacity != self.capacity:
            self.capacity = capacity
            self._signal()

    def _known_dead(self) -> set[str]:
        return {
            e.advert.node_id for e in self.table.entries.values()
            if e.advert is not None and not e.alive and e.failures >= self.config.failure_threshold
        }

    def _recompute_election(self) -> None:
        alive = self.alive_nodes()
        settling = time.monotonic() - self.started_at < self.config.discovery_grace_s
        if self.election is None and settling and not any(a.election for a in alive.values()):
            return  # give peers a moment to show up before claiming the role
        claims = [self.election] + [advert.election for advert in alive.values()]
        current = newest(c for c in claims if c is not None)
        members = {node_id: score(advert.capacity) for node_id, advert in alive.items()}
        if current is not None and current.orchestrator not in members and current.orchestrator not in self._known_dead():
            # An orchestrator this node has not reached yet (it just joined) is not a dead one:
            # follow the claim instead of electing someone else.
            members[current.orchestrator] = 0.0
        configured = sorted(n for n, advert in alive.items() if advert.configured_orchestrator)
        chosen = elect(members, current, configured[0] if configured else None)
        if chosen != self.election:
            self.election = chosen
            self._notify(f"orchestrator is {chosen.orchestrator} (epoch {chosen.epoch})", "election", chosen.orchestrator)

    async def run(self) -> None:
        """Self-test the accelerators, then rounds forever, every health_interval_s (cancelled
        by the owner)."""
        stop = threading.Event()
        try:
            self.accelerators = await asyncio.to_thread(find_accelerators, self.config.providers, stop)
        finally:
            stop.set()  # cancelled (the agent stops): the self-test ends at its next step, not its last
        log.info("backends: %s%s", ", ".join(c.backend for c in self.accelerators.usable),
                 "".join(f"; {name} unusable: {reason}" for name, reason in self.accelerators.unusable))
        if self.detected.npu_tops and "npu" not in self.accelerators.kinds and self.config.npu_tops is None:
            log.warning("this device's NPU (%g TOPS in the board table) has no backend that runs on it: "
                        "the capacity score counts 0 TOPS", self.detected.npu_tops)
        self._update_capacity()
        while True:
            await self.round()
            await asyncio.sleep(self.config.health_interval_s)


@functools.lru_cache(maxsize=1)
def _local_addresses() -> frozenset[str]:
    """The names and addresses of this machine (loopback included)."""
    addresses = {"localhost", "127.0.0.1", "::1", socket.gethostname()}
    for interface in psutil.net_if_addrs().values():
        addresses.update(a.address.split("%")[0] for a in interface if a.family in (socket.AF_INET, socket.AF_INET6))
    return frozenset(addresses)
