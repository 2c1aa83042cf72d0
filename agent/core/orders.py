"""Orders from the orchestrator to workers (`set_routing`), validated on construction.

An order carries the whole plan and route so that every worker knows which layer ranges it
serves (its hops) and, after the fragment that ends at layer L, which node serves L+1.
Workers refuse orders from an older epoch than the newest they have obeyed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Mapping

from agent.core.errors import WireError
from agent.core.plan import LayerRange
from agent.core.routing import Hop, Route, forwarding_table


def _whole(value: Any) -> int:
    """An integer of a routing order as sent: a float or a bool is refused, never truncated."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {value!r}")
    return value


def _listed(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class RoutingOrder:
    epoch: int
    orchestrator: str
    plan_version: int
    model: str
    total_layers: int
    route: Route
    addresses: Mapping[str, str]
    weight_sources: tuple[str, ...] = ()  # node ids to fetch weights from, best first (URLs in addresses)
    plan: Mapping[str, Any] = field(default_factory=dict)
    degraded: bool = False
    standby: Mapping[str, tuple[LayerRange, ...]] = field(default_factory=dict)
    name: str = ""  # the router's name of what is served (its fallback model runs under it); "" = model
    max_context: int = 0  # per-model settings for the fragments; 0 = the worker's configuration
    prefill_chunk: int = 0
    standby_later: bool = False  # a failover: stage the hops now, build the standby ranges after
    copies: tuple[str, ...] = ()  # nodes besides the route's that serve whole requests on their own (design §11)

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.model)
        if self.max_context < 0 or self.prefill_chunk < 0 or (self.max_context and self.prefill_chunk > self.max_context):
            raise WireError("routing order: max_context and prefill_chunk must be >= 0, prefill_chunk <= max_context")
        if self.epoch < 1 or self.plan_version < 1:
            raise WireError("routing order: epoch and plan_version must be >= 1")
        if self.route.total_layers != self.total_layers:
            raise WireError(f"routing order: route covers {self.route.total_layers} layers, model has {self.total_layers}")
        missing = [n for n in (*self.route.nodes, *self.weight_sources, *self.copies) if n not in self.addresses]
        if missing:
            raise WireError(f"routing order: no address for {', '.join(missing)}")
        for node, ranges in self.standby.items():
            if any(r.last >= self.total_layers for r in ranges):
                raise WireError(f"routing order: standby range of {node} is beyond the last layer")
        if self.copies and (len(self.route.hops) != 1 or set(self.copies) & set(self.route.nodes)
                            or len(set(self.copies)) != len(self.copies)):
            raise WireError("routing order: copies go with a route of one hop, each on another node")

    def sources(self) -> list[tuple[str, str]]:
        """(node id, URL) of each weight source, best first."""
        return [(node, self.addresses[node]) for node in self.weight_sources]

    def hops_of(self, node_id: str) -> list[Hop]:
        """The hops ``node_id`` serves: on the route, or its whole copy of the model."""
        hops = [hop for hop in self.route.hops if hop.node_id == node_id]
        return hops + [self._copy_hop(node_id)] if node_id in self.copies else hops

    def _copy_hop(self, node_id: str) -> Hop:
        return Hop(node_id, LayerRange(0, self.total_layers - 1))

    def hop_at(self, node_id: str, layer: int) -> Hop | None:
        """The hop ``node_id`` serves that starts at ``layer`` (None: it serves none)."""
        hop = self.hop_starting_at(layer)
        if hop is not None and hop.node_id == node_id:
            return hop
        return self._copy_hop(node_id) if layer == 0 and node_id in self.copies else None

    def on_copy(self, node_id: str) -> RoutingOrder:
        """This order as a request on ``node_id``'s copy sees it: its route that one whole hop
        (the orchestrator's view of one request; the nodes hold the order as sent). A node
        that holds no copy of it (the route's own head): the order itself."""
        if node_id not in self.copies:
            return self
        return replace(self, route=Route((self._copy_hop(node_id),)), copies=())

    def ranges_for(self, node_id: str) -> set[tuple[int, int]]:
        """Layer ranges ``node_id`` must hold: its hops, and the standby ranges for failover."""
        ranges = {(hop.layers.first, hop.layers.last) for hop in self.hops_of(node_id)}
        return ranges | {(r.first, r.last) for r in self.standby.get(node_id, ())}

    @cached_property
    def _hops_by_first_layer(self) -> dict[int, Hop]:
        return {hop.layers.first: hop for hop in self.route.hops}

    @cached_property
    def _forwarding(self) -> dict[int, str | None]:
        return forwarding_table(self.route)

    def hop_starting_at(self, layer: int) -> Hop | None:
        return self._hops_by_first_layer.get(layer)

    def next_after(self, last_layer: int) -> str | None:
        """Node serving ``last_layer + 1`` (None after the tail): the per-layer forwarding table."""
        return self._forwarding.get(last_layer)

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "orchestrator": self.orchestrator,
            "plan_version": self.plan_version,
            "model": self.model,
            "total_layers": self.total_layers,
            "route": self.route.to_list(),
            "addresses": dict(self.addresses),
            "weight_sources": list(self.weight_sources),
            "plan": dict(self.plan),
            "degraded": self.degraded,
            "standby": {node: [r.to_list() for r in ranges] for node, ranges in self.standby.items()},
            "name": self.name,
            "max_context": self.max_context,
            "prefill_chunk": self.prefill_chunk,
            "standby_later": self.standby_later,
            "copies": list(self.copies),
        }

    @classmethod
    def from_json(cls, data: Any) -> RoutingOrder:
        try:
            hops = tuple(Hop(str(h["node"]), LayerRange(_whole(h["layers"][0]), _whole(h["layers"][1]))) for h in data["route"])
            addresses = data["addresses"]
            if not isinstance(addresses, dict) or not all(isinstance(v, str) for v in addresses.values()):
                raise TypeError("addresses must map node ids to URLs")
            return cls(
                epoch=_whole(data["epoch"]),
                orchestrator=str(data["orchestrator"]),
                plan_version=_whole(data["plan_version"]),
                model=str(data["model"]),
                total_layers=_whole(data["total_layers"]),
                route=Route(hops),
                addresses=dict(addresses),
                weight_sources=tuple(str(u) for u in _listed(data.get("weight_sources", []))),
                plan=dict(data.get("plan", {})),
                degraded=_flag(data.get("degraded", False)),
                standby={
                    str(node): tuple(LayerRange(_whole(a), _whole(b)) for a, b in ranges)
                    for node, ranges in dict(data.get("standby", {})).items()
                },
                name=str(data.get("name", "")),
                max_context=_whole(data.get("max_context", 0)),
                prefill_chunk=_whole(data.get("prefill_chunk", 0)),
                standby_later=_flag(data.get("standby_later", False)),
                copies=tuple(str(n) for n in _listed(data.get("copies", []))),
            )
        except WireError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, OverflowError) as error:
            raise WireError(f"malformed routing order: {error}") from None
