"""`ncm status`'s layer map: the text rendered from /cluster/status's "models" entries."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from agent.cli.status_map import NOT_HELD, ON_ROUTE, STANDBY, format_route, render_layer_map

REPO_ROOT = Path(__file__).resolve().parents[3]

ENTRY: dict[str, Any] = {
    "serving": "tiny", "degraded": False, "plan_version": 1,
    "route": [{"node": "node-0", "layers": [0, 1]}, {"node": "node-1", "layers": [2, 2]},
              {"node": "node-2", "layers": [3, 3]}],
    "total_layers": 4,
    "layers": [{"layer": 0, "holders": ["node-0", "node-1"]}, {"layer": 1, "holders": ["node-0"]},
               {"layer": 2, "holders": ["node-1"]}, {"layer": 3, "holders": ["node-2", "node-3"]}],
    "replicas": [["node-1", [0, 0]]],
}
ALIVE = {"node-0", "node-1", "node-2", "node-3"}


def rows(lines: list[str]) -> dict[str, str]:
    """Node id -> its cells (and any mark after them), from the map's node rows."""
    found = {}
    for line in lines:
        head, _, rest = line.partition("  ")
        if head.startswith("node-"):
            found[head.strip()] = rest.strip()
    return found


def test_route_holders_and_replicas() -> None:
    lines = render_layer_map("tiny", ENTRY, ALIVE)
    assert lines[0] == "model tiny (plan 1): node-0 [0-1] → node-1 [2] → node-2 [3]"
    assert not any("degraded" in line for line in lines)
    assert rows(lines) == {
        "node-0": ON_ROUTE * 2 + NOT_HELD * 2,
        "node-1": STANDBY + NOT_HELD + ON_ROUTE + NOT_HELD,  # layer 0 as a replica
        "node-2": NOT_HELD * 3 + ON_ROUTE,
        "node-3": NOT_HELD * 3 + STANDBY,  # a holder off the route
    }
    header = lines[1]
    assert header.strip() == "0" and header.index("0") == len("node-0  ")  # above the first column
    assert ON_ROUTE in lines[-1] and STANDBY in lines[-1] and NOT_HELD in lines[-1]  # the legend


def test_dead_nodes_and_degraded_models_are_marked() -> None:
    entry = {**ENTRY, "degraded": True, "serving": "small"}
    lines = render_layer_map("big", entry, ALIVE - {"node-3"})
    assert "degraded: serving small" in lines
    found = rows(lines)
    assert found["node-3"] == NOT_HELD * 3 + STANDBY + " (dead)"
    assert not found["node-0"].endswith("(dead)")


def test_older_agents_get_only_the_route() -> None:
    entry = {key: value for key, value in ENTRY.items() if key not in ("total_layers", "layers", "replicas")}
    assert render_layer_map("tiny", entry, ALIVE) == ["model tiny (plan 1): node-0 [0-1] → node-1 [2] → node-2 [3]"]
    assert format_route([]) == "-"


def test_header_labels_every_four_columns() -> None:
    entry = {"route": [{"node": "a", "layers": [0, 11]}], "total_layers": 12,
             "layers": [{"layer": i, "holders": ["a"]} for i in range(12)]}
    lines = render_layer_map("m", entry, {"a"})
    assert lines[1] == "   0   4   8"
    assert lines[2] == "a  " + ON_ROUTE * 12


def test_wide_models_share_columns_evenly() -> None:
    total = 200
    entry = {"route": [{"node": "node-a", "layers": [0, 99]}, {"node": "node-b", "layers": [100, 199]}],
             "total_layers": total,
             "layers": [{"layer": i, "holders": ["node-a" if i < 100 else "node-b"] + (["node-c"] if i >= 190 else [])}
                        for i in range(total)]}
    lines = render_layer_map("wide", entry, {"node-a", "node-b", "node-c"})
    found = rows(lines)
    assert all(len(cells) <= 64 for cells in found.values())
    columns = len(found["node-a"])
    assert columns == 50  # 4 layers a column
    assert found["node-a"] == ON_ROUTE * 25 + NOT_HELD * 25
    assert found["node-b"] == NOT_HELD * 25 + ON_ROUTE * 25
    assert found["node-c"] == NOT_HELD * 47 + STANDBY * 3  # layers 188-199: 190 is in the column 188-191
    assert lines[1].split() == [str(4 * c) for c in range(0, columns, 8)]  # labels every 8 columns
    assert "4 layers" in lines[-1]


def test_ncm_status_prints_the_map_of_a_real_cluster(tmp_path: Path) -> None:
    from tests.agent.tiny import TINY, tiny_cluster

    async def scenario() -> str:
        async with tiny_cluster(tmp_path, 2) as (orchestrator, _):
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "agent.cli", "status", "--remote", orchestrator.url,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO_ROOT,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
            out, err = await asyncio.wait_for(process.communicate(), 60)
            assert process.returncode == 0, err.decode()
            return out.decode()

    out = asyncio.run(scenario())
    title = next(line for line in out.splitlines() if line.startswith(f"model {TINY} "))
    assert title.split(": ", 1)[1].startswith("node-"), out  # the route
    cells = [line.split()[1] for line in out.splitlines() if line.startswith("node-") and "http" not in line]
    assert cells and all(len(row) == 2 for row in cells), out  # one cell per layer of the tiny model
    assert all(any(row[layer] == ON_ROUTE for row in cells) for layer in range(2)), out  # the route covers both
