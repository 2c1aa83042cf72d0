"""What a node reports of itself (agent/core/node_report.py): a report read back is the report
written, and a field a peer sends malformed reads as absent, never as something else."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from agent.core.node_report import NodeReport, OpenEmbeddingModel, StageFault, WorkerReport
from agent.core.orders import RoutingOrder
from agent.core.plan import LayerRange
from agent.core.routing import Hop, Route


def order(name: str, version: int) -> RoutingOrder:
    return RoutingOrder(epoch=1, orchestrator="n0", plan_version=version, model=name, total_layers=4,
                        route=Route((Hop("n0", LayerRange(0, 3)),)), addresses={"n0": "https://127.0.0.1:1"})


def worker_status(fault: StageFault | None = None) -> dict:
    """A worker's status as Worker.status() writes it (the fields the report reads)."""
    return {"state": "ready", "plan_version": 7, "fault": fault.to_json() if fault else None,
            "models": {"main": {"plan_version": 7}}, "staged": {"next": {"plan_version": 8, "memory_bytes": 1234}},
            "orders": [order("main", 7).to_json()], "sessions": 2}


def test_a_worker_status_reads_as_its_orders_models_memory_and_fault():
    fault = StageFault("disk_full", "OSError: no space", "main", 8)
    report = WorkerReport.from_json(json.loads(json.dumps(worker_status(fault))))
    assert report.orders == (order("main", 7),) and report.plan_version == 7
    assert report.served == {"main"} and report.held == {"main", "next"} and report.staged_bytes == {"next": 1234}
    assert report.fault == fault and report.raw["sessions"] == 2


@given(st.builds(StageFault, st.text(min_size=1), st.text(), st.none() | st.text(), st.none() | st.integers(0, 10**6)))
def test_a_stage_fault_reads_back_as_it_was_written(fault):
    assert StageFault.from_json(json.loads(json.dumps(fault.to_json()))) == fault


def test_a_refused_stage_from_an_older_agent_still_reads_as_its_fault():
    assert StageFault.from_json({"error": "MemoryError: ", "cause": "out_of_memory"}) == \
        StageFault("out_of_memory", "MemoryError: ")
    assert StageFault.from_json({"error": "stale plan"}) is None and StageFault.from_json("x") is None


def test_a_node_report_reads_back_as_it_was_written():
    report = NodeReport({"main": 10**9}, WorkerReport.from_json(worker_status()),
                        {"total_bytes": 8 << 30, "external_bytes": 1 << 30}, {"minilm": OpenEmbeddingModel(90, 250.0)})
    again = NodeReport.from_json(json.loads(json.dumps(report.to_json())))
    assert again == report and again.worker.orders == (order("main", 7),)


MALFORMED = st.one_of(st.none(), st.booleans(), st.integers(), st.text(), st.lists(st.integers(), max_size=3),
                      st.dictionaries(st.text(max_size=3), st.none() | st.integers() | st.text(max_size=3), max_size=3))


@given(st.fixed_dictionaries({}, optional={"models": MALFORMED, "worker": MALFORMED, "device_memory": MALFORMED,
                                           "embedding_models": MALFORMED}))
def test_malformed_fields_read_as_absent(body):
    report = NodeReport.from_json(body)
    assert all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
               for k, v in report.models.items())
    assert report.device_memory is None or all(isinstance(v, int) for v in report.device_memory.values())
    assert all(isinstance(m.bytes, int) for m in report.embedding_models.values())
    assert report.worker.orders == () and report.worker.fault is None
