"""The peer table: who is out there, who answers, who is dead. Pure state, `now` passed in.

Peers are found by mDNS, static configuration, gossip (another peer's table) or by their
own contact (inbound). Liveness
comes only from contact (describe / health checks), never from mDNS, whose records can stay
cached long after a device died: a peer is alive after a successful contact and dead after
``failure_threshold`` consecutive failures. Entries found by mDNS or gossip that are neither
seen nor reached for ``expiry_s`` are forgotten; static peers are kept forever.

A URL whose answer does not prove membership (no signature of the cluster key) is
*rejected*: dropped, and ignored from every source from then on, so nothing a stranger
says reaches the election or the routes, and it gets no further signed requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.core.advert import NodeAdvert

SOURCES = ("static", "mdns", "gossip", "inbound")
MAX_REJECTED = 1024


@dataclass
class PeerEntry:
    url: str
    source: str
    first_seen: float
    last_seen: float
    advert: NodeAdvert | None = None
    last_contact: float | None = None
    failures: int = 0
    alive: bool = False
    latency_ms: float | None = None


@dataclass
class PeerTable:
    self_id: str
    cluster: str
    failure_threshold: int = 3
    expiry_s: float = 600.0
    entries: dict[str, PeerEntry] = field(default_factory=dict)
    ignored: set[str] = field(default_factory=set)
    rejected: dict[str, str] = field(default_factory=dict)  # url -> why (oldest first, bounded)

    def discovered(self, url: str, source: str, now: float) -> PeerEntry | None:
        """A URL was seen (static config, mDNS sighting, gossip); None if it is this node's own."""
        if source not in SOURCES:
            raise ValueError(f"unknown peer source {source!r}")
        if url in self.ignored or url in self.rejected:
            return None
        entry = self.entries.get(url)
        if entry is None:
            entry = self.entries[url] = PeerEntry(url, source, now, now)
        else:
            entry.last_seen = now
            if source == "static":
                entry.source = "static"
        return entry

    def contact_succeeded(self, url: str, advert: NodeAdvert, latency_ms: float, now: float) -> bool:
        """Record a good answer; returns True when the peer (re)became alive.

        Answers from another cluster or from this node itself are dropped.
        """
        entry = self.entries.get(url)
        if entry is None:
            return False
        if advert.cluster != self.cluster or advert.node_id == self.self_id:
            del self.entries[url]
            if advert.node_id == self.self_id:
                self.ignored.add(url)  # our own address, learned through gossip
            return False
        was_alive = entry.alive
        entry.advert, entry.latency_ms = advert, latency_ms
        entry.last_contact = entry.last_seen = now
        entry.failures, entry.alive = 0, True
        # The same node reached under two URLs: keep the freshest entry.
        for other_url, other in list(self.entries.items()):
            if other_url != url and other.advert is not None and other.advert.node_id == advert.node_id and other.source != "static":
                del self.entries[other_url]
        return not was_alive

    def contact_failed(self, url: str, now: float) -> bool:
        """Record a failed contact; returns True when the peer just became dead."""
        entry = self.entries.get(url)
        if entry is None:
            return False
        entry.failures += 1
        if entry.alive and entry.failures >= self.failure_threshold:
            entry.alive = False
            return True
        return False

    def reject(self, url: str, reason: str) -> bool:
        """``url`` did not prove membership: forget it and never take it again. Returns True
        when it was a live peer (the election and routes must be recomputed)."""
        entry = self.entries.pop(url, None)
        self.rejected.pop(url, None)
        self.rejected[url] = reason
        while len(self.rejected) > MAX_REJECTED:
            del self.rejected[next(iter(self.rejected))]
        return entry is not None and entry.alive

    def expire(self, now: float) -> list[str]:
        gone = [
            url
            for url, entry in self.entries.items()
            if entry.source != "static" and not entry.alive and now - max(entry.last_seen, entry.last_contact or 0.0) > self.expiry_s
        ]
        for url in gone:
            del self.entries[url]
        return gone

    def alive_adverts(self) -> dict[str, NodeAdvert]:
        """node id -> advert of every live peer."""
        return {e.advert.node_id: e.advert for e in self.entries.values() if e.alive and e.advert is not None}

    def url_of(self, node_id: str) -> str | None:
        for url, entry in self.entries.items():
            if entry.advert is not None and entry.advert.node_id == node_id:
                return url
        return None

    def latency_of(self, node_id: str) -> float | None:
        url = self.url_of(node_id)
        return self.entries[url].latency_ms if url else None
