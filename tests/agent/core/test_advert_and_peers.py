import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.advert import MAX_TXT_BYTES, NodeAdvert, decode_txt, encode_txt
from agent.core.capacity import NodeCapacity
from agent.core.election import Election
from agent.core.errors import WireError
from agent.core.peers import PeerTable
from tests.agent.core.strategies import capacities


def advert(node_id="n1", cluster="home", **kw):
    return NodeAdvert(node_id=node_id, cluster=cluster, api_port=8080, version="0.1.0", role="worker",
                      capacity=NodeCapacity(node_id, 8, 16, 6, 2, 0.1), **kw)


@given(capacities, st.sampled_from(["worker", "orchestrator"]), st.none() | st.integers(1, 10**6), st.booleans())
def test_txt_round_trip_and_size(capacity, role, epoch, configured):
    a = NodeAdvert(capacity.node_id, "home-cluster", 8080, "0.1.0", role, capacity,
                   Election(capacity.node_id, epoch) if epoch else None, configured)
    properties = encode_txt(a)
    assert sum(len(k) + len(v) + 2 for k, v in properties.items()) <= MAX_TXT_BYTES
    decoded = decode_txt({k.encode(): v.encode() for k, v in properties.items()})
    assert decoded.node_id == a.node_id and decoded.role == role and decoded.election == a.election
    assert decoded.configured_orchestrator == configured
    assert decoded.capacity.vram_gib == pytest.approx(a.capacity.vram_gib, abs=1e-3)
    assert NodeAdvert.from_json(a.to_json()) == a


@pytest.mark.parametrize(
    "properties",
    [
        {b"id": b"n1"},
        {b"id": b"n1", b"cl": b"home", b"port": b"x", b"cap": b"1,2,3,4,0"},
        {b"id": b"n1", b"cl": b"home", b"port": b"80", b"cap": b"1,2,nan,4,0"},
        {b"id": b"n1", b"cl": b"home", b"port": b"80", b"cap": b"1,2,3,4,0", b"role": b"king"},
        {b"id": b"\xff", b"cl": b"home", b"port": b"80", b"cap": b"1,2,3,4,0"},
        {b"id": b"n1", b"cl": b"home", b"port": b"80", b"cap": b"-1,2,3,4,0"},
    ],
)
def test_malformed_records_are_wire_errors(properties):
    with pytest.raises(WireError):
        decode_txt(properties)


def test_no_secret_key_in_txt():
    assert set(encode_txt(advert())) <= {"id", "cl", "port", "v", "role", "cap", "orc", "ep", "cfg"}


def test_peer_liveness_comes_from_contacts_only():
    table = PeerTable("me", "home", failure_threshold=2, expiry_s=10)
    table.discovered("http://a:1", "mdns", now=0)
    assert table.alive_adverts() == {}
    assert table.contact_succeeded("http://a:1", advert("a"), 1.0, now=1) is True
    assert set(table.alive_adverts()) == {"a"}
    assert table.contact_failed("http://a:1", now=2) is False  # one failure is not death
    assert table.contact_failed("http://a:1", now=3) is True
    assert table.alive_adverts() == {}
    assert table.expire(now=20) == ["http://a:1"]


def test_static_peers_never_expire_and_other_clusters_or_self_are_dropped():
    table = PeerTable("me", "home", failure_threshold=1, expiry_s=1)
    table.discovered("http://s:1", "static", now=0)
    table.discovered("http://x:1", "gossip", now=0)
    table.discovered("http://self:1", "gossip", now=0)
    assert table.contact_succeeded("http://x:1", advert("x", cluster="office"), 1.0, now=0) is False
    assert table.contact_succeeded("http://self:1", advert("me"), 1.0, now=0) is False
    assert table.discovered("http://self:1", "gossip", now=1) is None
    table.contact_failed("http://s:1", now=0)
    assert table.expire(now=100) == []
    assert list(table.entries) == ["http://s:1"]


def test_same_node_under_two_urls_keeps_one_entry():
    table = PeerTable("me", "home")
    table.discovered("http://10.0.0.2:8080", "mdns", now=0)
    table.discovered("http://host.local:8080", "gossip", now=0)
    table.contact_succeeded("http://10.0.0.2:8080", advert("b"), 1.0, now=1)
    table.contact_succeeded("http://host.local:8080", advert("b"), 1.0, now=2)
    assert list(table.entries) == ["http://host.local:8080"]
    assert table.url_of("b") == "http://host.local:8080"


@given(st.lists(st.tuples(st.sampled_from(["http://a:1", "http://b:1", "http://c:1"]),
                          st.sampled_from(["static", "mdns", "gossip", "inbound"])), max_size=20))
def test_a_rejected_url_never_comes_back_from_any_source(sightings):
    table = PeerTable("me", "home")
    table.discovered("http://a:1", "static", now=0)
    table.contact_succeeded("http://a:1", advert("a"), 1.0, now=0)
    assert table.reject("http://a:1", "unsigned answer") is True  # it was alive: re-elect
    assert table.reject("http://b:1", "unsigned answer") is False
    for now, (url, source) in enumerate(sightings, start=1):
        table.discovered(url, source, now=now)
    assert set(table.entries) <= {"http://c:1"}
    assert "a" not in table.alive_adverts()
    assert table.rejected == {"http://a:1": "unsigned answer", "http://b:1": "unsigned answer"}


def test_rejected_urls_are_bounded():
    from agent.core.peers import MAX_REJECTED

    table = PeerTable("me", "home")
    for index in range(MAX_REJECTED + 10):
        table.reject(f"http://x{index}:1", "no key")
    assert len(table.rejected) == MAX_REJECTED
    assert "http://x0:1" not in table.rejected and f"http://x{MAX_REJECTED + 9}:1" in table.rejected
