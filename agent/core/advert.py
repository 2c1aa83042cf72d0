"""What a node says about itself, on mDNS TXT records and in `describe` answers.

Never carries a secret. TXT values are bounded (each key=value <= 255 bytes, the whole
record under MAX_TXT_BYTES); malformed records raise WireError and are ignored by discovery.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from agent.core.capacity import NodeCapacity, validate_node_id
from agent.core.election import Election
from agent.core.errors import InvalidNodeError, WireError

SERVICE_TYPE = "_ncm._tcp.local."
MAX_TXT_BYTES = 400
ROLES = ("orchestrator", "worker")


@dataclass(frozen=True)
class NodeAdvert:
    node_id: str
    cluster: str
    api_port: int
    version: str
    role: str
    capacity: NodeCapacity
    election: Election | None = None
    configured_orchestrator: bool = False
    peer_port: int = 0  # where its internal endpoints answer over TLS (0: not known, as in mDNS TXT)

    def __post_init__(self) -> None:
        validate_node_id(self.node_id)
        if not 0 <= self.peer_port < 65536:
            raise WireError(f"peer port {self.peer_port} is out of range")
        if self.capacity.node_id != self.node_id:
            raise WireError("capacity belongs to another node")
        if not 0 < self.api_port < 65536:
            raise WireError(f"api port {self.api_port} is out of range")
        if self.role not in ROLES:
            raise WireError(f"unknown role {self.role!r}")
        if not self.cluster or len(self.cluster) > 63:
            raise WireError("cluster name must be 1-63 characters")
        if len(self.version) > 32:
            raise WireError("version is too long")

    def to_json(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "cluster": self.cluster,
            "api_port": self.api_port,
            "version": self.version,
            "role": self.role,
            "capacity": self.capacity.to_dict(),
            "orchestrator": self.election.orchestrator if self.election else None,
            "epoch": self.election.epoch if self.election else 0,
            "configured_orchestrator": self.configured_orchestrator,
            "peer_port": self.peer_port,
        }

    @classmethod
    def from_json(cls, data: Any) -> NodeAdvert:
        try:
            if not isinstance(data, Mapping):
                raise TypeError("not an object")
            orchestrator, epoch = data.get("orchestrator"), data.get("epoch", 0)
            return cls(
                node_id=data["node_id"],
                cluster=data["cluster"],
                api_port=int(data["api_port"]),
                version=str(data["version"]),
                role=data["role"],
                capacity=NodeCapacity.from_dict(data["capacity"]),
                election=Election(orchestrator, int(epoch)) if orchestrator else None,
                configured_orchestrator=data.get("configured_orchestrator", False) is True,
                peer_port=int(data.get("peer_port", 0)),
            )
        except (KeyError, TypeError, ValueError, OverflowError, InvalidNodeError) as error:
            raise WireError(f"malformed node description: {error}") from None


def _number(value: float) -> str:
    return f"{value:.3f}".rstrip("0").rstrip(".")


def encode_txt(advert: NodeAdvert) -> dict[str, str]:
    c = advert.capacity
    properties = {
        "id": advert.node_id,
        "cl": advert.cluster,
        "port": str(advert.api_port),
        "v": advert.version,
        "role": advert.role,
        "cap": ",".join(_number(x) for x in (c.vram_gib, c.ram_gib, c.npu_tops, c.latency_ms, c.load)),
    }
    if advert.configured_orchestrator:
        properties["cfg"] = "1"
    if advert.election is not None:
        properties["orc"] = advert.election.orchestrator
        properties["ep"] = str(advert.election.epoch)
    for key, value in properties.items():
        if len(key.encode()) + 1 + len(value.encode()) > 255:
            raise WireError(f"TXT entry {key!r} is longer than 255 bytes")
    if sum(len(k.encode()) + len(v.encode()) + 2 for k, v in properties.items()) > MAX_TXT_BYTES:
        raise WireError(f"TXT record would exceed {MAX_TXT_BYTES} bytes")
    return properties


def decode_txt(properties: Mapping[bytes | str, bytes | str | None]) -> NodeAdvert:
    """Parse TXT properties (as python-zeroconf gives them) or raise WireError."""
    text: dict[str, str] = {}
    for key, value in properties.items():
        try:
            k = key.decode() if isinstance(key, bytes) else key
            v = value.decode() if isinstance(value, bytes) else (value or "")
        except UnicodeDecodeError:
            raise WireError("TXT record is not UTF-8") from None
        text[k] = v
    try:
        vram, ram, npu, latency, load = (float(x) for x in text["cap"].split(","))
        if not all(math.isfinite(x) for x in (vram, ram, npu, latency, load)):
            raise ValueError("non-finite capacity")
        node_id = text["id"]
        election = Election(text["orc"], int(text["ep"])) if "orc" in text else None
        return NodeAdvert(
            node_id=node_id,
            cluster=text["cl"],
            api_port=int(text["port"]),
            version=text.get("v", "?"),
            role=text.get("role", "worker"),
            capacity=NodeCapacity(node_id, vram, ram, npu, latency, load),
            election=election,
            configured_orchestrator=text.get("cfg") == "1",
        )
    except (KeyError, ValueError, TypeError, InvalidNodeError) as error:
        raise WireError(f"malformed TXT record: {error}") from None
