"""`ncm plan` through the real console entry point."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.cli.main import main

EXAMPLE = Path(__file__).resolve().parents[3] / "docs" / "examples" / "home-cluster.json"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True, timeout=60)


def test_plan_table_on_the_example_cluster():
    result = run_cli("plan", "--nodes", str(EXAMPLE), "--layers", "30")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["node", "score", "primary", "replicas", "layers", "pipeline"]
    assert "pipeline:" in result.stdout and "(30 layers)" in result.stdout


def test_plan_json_is_the_core_plan(capsys):
    assert main(["plan", "--nodes", str(EXAMPLE), "--layers", "30", "--json", "--replicas", "2", "--head-ratio", "0.5"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["total_layers"] == 30
    assert sum(1 for node in plan["nodes"] if node["replicas"]) == 2
    covered = sorted(layer for node in plan["nodes"] if node["primary"] for layer in range(node["primary"][0], node["primary"][1] + 1))
    assert covered == list(range(30))


def test_plan_of_whole_copies_gives_every_node_every_layer(capsys):
    assert main(["plan", "--nodes", str(EXAMPLE), "--layers", "30", "--placement", "replicas", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    whole = [[0, 29]]
    assert [node["primary"] for node in plan["nodes"] if node["primary"]] == [[0, 29]]
    assert all(node["primary"] == [0, 29] or node["replicas"] == whole for node in plan["nodes"])
    result = run_cli("plan", "--nodes", str(EXAMPLE), "--layers", "30", "--placement", "replicas")
    assert result.returncode == 0, result.stderr
    copies = [node["id"] for node in plan["nodes"] if not node["primary"]]  # by descending score
    assert result.stdout.splitlines()[-1].startswith(f"copies: {', '.join(copies)}   ")


def test_auto_plans_copies_on_the_nodes_whose_memory_holds_one_and_splits_where_none_does(capsys):
    """The example's desktop holds a 9 GiB copy in its 12 GiB of VRAM and the 16 GiB board in
    its RAM; the 8 GiB devices hold none. A 40 GiB model fits nowhere: it is split."""
    assert main(["plan", "--nodes", str(EXAMPLE), "--layers", "30", "--placement", "auto", "--model-gib", "9"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == "copies: rock5b-rk3588   (each holds every layer and serves requests alone)"
    assert lines[-1] == "no room for a whole copy of 9 GiB: jetson-orin-nano (8 GiB), old-laptop (8 GiB)"
    assert lines[-3] == "pipeline: desktop-rtx3060   (30 layers)"
    assert main(["plan", "--nodes", str(EXAMPLE), "--layers", "30", "--placement", "auto", "--model-gib", "40",
                 "--json"]) == 0
    split = json.loads(capsys.readouterr().out)
    assert sum(1 for node in split["nodes"] if node["primary"]) == 4
    for args, message in [(["--placement", "auto"], "needs it"), (["--model-gib", "9"], "goes with --placement auto"),
                          (["--placement", "auto", "--model-gib", "0"], "must be a number > 0")]:
        result = run_cli("plan", "--nodes", str(EXAMPLE), "--layers", "30", *args)
        assert result.returncode == 2 and message in result.stderr and result.stdout == ""


@pytest.mark.parametrize(
    "content, layers, message",
    [
        ('[{"id": "a", "vram_gib": 1, "ram_gib": 1, "npu_tops": 0, "latency_ms": 1}]', "4", "missing the field(s) load"),
        ('[{"id": "a", "vram_gib": -2, "ram_gib": 1, "npu_tops": 0, "latency_ms": 1, "load": 0}]', "4", "vram_gib must be finite and >= 0"),
        ('[{"id": "a", "vram_gib": 1, "ram_gib": 1, "npu_tops": 0, "latency_ms": 1, "load": 0},'
         ' {"id": "b", "vram_gib": 1, "ram_gib": 1, "npu_tops": 0, "latency_ms": 1, "load": 0}]', "1", "need at least 2 layers"),
        ("[{not json", "4", "is not valid JSON"),
        ("[]", "4", "non-empty JSON list"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, content, layers, message):
    nodes = tmp_path / "nodes.json"
    nodes.write_text(content)
    result = run_cli("plan", "--nodes", str(nodes), "--layers", layers)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_file_and_bad_layers(tmp_path):
    result = run_cli("plan", "--nodes", str(tmp_path / "nope.json"), "--layers", "4")
    assert result.returncode == 2 and "does not exist" in result.stderr
    result = run_cli("plan", "--nodes", str(EXAMPLE), "--layers", "0")
    assert result.returncode == 2 and "total_layers must be an integer >= 1" in result.stderr
    result = run_cli("plan", "--nodes", str(EXAMPLE), "--layers", "30", "--head-ratio", "2")
    assert result.returncode == 2 and "replicate_head_ratio" in result.stderr
