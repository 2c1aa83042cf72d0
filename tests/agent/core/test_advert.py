"""What a node says about itself (agent.core.advert): the NodeAdvert's validation, its JSON form
(``describe`` answers) and its mDNS TXT form (encode_txt / decode_txt), their size bounds,
defaults and refusals. test_advert_and_peers.py holds the first round-trip and malformed-record
tests; these go further."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from agent.core.advert import MAX_TXT_BYTES, ROLES, NodeAdvert, decode_txt, encode_txt
from agent.core.capacity import NodeCapacity
from agent.core.election import Election
from agent.core.errors import WireError
from tests.agent.core.strategies import NODE_IDS, capacities

ASCII_NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-._", min_size=1, max_size=63)
VERSIONS = st.text(alphabet="0123456789.abcdefrc+-", max_size=32)
REQUIRED_TXT_KEYS = ("id", "cl", "port", "cap")


def advert(node_id: str = "n1", **changes) -> NodeAdvert:
    fields = dict(node_id=node_id, cluster="home", api_port=8080, version="0.1.0", role="worker",
                  capacity=NodeCapacity(node_id, 8, 16, 6, 2, 0.1))
    return NodeAdvert(**{**fields, **changes})


@st.composite
def adverts(draw: st.DrawFn, cluster: st.SearchStrategy[str] = ASCII_NAMES,
            version: st.SearchStrategy[str] = VERSIONS) -> NodeAdvert:
    """Valid adverts: any capacity, role, election, orchestrator flag and ports."""
    capacity = draw(capacities)
    orchestrator = draw(st.none() | st.just(capacity.node_id) | NODE_IDS)
    election = Election(orchestrator, draw(st.integers(1, 10**9))) if orchestrator else None
    return NodeAdvert(capacity.node_id, draw(cluster), draw(st.integers(1, 65535)), draw(version),
                      draw(st.sampled_from(ROLES)), capacity, election, draw(st.booleans()),
                      draw(st.integers(0, 65535)))


def txt_size(properties: dict[str, str]) -> int:
    return sum(len(k.encode()) + len(v.encode()) + 2 for k, v in properties.items())


def as_zeroconf(properties: dict[str, str]) -> dict[bytes, bytes]:
    return {k.encode(): v.encode() for k, v in properties.items()}


@given(adverts())
def test_a_txt_record_decodes_to_the_advert_without_peer_port_and_with_capacity_to_a_thousandth(a):
    properties = encode_txt(a)
    assert txt_size(properties) <= MAX_TXT_BYTES
    assert all(len(k.encode()) + 1 + len(v.encode()) <= 255 for k, v in properties.items())
    decoded = decode_txt(as_zeroconf(properties))
    assert dataclasses.replace(decoded, capacity=a.capacity) == dataclasses.replace(a, peer_port=0)
    for field in ("vram_gib", "ram_gib", "npu_tops", "latency_ms", "load"):
        assert getattr(decoded.capacity, field) == pytest.approx(getattr(a.capacity, field), abs=5e-4 + 1e-12)


@given(adverts())
def test_encoding_a_decoded_txt_record_gives_the_same_record(a):
    properties = encode_txt(a)
    assert encode_txt(decode_txt(as_zeroconf(properties))) == properties


@given(adverts())
def test_txt_records_decode_the_same_from_text_or_bytes(a):
    properties = encode_txt(a)
    assert decode_txt(properties) == decode_txt(as_zeroconf(properties))


@given(adverts(cluster=st.text(min_size=1, max_size=63), version=st.text(max_size=32)))
def test_describe_json_round_trips_exactly_through_json_text(a):
    assert NodeAdvert.from_json(json.loads(json.dumps(a.to_json()))) == a


@given(adverts(cluster=st.text(min_size=1, max_size=63), version=st.text(max_size=32)))
def test_an_encoded_txt_record_respects_both_size_bounds_or_is_refused(a):
    try:
        properties = encode_txt(a)
    except WireError as error:
        assert "longer than 255 bytes" in str(error) or f"exceed {MAX_TXT_BYTES} bytes" in str(error)
    else:
        assert txt_size(properties) <= MAX_TXT_BYTES
        assert all(len(f"{k}={v}".encode()) <= 255 for k, v in properties.items())
        assert decode_txt(as_zeroconf(properties)).cluster == a.cluster


@given(st.integers(-10**6, 10**6), st.integers(-10**6, 10**6))
@example(api_port=0, peer_port=0)
@example(api_port=1, peer_port=-1)
@example(api_port=65535, peer_port=65535)
@example(api_port=65536, peer_port=1)
@example(api_port=443, peer_port=65536)
def test_ports_out_of_range_are_refused(api_port, peer_port):
    valid = 0 < api_port < 65536 and 0 <= peer_port < 65536
    try:
        made = advert(api_port=api_port, peer_port=peer_port)
    except WireError as error:
        assert not valid and "port" in str(error) and "out of range" in str(error)
    else:
        assert valid and (made.api_port, made.peer_port) == (api_port, peer_port)


@given(st.text(max_size=80), st.text(max_size=40))
@example(cluster="c" * 63, version="v" * 32)
@example(cluster="c" * 64, version="")
@example(cluster="", version="")
@example(cluster="c", version="v" * 33)
def test_cluster_names_of_1_to_63_characters_and_versions_of_up_to_32_are_accepted(cluster, version):
    valid = 1 <= len(cluster) <= 63 and len(version) <= 32
    try:
        advert(cluster=cluster, version=version)
    except WireError as error:
        assert not valid
        assert str(error) in ("cluster name must be 1-63 characters", "version is too long")
    else:
        assert valid


@given(st.text(max_size=20))
def test_only_known_roles_are_accepted(role):
    try:
        advert(role=role)
    except WireError as error:
        assert role not in ROLES and str(error) == f"unknown role {role!r}"
    else:
        assert role in ROLES


def test_an_advert_carrying_another_nodes_capacity_is_refused():
    with pytest.raises(WireError, match="capacity belongs to another node"):
        advert("n1", capacity=NodeCapacity("n2", 1, 1, 0, 0, 0))


def test_a_node_id_longer_than_a_txt_entry_is_refused_on_encoding():
    wide = "\U0001d11e" * 64  # 64 printable characters, 4 bytes each
    with pytest.raises(WireError, match="TXT entry 'id' is longer than 255 bytes"):
        encode_txt(advert(wide))


def test_a_record_over_the_total_bound_is_refused_on_encoding():
    node_id = "\u00e9" * 60
    big = advert(node_id, cluster="\u00e9" * 63, version="\u00e9" * 32, election=Election(node_id, 1))
    with pytest.raises(WireError, match=f"TXT record would exceed {MAX_TXT_BYTES} bytes"):
        encode_txt(big)


def test_capacity_figures_are_written_with_at_most_three_decimals():
    a = advert(capacity=NodeCapacity("n1", 7.5, 16.0, 0.0001, 12.3456, 1.0))
    assert encode_txt(a)["cap"] == "7.5,16,0,12.346,1"
    assert encode_txt(a)["port"] == "8080"


def test_an_election_and_the_orchestrator_flag_are_written_only_when_present():
    plain = encode_txt(advert())
    assert not {"orc", "ep", "cfg"} & set(plain)
    claimed = encode_txt(advert(election=Election("boss", 7), configured_orchestrator=True))
    assert (claimed["orc"], claimed["ep"], claimed["cfg"]) == ("boss", "7", "1")


@pytest.mark.parametrize("missing", REQUIRED_TXT_KEYS)
def test_a_txt_record_without_a_required_key_is_refused(missing):
    properties = {k: v for k, v in encode_txt(advert()).items() if k != missing}
    with pytest.raises(WireError, match=f"malformed TXT record: '{missing}'"):
        decode_txt(properties)


def test_optional_txt_keys_take_their_defaults():
    decoded = decode_txt({b"id": b"n1", b"cl": b"home", b"port": b"80", b"cap": b"1,2,3,4,0.5"})
    assert (decoded.version, decoded.role, decoded.election) == ("?", "worker", None)
    assert decoded.configured_orchestrator is False
    assert decoded.capacity == NodeCapacity("n1", 1, 2, 3, 4, 0.5) and decoded.peer_port == 0


def test_a_txt_key_without_a_value_reads_as_empty():
    decoded = decode_txt({b"id": b"n1", b"cl": b"home", b"port": b"80", b"cap": b"1,2,3,4,0", b"v": None, b"cfg": None})
    assert decoded.version == "" and decoded.configured_orchestrator is False


def test_only_cfg_1_marks_a_configured_orchestrator():
    base = {"id": "n1", "cl": "home", "port": "80", "cap": "1,2,3,4,0"}
    assert decode_txt({**base, "cfg": "1"}).configured_orchestrator is True
    assert decode_txt({**base, "cfg": "true"}).configured_orchestrator is False


def test_an_orchestrator_without_an_epoch_is_refused_and_an_epoch_alone_is_ignored():
    base = {"id": "n1", "cl": "home", "port": "80", "cap": "1,2,3,4,0"}
    with pytest.raises(WireError, match="malformed TXT record: 'ep'"):
        decode_txt({**base, "orc": "boss"})
    assert decode_txt({**base, "ep": "3"}).election is None
    with pytest.raises(WireError, match="malformed TXT record"):
        decode_txt({**base, "orc": "boss", "ep": "0"})


@pytest.mark.parametrize("cap", ["1,2,3,4", "1,2,3,4,0,9", "1,2,inf,4,0", "1,2,3,4,2", ""])
def test_a_capacity_field_that_is_not_five_finite_valid_figures_is_refused(cap):
    with pytest.raises(WireError, match="malformed TXT record"):
        decode_txt({"id": "n1", "cl": "home", "port": "80", "cap": cap})


def test_a_key_that_is_not_utf8_is_refused():
    with pytest.raises(WireError, match="TXT record is not UTF-8"):
        decode_txt({b"\xff": b"x", b"id": b"n1"})


@pytest.mark.parametrize("data", [None, [], "advert", 7])
def test_describe_json_that_is_not_an_object_is_refused(data):
    with pytest.raises(WireError, match="malformed node description: not an object"):
        NodeAdvert.from_json(data)


def test_describe_json_reads_an_election_only_with_an_orchestrator_and_its_epoch():
    data = advert(election=Election("boss", 4), peer_port=9443).to_json()
    assert (data["orchestrator"], data["epoch"], data["peer_port"]) == ("boss", 4, 9443)
    assert NodeAdvert.from_json({**data, "orchestrator": None}).election is None
    assert NodeAdvert.from_json({k: v for k, v in data.items() if k != "peer_port"}).peer_port == 0
    with pytest.raises(WireError, match="malformed node description: epoch must be an integer >= 1"):
        NodeAdvert.from_json({k: v for k, v in data.items() if k != "epoch"})


def test_only_true_marks_a_configured_orchestrator_in_the_json_form():
    body = advert(configured_orchestrator=True).to_json()
    assert NodeAdvert.from_json(body).configured_orchestrator is True
    for value in ("false", "true", 1, None):
        assert NodeAdvert.from_json({**body, "configured_orchestrator": value}).configured_orchestrator is False
