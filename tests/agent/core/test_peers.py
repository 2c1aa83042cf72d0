"""The peer table (agent.core.peers) under any sequence of sightings, contacts, failures,
rejections and expiries: what each call returns, and the invariants that must hold after it
(liveness from contacts only, one entry per node, rejected and own URLs never kept, bounded
memory). test_advert_and_peers.py pins the first liveness, expiry and rejection examples."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from agent.core.advert import NodeAdvert
from agent.core.capacity import NodeCapacity
from agent.core.peers import MAX_REJECTED, SOURCES, PeerTable

SELF = "me"
URLS = [f"http://10.0.0.{i}:8080" for i in range(1, 5)]
THRESHOLD, EXPIRY_S = 2, 30.0


def advert(node_id: str, cluster: str = "home") -> NodeAdvert:
    return NodeAdvert(node_id=node_id, cluster=cluster, api_port=8080, version="0.1.0", role="worker",
                      capacity=NodeCapacity(node_id, 8, 16, 0, 2, 0.1))


operations = st.one_of(
    st.tuples(st.just("discover"), st.sampled_from(URLS), st.sampled_from(SOURCES)),
    st.tuples(st.just("succeed"), st.sampled_from(URLS), st.sampled_from(["a", "b", SELF]),
              st.sampled_from(["home", "home", "office"])),
    st.tuples(st.just("fail"), st.sampled_from(URLS)),
    st.tuples(st.just("reject"), st.sampled_from(URLS)),
    st.tuples(st.just("expire")),
)


def check_invariants(table: PeerTable) -> None:
    assert not set(table.entries) & (set(table.rejected) | table.ignored)
    assert len(table.rejected) <= MAX_REJECTED
    for url, entry in table.entries.items():
        assert entry.url == url and entry.source in SOURCES and entry.first_seen <= entry.last_seen
        if entry.alive:
            assert entry.advert is not None and entry.failures < THRESHOLD
        if entry.advert is not None:
            assert entry.advert.cluster == "home" and entry.advert.node_id != SELF
    non_static = [e.advert.node_id for e in table.entries.values() if e.advert is not None and e.source != "static"]
    assert len(non_static) == len(set(non_static)), "one node reached under two URLs kept twice"
    alive = table.alive_adverts()
    assert SELF not in alive
    assert all(table.url_of(node) is not None for node in alive)


@given(st.lists(st.tuples(operations, st.floats(0, 20)), max_size=40))
def test_every_call_answers_by_its_rule_and_the_table_stays_consistent(steps):
    table = PeerTable(SELF, "home", failure_threshold=THRESHOLD, expiry_s=EXPIRY_S)
    now = 0.0
    for op, gap in steps:
        now += gap
        kind, url = op[0], (op[1] if len(op) > 1 else None)
        before = table.entries.get(url) if url else None
        was_alive, failures = (before.alive, before.failures) if before else (False, 0)
        was_static = before is not None and before.source == "static"  # the entry is updated in place
        if kind == "discover":
            blocked = url in table.rejected or url in table.ignored
            entry = table.discovered(url, op[2], now=now)
            assert (entry is None) == blocked
            if entry is not None:
                assert entry is table.entries[url] and entry.last_seen == now
                assert (entry.source == "static") == (op[2] == "static" or was_static)
        elif kind == "succeed":
            node, cluster = op[2], op[3]
            became_alive = table.contact_succeeded(url, advert(node, cluster), 1.5, now=now)
            ours = before is not None and cluster == "home" and node != SELF
            assert became_alive == (ours and not was_alive)
            if ours:
                entry = table.entries[url]
                assert entry.alive and entry.failures == 0 and entry.last_contact == now and entry.latency_ms == 1.5
                assert table.alive_adverts()[node] == advert(node)
            else:
                assert url not in table.entries
            if before is not None and node == SELF:
                assert url in table.ignored
        elif kind == "fail":
            became_dead = table.contact_failed(url, now=now)
            assert became_dead == (was_alive and failures + 1 >= THRESHOLD)
            if before is not None:
                assert table.entries[url].failures == failures + 1
                assert table.entries[url].alive == (was_alive and failures + 1 < THRESHOLD)
            else:
                assert url not in table.entries
        elif kind == "reject":
            assert table.reject(url, "no signature") == was_alive
            assert url not in table.entries and list(table.rejected)[-1] == url
        else:
            due = {u for u, e in table.entries.items()
                   if e.source != "static" and not e.alive and now - max(e.last_seen, e.last_contact or 0.0) > EXPIRY_S}
            kept = set(table.entries) - due
            assert set(table.expire(now)) == due and set(table.entries) == kept
        check_invariants(table)


@given(st.lists(st.booleans(), max_size=30), st.integers(1, 5))
def test_a_peer_is_alive_exactly_while_fewer_than_threshold_contacts_failed_since_its_last_success(outcomes, threshold):
    table = PeerTable(SELF, "home", failure_threshold=threshold)
    table.discovered(URLS[0], "mdns", now=0)
    alive, failed = False, 0
    for now, success in enumerate(outcomes, start=1):
        if success:
            assert table.contact_succeeded(URLS[0], advert("a"), 1.0, now=now) == (not alive)
            alive, failed = True, 0
        else:
            failed += 1
            assert table.contact_failed(URLS[0], now=now) == (alive and failed == threshold)
            alive = alive and failed < threshold
        assert table.entries[URLS[0]].alive == alive and ("a" in table.alive_adverts()) == alive


@given(st.integers(0, 10**6), st.integers(0, 240).map(lambda quarters: quarters / 4),  # exact sums: no rounding
       st.sampled_from(["mdns", "gossip", "inbound"]))
@example(seen=100, later=EXPIRY_S, source="mdns")
@example(seen=100, later=EXPIRY_S + 0.25, source="gossip")
def test_an_unreached_entry_is_forgotten_only_once_more_than_expiry_has_passed(seen, later, source):
    table = PeerTable(SELF, "home", expiry_s=EXPIRY_S)
    table.discovered(URLS[0], source, now=seen)
    table.discovered(URLS[1], "static", now=seen)
    gone = table.expire(now=seen + later)
    assert gone == ([URLS[0]] if later > EXPIRY_S else [])
    assert URLS[1] in table.entries


def test_an_unknown_source_is_a_value_error():
    with pytest.raises(ValueError, match="unknown peer source 'dns'"):
        PeerTable(SELF, "home").discovered(URLS[0], "dns", now=0)


def test_a_new_sighting_refreshes_an_entry_and_only_static_configuration_makes_it_static():
    table = PeerTable(SELF, "home")
    first = table.discovered(URLS[0], "mdns", now=1)
    assert table.discovered(URLS[0], "gossip", now=5) is first
    assert (first.source, first.first_seen, first.last_seen) == ("mdns", 1, 5)
    table.discovered(URLS[0], "static", now=6)
    table.discovered(URLS[0], "inbound", now=7)
    assert (first.source, first.last_seen) == ("static", 7)


def test_contacts_with_an_unknown_url_change_nothing():
    table = PeerTable(SELF, "home")
    assert table.contact_succeeded(URLS[0], advert("a"), 1.0, now=0) is False
    assert table.contact_failed(URLS[0], now=0) is False
    assert table.entries == {} and table.alive_adverts() == {}


def test_a_peer_that_never_answered_is_never_reported_dead():
    table = PeerTable(SELF, "home", failure_threshold=1)
    table.discovered(URLS[0], "static", now=0)
    assert [table.contact_failed(URLS[0], now=t) for t in range(3)] == [False, False, False]
    assert table.entries[URLS[0]].failures == 3


def test_a_live_peer_never_expires_however_old_its_sighting():
    table = PeerTable(SELF, "home", expiry_s=1)
    table.discovered(URLS[0], "gossip", now=0)
    table.contact_succeeded(URLS[0], advert("a"), 1.0, now=0)
    assert table.expire(now=10**6) == [] and set(table.alive_adverts()) == {"a"}


def test_a_peer_of_another_cluster_is_dropped_but_may_be_found_again_unlike_this_node():
    table = PeerTable(SELF, "home")
    table.discovered(URLS[0], "mdns", now=0)
    table.discovered(URLS[1], "gossip", now=0)
    table.contact_succeeded(URLS[0], advert("x", cluster="office"), 1.0, now=1)
    table.contact_succeeded(URLS[1], advert(SELF), 1.0, now=1)
    assert table.discovered(URLS[0], "mdns", now=2) is not None
    assert table.discovered(URLS[1], "static", now=2) is None and URLS[1] in table.ignored


def test_a_static_entry_is_kept_beside_a_fresher_url_of_the_same_node():
    table = PeerTable(SELF, "home")
    table.discovered(URLS[0], "static", now=0)
    table.discovered(URLS[1], "mdns", now=0)
    table.contact_succeeded(URLS[0], advert("a"), 1.0, now=1)
    table.contact_succeeded(URLS[1], advert("a"), 4.0, now=2)
    assert set(table.entries) == {URLS[0], URLS[1]}
    table.discovered(URLS[2], "gossip", now=3)
    table.contact_succeeded(URLS[2], advert("a"), 2.0, now=3)
    assert set(table.entries) == {URLS[0], URLS[2]}


def test_url_and_latency_of_a_node():
    table = PeerTable(SELF, "home")
    table.discovered(URLS[0], "mdns", now=0)
    table.contact_succeeded(URLS[0], advert("a"), 3.25, now=1)
    assert (table.url_of("a"), table.latency_of("a")) == (URLS[0], 3.25)
    assert (table.url_of("z"), table.latency_of("z")) == (None, None)


def test_rejecting_a_url_again_updates_its_reason_and_keeps_it_among_the_newest():
    table = PeerTable(SELF, "home")
    for index in range(MAX_REJECTED):
        table.reject(f"http://x{index}:1", "no key")
    table.reject("http://x0:1", "bad signature")
    table.reject("http://new:1", "no key")
    assert len(table.rejected) == MAX_REJECTED
    assert table.rejected["http://x0:1"] == "bad signature" and "http://x1:1" not in table.rejected
    assert list(table.rejected)[-2:] == ["http://x0:1", "http://new:1"]


def test_rejecting_a_dead_or_unknown_url_needs_no_new_election():
    table = PeerTable(SELF, "home", failure_threshold=1)
    table.discovered(URLS[0], "mdns", now=0)
    table.contact_succeeded(URLS[0], advert("a"), 1.0, now=0)
    table.contact_failed(URLS[0], now=1)
    assert table.reject(URLS[0], "no key") is False and URLS[0] not in table.entries
    assert table.reject(URLS[1], "no key") is False
