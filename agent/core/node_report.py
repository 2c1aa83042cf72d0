"""What a node reports of itself to its peers, read once where it arrives. Pure.

A node's describe answer carries, besides its advert, what it stores, what its worker serves
and its device memory (:class:`NodeReport`); a worker's status (:class:`WorkerReport`) is also
the answer to a staged order; a node that cannot stage an order says why (:class:`StageFault`).
Each is validated here, field by field, when it comes in: a field a peer sends malformed is
read as absent, never as something else, and the readers (the deployer, a new orchestrator's
adoption, the router's ledger, the embedding placement) see typed values only. ``raw`` keeps
what the node sent, for the views that show it (``/cluster/nodes``, the dashboard).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.core.errors import NcmError
from agent.core.orders import RoutingOrder


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _sizes(value: Any) -> dict[str, int]:
    """A ``{name: bytes}`` mapping, its malformed entries left out."""
    if not isinstance(value, Mapping):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and _int(v) is not None and v >= 0}


@dataclass(frozen=True)
class StageFault:
    """Why a node could not stage an order: a short ``cause`` (``disk_full``, ``out_of_memory``,
    ``corrupt_weights``, ``fetch_failed``...) and the error's text; ``model`` and
    ``plan_version`` name the order when the worker knew it."""

    cause: str
    message: str
    model: str | None = None
    plan_version: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The worker's ``fault`` and the body of a refused stage (its ``error`` is the message)."""
        return {"cause": self.cause, "message": self.message, "error": self.message, "model": self.model,
                "plan_version": self.plan_version}

    @classmethod
    def from_json(cls, body: Any) -> StageFault | None:
        """The fault in ``body`` (None: it holds none)."""
        if not isinstance(body, Mapping) or not isinstance(body.get("cause"), str) or not body["cause"]:
            return None
        message = body.get("message", body.get("error"))
        model = body.get("model")
        return cls(body["cause"], message if isinstance(message, str) else "", model if isinstance(model, str) else None,
                   _int(body.get("plan_version")))


@dataclass(frozen=True)
class WorkerReport:
    """A worker's status: the orders it serves, the models it holds (served or staged), the
    memory a staged order took, its newest plan and its fault."""

    orders: tuple[RoutingOrder, ...] = ()
    served: frozenset[str] = frozenset()
    staged_bytes: Mapping[str, int] = field(default_factory=dict)
    plan_version: int | None = None
    fault: StageFault | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def held(self) -> frozenset[str]:
        """The models whose orders this worker holds, served or staged."""
        return self.served | frozenset(self.staged_bytes)

    @classmethod
    def from_json(cls, body: Any) -> WorkerReport:
        if not isinstance(body, Mapping):
            return cls()
        orders = []
        for raw in body.get("orders") if isinstance(body.get("orders"), list) else []:
            try:
                orders.append(RoutingOrder.from_json(raw))
            except NcmError:
                continue
        models = body.get("models")
        staged = body.get("staged")
        staged_bytes = {name: _int(entry.get("memory_bytes")) or 0 for name, entry in staged.items()
                        if isinstance(name, str) and isinstance(entry, Mapping)} if isinstance(staged, Mapping) else {}
        return cls(tuple(orders), frozenset(n for n in models if isinstance(n, str)) if isinstance(models, Mapping)
                   else frozenset(), staged_bytes, _int(body.get("plan_version")), StageFault.from_json(body.get("fault")),
                   dict(body))


@dataclass(frozen=True)
class OpenEmbeddingModel:
    """An embedding model a node holds open: the memory it takes and in how many seconds it
    closes if left idle (None: not until asked)."""

    bytes: int
    expires_in_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "expires_in_s": self.expires_in_s}


@dataclass(frozen=True)
class NodeReport:
    """What a node describes of itself beyond its advert: the complete models it stores
    (name -> bytes), its worker's report, its device memory (``total_bytes``,
    ``external_bytes``...) and the embedding models it holds open."""

    models: Mapping[str, int] = field(default_factory=dict)
    worker: WorkerReport = field(default_factory=WorkerReport)
    device_memory: Mapping[str, int] | None = None
    embedding_models: Mapping[str, OpenEmbeddingModel] = field(default_factory=dict)
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"models": dict(self.models), "worker": dict(self.worker.raw),
                "device_memory": None if self.device_memory is None else dict(self.device_memory),
                "embedding_models": {name: model.to_json() for name, model in self.embedding_models.items()}}

    @classmethod
    def from_json(cls, body: Any) -> NodeReport:
        if not isinstance(body, Mapping):
            return cls()
        open_models = {}
        described = body.get("embedding_models")
        for name, entry in described.items() if isinstance(described, Mapping) else ():
            if isinstance(name, str) and isinstance(entry, Mapping) and _int(entry.get("bytes")) is not None:
                expires_in_s = entry.get("expires_in_s")
                open_models[name] = OpenEmbeddingModel(
                    entry["bytes"], float(expires_in_s) if isinstance(expires_in_s, (int, float))
                    and not isinstance(expires_in_s, bool) else None)
        memory = body.get("device_memory")
        return cls(_sizes(body.get("models")), WorkerReport.from_json(body.get("worker")),
                   _sizes(memory) if isinstance(memory, Mapping) else None, open_models, dict(body))
