"""Capacity of a node and its score (design §1).

score(n) = (w_v·VRAM + w_r·RAM + w_n·NPU − w_l·latency/100) · (1 − 0.5·load), floored at 1e-3,
with w = (2.0, 0.5, 1.5, 0.25) normalised to sum 1. VRAM and RAM are in GiB, NPU in TOPS,
latency in milliseconds and load in [0, 1].

The score is exact: a rational number computed from the figures as written (a float counts as
its shortest decimal form, so 0.1 GiB is 1/10 GiB), with exact weights (8/17, 2/17, 6/17,
1/17). Equal figures give equal scores and proportional figures give proportional scores, so
the planner's tie rules (§2) decide ties, never floating-point rounding.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping, Union

from agent.core.errors import InvalidNodeError

Number = Union[int, float, Fraction]
"""What scores, latencies and costs may be given as: int, float or an exact Fraction."""

_RAW_WEIGHTS = (Fraction(2), Fraction(1, 2), Fraction(3, 2), Fraction(1, 4))
WEIGHT_VRAM, WEIGHT_RAM, WEIGHT_NPU, WEIGHT_LATENCY = (w / sum(_RAW_WEIGHTS) for w in _RAW_WEIGHTS)
SCORE_FLOOR = Fraction(1, 1000)
LOAD_PENALTY = Fraction(1, 2)
MAX_NODE_ID_LENGTH = 64


def is_number(value: object) -> bool:
    """True for an int, float or other rational number (a bool is not a number here)."""
    return not isinstance(value, bool) and isinstance(value, (int, float, numbers.Rational))


def exact(value: Number) -> Fraction:
    """``value`` as an exact Fraction: ints and rationals as they are, a float as its shortest
    decimal form (``repr``), so that 0.1 is 1/10 and not the binary neighbour of 1/10.

    Distinct floats stay distinct and keep their order. A non-finite float is a ValueError.
    """
    if isinstance(value, Fraction):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not a finite number")
        return Fraction(repr(float(value)))  # float(): a float subclass may print otherwise
    if is_number(value):
        return Fraction(value.numerator, value.denominator)  # type: ignore[union-attr]
    raise TypeError(f"{value!r} is not a number")


def validate_node_id(node_id: object) -> str:
    """Return ``node_id`` if it is a usable node id, else raise InvalidNodeError."""
    if not isinstance(node_id, str) or not node_id:
        raise InvalidNodeError(f"node id must be a non-empty string, got {node_id!r}")
    if len(node_id) > MAX_NODE_ID_LENGTH or not node_id.isprintable() or node_id != node_id.strip():
        raise InvalidNodeError(
            f"node id {node_id!r} must be printable, without surrounding spaces, "
            f"at most {MAX_NODE_ID_LENGTH} characters"
        )
    return node_id


def _finite_non_negative(node_id: str, field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidNodeError(f"node {node_id!r}: {field} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise InvalidNodeError(f"node {node_id!r}: {field} must be finite and >= 0, got {value!r}")
    return number


@dataclass(frozen=True)
class NodeCapacity:
    """What a node declares about itself; validated on construction."""

    node_id: str
    vram_gib: float = 0.0
    ram_gib: float = 0.0
    npu_tops: float = 0.0
    latency_ms: float = 0.0
    load: float = 0.0

    def __post_init__(self) -> None:
        validate_node_id(self.node_id)
        for field in ("vram_gib", "ram_gib", "npu_tops", "latency_ms", "load"):
            object.__setattr__(self, field, _finite_non_negative(self.node_id, field, getattr(self, field)))
        if self.load > 1.0:
            raise InvalidNodeError(f"node {self.node_id!r}: load must be in [0, 1], got {self.load!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeCapacity:
        """Build from a JSON object with ``id`` (or ``node_id``) and the capacity fields."""
        if not isinstance(data, Mapping):
            raise InvalidNodeError(f"a node must be a JSON object, got {type(data).__name__}")
        node_id = data.get("id", data.get("node_id"))
        if node_id is None:
            raise InvalidNodeError(f"node {dict(data)!r} is missing the field 'id'")
        known = {"id", "node_id", "vram_gib", "ram_gib", "npu_tops", "latency_ms", "load"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidNodeError(f"node {node_id!r}: unknown field(s) {', '.join(unknown)}")
        missing = [f for f in ("vram_gib", "ram_gib", "npu_tops", "latency_ms", "load") if f not in data]
        if missing:
            raise InvalidNodeError(f"node {node_id!r} is missing the field(s) {', '.join(missing)}")
        return cls(
            node_id=node_id,
            vram_gib=data["vram_gib"],
            ram_gib=data["ram_gib"],
            npu_tops=data["npu_tops"],
            latency_ms=data["latency_ms"],
            load=data["load"],
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.node_id,
            "vram_gib": self.vram_gib,
            "ram_gib": self.ram_gib,
            "npu_tops": self.npu_tops,
            "latency_ms": self.latency_ms,
            "load": self.load,
        }


def score(node: NodeCapacity) -> Fraction:
    """The capacity score of §1, exact (always >= SCORE_FLOOR); ``float()`` it for display."""
    raw = (
        WEIGHT_VRAM * exact(node.vram_gib)
        + WEIGHT_RAM * exact(node.ram_gib)
        + WEIGHT_NPU * exact(node.npu_tops)
        - WEIGHT_LATENCY * exact(node.latency_ms) / 100
    )
    return max(SCORE_FLOOR, raw * (1 - LOAD_PENALTY * exact(node.load)))


def credited_capacity(detected: NodeCapacity, usable_kinds: frozenset[str] | set[str], *,
                      measured_npu_tops: float | None = None, npu_tops: float | None = None,
                      vram_gib: float | None = None, ram_gib: float | None = None) -> NodeCapacity:
    """What the score may count of what was ``detected`` (the board table, NVML, free RAM).

    NPU TOPS count only when a backend that runs on an NPU passed its self-test (``"npu" in
    usable_kinds``), and then what it measured (``measured_npu_tops``), never more than the
    table's figure; a detected GPU's memory counts only when a GPU backend passed. On a device
    whose GPU shares system memory (Jetson) that memory then counts as RAM. Configured figures
    (``npu_tops``, ``vram_gib``, ``ram_gib``) are the operator's word and win.
    """
    vram = detected.vram_gib if "gpu" in usable_kinds else 0.0
    ram = detected.ram_gib
    if "gpu" not in usable_kinds and detected.ram_gib == 0.0:
        ram = detected.vram_gib  # unified memory with no usable GPU: the layers run from RAM
    return NodeCapacity(
        node_id=detected.node_id,
        vram_gib=vram if vram_gib is None else vram_gib,
        ram_gib=ram if ram_gib is None else ram_gib,
        npu_tops=_credited_tops(detected.npu_tops, usable_kinds, measured_npu_tops) if npu_tops is None else npu_tops,
        latency_ms=detected.latency_ms,
        load=detected.load,
    )


def _credited_tops(table_tops: float, usable_kinds: frozenset[str] | set[str], measured: float | None) -> float:
    if "npu" not in usable_kinds:
        return 0.0
    if measured is None:
        return table_tops
    return min(measured, table_tops) if table_tops > 0 else measured
