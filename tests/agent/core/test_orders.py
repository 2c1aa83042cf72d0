"""Routing orders (agent.core.orders): what a valid RoutingOrder accepts and refuses, its JSON
round trip, and the views a worker reads from it (its hops and ranges, the weight sources and
the per-layer forwarding table)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.errors import WireError
from agent.core.orders import RoutingOrder
from agent.core.plan import LayerRange
from agent.core.routing import Hop, Route

NODES = ["a", "b", "c", "d"]
PLAN_VALUES = st.none() | st.booleans() | st.integers(-10, 10**6) | st.text(max_size=6)


def route_of(*hops: tuple[str, int, int]) -> Route:
    return Route(tuple(Hop(node, LayerRange(first, last)) for node, first, last in hops))


def addresses_of(*nodes: str) -> dict[str, str]:
    return {node: f"https://{node}.local:8443" for node in nodes}


def example_order(**changes) -> RoutingOrder:
    """a 0-3, b 4-7, a 8-9 (10 layers), weights from c then a, b standing by for 0-3."""
    fields = dict(epoch=2, orchestrator="a", plan_version=3, model="llama", total_layers=10,
                  route=route_of(("a", 0, 3), ("b", 4, 7), ("a", 8, 9)), addresses=addresses_of("a", "b", "c"),
                  weight_sources=("c", "a"), standby={"b": (LayerRange(0, 3),)})
    return RoutingOrder(**{**fields, **changes})


@st.composite
def routes(draw: st.DrawFn) -> Route:
    """Contiguous hops over 1..40 layers, a node possibly serving several hops."""
    total = draw(st.integers(1, 40))
    cuts = sorted(draw(st.sets(st.integers(1, total - 1), max_size=6))) if total > 1 else []
    bounds = [0, *cuts, total]
    return Route(tuple(Hop(draw(st.sampled_from(NODES)), LayerRange(first, nxt - 1))
                       for first, nxt in zip(bounds, bounds[1:])))


@st.composite
def orders(draw: st.DrawFn) -> RoutingOrder:
    route = draw(routes())
    total = route.total_layers
    known = sorted(set(route.nodes) | set(draw(st.sets(st.sampled_from([*NODES, "e"])))))
    layer_ranges = st.tuples(st.integers(0, total - 1), st.integers(0, total - 1)).map(
        lambda pair: LayerRange(min(pair), max(pair)))
    max_context = draw(st.integers(0, 8192))
    return RoutingOrder(
        epoch=draw(st.integers(1, 10**6)),
        orchestrator=draw(st.sampled_from(known)),
        plan_version=draw(st.integers(1, 10**6)),
        model=draw(st.sampled_from(["llama", "qwen", "smollm2-135m"])),
        total_layers=total,
        route=route,
        addresses=addresses_of(*known),
        weight_sources=tuple(draw(st.lists(st.sampled_from(known), unique=True))),
        plan=draw(st.dictionaries(st.text(max_size=6), PLAN_VALUES | st.lists(PLAN_VALUES, max_size=3), max_size=4)),
        degraded=draw(st.booleans()),
        standby=draw(st.dictionaries(st.sampled_from(known), st.lists(layer_ranges, max_size=3).map(tuple),
                                     max_size=3)),
        name=draw(st.sampled_from(["", "chat", "llama"])),
        max_context=max_context,
        prefill_chunk=draw(st.integers(0, max_context or 4096)),
        standby_later=draw(st.booleans()),
    )


@given(orders())
def test_an_order_survives_json_text_unchanged(order):
    assert RoutingOrder.from_json(json.loads(json.dumps(order.to_json()))) == order


@given(orders())
def test_a_worker_walking_the_forwarding_table_from_layer_0_follows_every_hop_in_order(order):
    walked, layer = [], 0
    while True:
        hop = order.hop_starting_at(layer)
        assert hop is not None
        walked.append(hop)
        following = order.next_after(hop.layers.last)
        if following is None:
            break
        layer = hop.layers.last + 1
        assert order.hop_starting_at(layer).node_id == following
    assert tuple(walked) == order.route.hops and walked[-1].layers.last == order.total_layers - 1


@given(orders(), st.integers(-5, 50))
def test_only_the_first_layer_of_a_hop_starts_one_and_only_its_last_forwards(order, layer):
    firsts = {hop.layers.first for hop in order.route.hops}
    lasts = {hop.layers.last for hop in order.route.hops[:-1]}
    assert (order.hop_starting_at(layer) is not None) == (layer in firsts)
    assert (order.next_after(layer) is not None) == (layer in lasts)


@given(orders())
def test_the_hops_of_all_nodes_cover_every_layer_once_and_standby_only_adds_ranges(order):
    covered: list[int] = []
    for node in NODES + ["e"]:
        hops = order.hops_of(node)
        assert all(hop.node_id == node for hop in hops)
        covered += [layer for hop in hops for layer in range(hop.layers.first, hop.layers.last + 1)]
        ranges = order.ranges_for(node)
        assert {(hop.layers.first, hop.layers.last) for hop in hops} <= ranges
        assert ranges - {(h.layers.first, h.layers.last) for h in hops} <= {
            (r.first, r.last) for r in order.standby.get(node, ())}
        assert all(0 <= first <= last < order.total_layers for first, last in ranges)
    assert sorted(covered) == list(range(order.total_layers))


@given(orders())
def test_weight_sources_come_best_first_with_their_addresses(order):
    assert order.sources() == [(node, order.addresses[node]) for node in order.weight_sources]
    assert [node for node, _ in order.sources()] == list(order.weight_sources)


@given(orders(), st.data())
def test_an_order_without_the_address_of_a_node_it_names_is_refused(order, data):
    named = sorted(set(order.route.nodes) | set(order.weight_sources))
    dropped = data.draw(st.sampled_from(named))
    wire = order.to_json()
    wire["addresses"] = {n: url for n, url in wire["addresses"].items() if n != dropped}
    with pytest.raises(WireError, match=f"routing order: no address for .*{dropped}"):
        RoutingOrder.from_json(wire)


@given(orders(), st.integers(-3, 3).filter(bool))
def test_an_order_whose_route_does_not_cover_the_model_is_refused(order, delta):
    wire = {**order.to_json(), "total_layers": order.total_layers + delta}
    with pytest.raises(WireError, match="routing order: route covers"):
        RoutingOrder.from_json(wire)


@given(st.integers(-100, 100), st.integers(-100, 100), st.integers(-3, 3), st.integers(-3, 3))
def test_counters_and_context_settings_are_checked(max_context, prefill_chunk, epoch, plan_version):
    valid = (max_context >= 0 and prefill_chunk >= 0 and (max_context == 0 or prefill_chunk <= max_context)
             and epoch >= 1 and plan_version >= 1)
    try:
        example_order(max_context=max_context, prefill_chunk=prefill_chunk, epoch=epoch, plan_version=plan_version)
    except WireError as error:
        assert not valid and str(error).startswith("routing order: ")
    else:
        assert valid


def test_the_served_name_defaults_to_the_model():
    assert example_order().name == "llama"
    assert example_order(name="chat").name == "chat"
    assert example_order().to_json()["name"] == "llama"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"epoch": 0}, "routing order: epoch and plan_version must be >= 1"),
        ({"plan_version": 0}, "routing order: epoch and plan_version must be >= 1"),
        ({"total_layers": 12}, "routing order: route covers 10 layers, model has 12"),
        ({"addresses": addresses_of("a", "c")}, "routing order: no address for b"),
        ({"weight_sources": ("z",)}, "routing order: no address for z"),
        ({"standby": {"c": (LayerRange(8, 10),)}}, "routing order: standby range of c is beyond the last layer"),
        ({"max_context": -1}, "routing order: max_context and prefill_chunk must be >= 0"),
        ({"max_context": 512, "prefill_chunk": 1024}, "prefill_chunk <= max_context"),
    ],
)
def test_invalid_orders_are_refused_with_a_reason(changes, message):
    with pytest.raises(WireError, match=message.replace("(", r"\(")):
        example_order(**changes)


def test_a_prefill_chunk_is_free_when_the_context_is_left_to_the_worker():
    assert example_order(max_context=0, prefill_chunk=4096).prefill_chunk == 4096


def test_the_views_of_the_example_order():
    order = example_order()
    assert order.hops_of("a") == [Hop("a", LayerRange(0, 3)), Hop("a", LayerRange(8, 9))]
    assert order.ranges_for("a") == {(0, 3), (8, 9)}
    assert order.ranges_for("b") == {(4, 7), (0, 3)}
    assert order.ranges_for("c") == set() and order.hops_of("c") == []
    assert [order.next_after(layer) for layer in (3, 7, 9, 5)] == ["b", "a", None, None]
    assert order.hop_starting_at(4) == Hop("b", LayerRange(4, 7)) and order.hop_starting_at(5) is None
    assert order.sources() == [("c", "https://c.local:8443"), ("a", "https://a.local:8443")]


def test_defaults_are_read_for_the_optional_fields():
    order = RoutingOrder.from_json({"epoch": 1, "orchestrator": "a", "plan_version": 1, "model": "m", "total_layers": 2,
                                    "route": [{"node": "a", "layers": [0, 1]}], "addresses": addresses_of("a")})
    assert (order.weight_sources, dict(order.plan), order.degraded, dict(order.standby)) == ((), {}, False, {})
    assert (order.name, order.max_context, order.prefill_chunk, order.standby_later) == ("m", 0, 0, False)


@pytest.mark.parametrize(
    "changes",
    [
        {"route": [{"node": "a", "layers": [0, 4]}, {"node": "b", "layers": [6, 9]}]},
        {"route": [{"node": "a", "layers": [3, 0]}]},
        {"route": [{"node": "a"}]},
        {"route": []},
        {"addresses": [["a", "https://a"]]},
        {"addresses": {"a": 1, "b": "https://b", "c": "https://c"}},
        {"standby": {"b": [[0, 1, 2]]}},
        {"epoch": "first"},
        {"epoch": None},
    ],
)
def test_malformed_json_is_refused_as_a_malformed_order(changes):
    with pytest.raises(WireError, match="malformed routing order"):
        RoutingOrder.from_json({**example_order().to_json(), **changes})


@pytest.mark.parametrize("data", [None, [], "order", 3])
def test_json_that_is_not_an_object_is_refused(data):
    with pytest.raises(WireError, match="malformed routing order"):
        RoutingOrder.from_json(data)


def test_a_well_formed_but_invalid_order_keeps_its_reason():
    with pytest.raises(WireError, match="^routing order: route covers 10 layers, model has 11$"):
        RoutingOrder.from_json({**example_order().to_json(), "total_layers": 11})


@pytest.mark.parametrize("field, value", [("epoch", 1.9), ("plan_version", True), ("degraded", "false"),
                                          ("weight_sources", "ab"), ("total_layers", "30")])
def test_a_field_of_another_type_is_refused_never_truncated(field, value):
    data = {**example_order().to_json(), field: value}
    with pytest.raises(WireError, match="malformed routing order"):
        RoutingOrder.from_json(data)


def copies_order(**changes) -> RoutingOrder:
    """Whole copies (design §11): the route one hop on a over 6 layers, b and c serving alone."""
    return RoutingOrder(**{**dict(epoch=1, orchestrator="a", plan_version=2, model="llama", total_layers=6,
                                  route=route_of(("a", 0, 5)), addresses=addresses_of("a", "b", "c"),
                                  copies=("b", "c")), **changes})


def test_a_copy_serves_the_whole_model_from_layer_0_and_is_the_tail():
    order = RoutingOrder.from_json(json.loads(json.dumps(copies_order().to_json())))
    assert order == copies_order()
    for node in "abc":
        assert order.hops_of(node) == [Hop(node, LayerRange(0, 5))]
        assert order.hop_at(node, 0) == Hop(node, LayerRange(0, 5))
        assert order.hop_at(node, 3) is None
        assert order.ranges_for(node) == {(0, 5)}
    assert order.next_after(5) is None
    assert order.hop_at("d", 0) is None


def test_a_request_on_a_copy_sees_a_route_of_that_copy_alone():
    order = copies_order()
    on_b = order.on_copy("b")
    assert on_b.route == route_of(("b", 0, 5)) and on_b.copies == () and on_b.plan_version == order.plan_version
    assert order.on_copy("a") is order and order.on_copy("d") is order  # the route's own head; no copy there
    split = example_order()
    assert split.on_copy("b") is split


@pytest.mark.parametrize("changes", [
    dict(route=route_of(("a", 0, 2), ("b", 3, 5)), copies=("c",)),  # a split route has no copies
    dict(copies=("a",)),  # the route's node
    dict(copies=("b", "b")),
    dict(copies=("d",)),  # no address
])
def test_copies_that_cannot_serve_alone_are_refused(changes):
    with pytest.raises(WireError):
        copies_order(**changes)
