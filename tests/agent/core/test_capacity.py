import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.capacity import (
    SCORE_FLOOR,
    WEIGHT_LATENCY,
    WEIGHT_NPU,
    WEIGHT_RAM,
    WEIGHT_VRAM,
    NodeCapacity,
    score,
)
from agent.core.errors import InvalidNodeError, NcmError
from tests.agent.core.strategies import capacities, integer_clusters


def test_weights_are_the_design_weights_normalised():
    assert (WEIGHT_VRAM, WEIGHT_RAM, WEIGHT_NPU, WEIGHT_LATENCY) == pytest.approx((2 / 4.25, 0.5 / 4.25, 1.5 / 4.25, 0.25 / 4.25))
    assert WEIGHT_VRAM + WEIGHT_RAM + WEIGHT_NPU + WEIGHT_LATENCY == pytest.approx(1.0)


def test_weights_and_floor_are_exact():
    assert (WEIGHT_VRAM, WEIGHT_RAM, WEIGHT_NPU, WEIGHT_LATENCY) == (
        Fraction(8, 17), Fraction(2, 17), Fraction(6, 17), Fraction(1, 17))
    assert WEIGHT_VRAM + WEIGHT_RAM + WEIGHT_NPU + WEIGHT_LATENCY == 1
    assert SCORE_FLOOR == Fraction(1, 1000)


def test_score_is_exact_from_the_figures_as_written():
    assert score(NodeCapacity("n", ram_gib=1)) == Fraction(2, 17)
    assert score(NodeCapacity("n", ram_gib=3)) == 3 * score(NodeCapacity("n", ram_gib=1))
    # 0.1 GiB is a tenth of a GiB, 0.1 load takes off 1/20: not their binary neighbours.
    assert score(NodeCapacity("n", vram_gib=0.1, load=0.1)) == Fraction(8, 17) / 10 * Fraction(19, 20)
    assert score(NodeCapacity("n", vram_gib=8, ram_gib=16, latency_ms=2)) == Fraction(8 * 8 + 2 * 16, 17) - Fraction(2, 1700)
    # Different figures, equal weighted sums: exactly equal scores.
    assert score(NodeCapacity("p", vram_gib=3)) == score(NodeCapacity("q", vram_gib=2, ram_gib=1, npu_tops=1))
    assert float(score(NodeCapacity("n", ram_gib=1))) == pytest.approx(0.5 / 4.25)


@given(integer_clusters(min_nodes=1, max_nodes=1))
def test_score_of_whole_figures_is_the_exact_formula(nodes):
    (node,) = nodes
    raw = Fraction(8 * int(node.vram_gib) + 2 * int(node.ram_gib) + 6 * int(node.npu_tops), 17)
    expected = max(Fraction(1, 1000), raw * (1 - Fraction(str(node.load)) / 2))
    assert score(node) == expected


def test_score_formula_by_hand():
    node = NodeCapacity("gpu", vram_gib=8, ram_gib=16, npu_tops=0, latency_ms=2, load=0.0)
    expected = (2.0 * 8 + 0.5 * 16 + 1.5 * 0 - 0.25 * 2 / 100) / 4.25
    assert score(node) == pytest.approx(expected)


def test_full_load_keeps_half_the_score():
    idle = NodeCapacity("n", vram_gib=4, ram_gib=8, npu_tops=6, latency_ms=10, load=0.0)
    busy = NodeCapacity("n", vram_gib=4, ram_gib=8, npu_tops=6, latency_ms=10, load=1.0)
    assert score(busy) == pytest.approx(score(idle) / 2)


def test_zero_capacity_and_high_latency_hit_the_floor():
    assert score(NodeCapacity("empty")) == SCORE_FLOOR
    assert score(NodeCapacity("far", ram_gib=1, latency_ms=10_000)) == SCORE_FLOOR


@given(capacities)
def test_score_is_finite_and_floored(node):
    value = score(node)
    assert math.isfinite(value) and value >= SCORE_FLOOR


@given(capacities, st.floats(0.01, 50))
def test_more_vram_never_lowers_the_score(node, extra):
    bigger = NodeCapacity(node.node_id, node.vram_gib + extra, node.ram_gib, node.npu_tops, node.latency_ms, node.load)
    assert score(bigger) >= score(node)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"vram_gib": -1}, "vram_gib must be finite and >= 0"),
        ({"load": 1.5}, "load must be in [0, 1]"),
        ({"ram_gib": float("nan")}, "ram_gib must be finite"),
        ({"npu_tops": "6"}, "npu_tops must be a number"),
        ({"latency_ms": True}, "latency_ms must be a number"),
    ],
)
def test_bad_capacity_is_a_typed_error(fields, message):
    with pytest.raises(InvalidNodeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        NodeCapacity("n", **fields)
    assert issubclass(InvalidNodeError, NcmError)


def test_from_dict_names_missing_and_unknown_fields():
    with pytest.raises(InvalidNodeError, match="missing the field\\(s\\) ram_gib"):
        NodeCapacity.from_dict({"id": "a", "vram_gib": 1, "npu_tops": 0, "latency_ms": 0, "load": 0})
    with pytest.raises(InvalidNodeError, match="unknown field\\(s\\) vram"):
        NodeCapacity.from_dict({"id": "a", "vram": 1})
    with pytest.raises(InvalidNodeError, match="missing the field 'id'"):
        NodeCapacity.from_dict({"vram_gib": 1})
    with pytest.raises(InvalidNodeError, match="node id must be a non-empty string"):
        NodeCapacity.from_dict({"id": "", "vram_gib": 1, "ram_gib": 1, "npu_tops": 0, "latency_ms": 0, "load": 0})


def test_round_trip_through_dict():
    node = NodeCapacity("n1", 8.0, 16.0, 6.0, 2.5, 0.25)
    assert NodeCapacity.from_dict(node.to_dict()) == node


# --- what the score may count ------------------------------------------------------------------
from agent.core.capacity import credited_capacity  # noqa: E402
from agent.core.plan import make_plan  # noqa: E402

KINDS = st.sets(st.sampled_from(["gpu", "npu", "cpu"])).map(frozenset)


@given(capacities, KINDS)
def test_a_detected_accelerator_counts_only_with_a_backend_that_passed_its_self_test(detected, kinds):
    credited = credited_capacity(detected, kinds)
    assert credited.npu_tops == (detected.npu_tops if "npu" in kinds else 0.0)
    assert credited.vram_gib == (detected.vram_gib if "gpu" in kinds else 0.0)
    assert (credited.latency_ms, credited.load, credited.node_id) == (detected.latency_ms, detected.load, detected.node_id)
    assert score(credited) <= score(detected) + 1e-12  # crediting never invents capacity


@given(capacities, KINDS, st.floats(0, 500), st.floats(0, 64), st.floats(0, 64))
def test_configured_figures_are_the_operators_word(detected, kinds, tops, vram, ram):
    credited = credited_capacity(detected, kinds, npu_tops=tops, vram_gib=vram, ram_gib=ram)
    assert (credited.npu_tops, credited.vram_gib, credited.ram_gib) == (tops, vram, ram)


def test_unified_memory_without_a_usable_gpu_counts_as_ram():
    jetson = NodeCapacity("jetson", vram_gib=6.0, ram_gib=0.0, npu_tops=40.0)
    assert credited_capacity(jetson, frozenset({"cpu"})) == NodeCapacity("jetson", vram_gib=0.0, ram_gib=6.0)
    assert credited_capacity(jetson, frozenset({"cpu", "gpu"})) == NodeCapacity("jetson", vram_gib=6.0, ram_gib=0.0)


def test_a_board_whose_npu_has_no_backend_no_longer_gets_the_largest_share():
    """An RK3588 (6 TOPS in the table, 4 GiB free) next to a PC (12 GiB free, no accelerator)."""
    rk3588 = NodeCapacity("rk3588", ram_gib=4.0, npu_tops=6.0)
    pc = NodeCapacity("pc", ram_gib=12.0)

    def layers(kinds):
        plan = make_plan({n.node_id: score(credited_capacity(n, kinds)) for n in (rk3588, pc)}, 30)
        return {node: plan.primary_range(node).size for node in ("rk3588", "pc")}

    with_backend, without = layers(frozenset({"cpu", "npu"})), layers(frozenset({"cpu"}))
    assert with_backend["rk3588"] > with_backend["pc"]  # the table's TOPS, credited
    assert without["rk3588"] < without["pc"]  # only what its CPU and RAM earn


@given(capacities, st.floats(0, 100))
def test_a_usable_npu_is_credited_what_it_measured_never_more_than_the_table(detected, measured):
    credited = credited_capacity(detected, frozenset({"cpu", "npu"}), measured_npu_tops=measured)
    assert credited.npu_tops == (min(measured, detected.npu_tops) if detected.npu_tops > 0 else measured)
    assert credited_capacity(detected, frozenset({"cpu"}), measured_npu_tops=measured).npu_tops == 0.0
