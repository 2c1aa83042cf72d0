"""`ncm plan`: show how a model's layers would be split over a described cluster."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, TextIO

from agent.core.capacity import NodeCapacity, score
from agent.core.copies import copy_holders
from agent.core.errors import InvalidNodeError, ShardingError
from agent.core.plan import (
    DEFAULT_MIN_LAYERS_PER_NODE,
    DEFAULT_REPLICATE_HEAD_RATIO,
    ShardingPlan,
    make_copies_plan,
    make_plan,
)


def load_nodes(path: Path) -> list[NodeCapacity]:
    """Read a JSON list of node objects (id, vram_gib, ram_gib, npu_tops, latency_ms, load)."""
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidNodeError(f"nodes file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidNodeError(f"cannot read nodes file {str(path)!r}: {error}") from None
    except json.JSONDecodeError as error:
        raise InvalidNodeError(f"nodes file {str(path)!r} is not valid JSON: {error}") from None
    if isinstance(data, dict) and "nodes" in data:
        data = data["nodes"]
    if not isinstance(data, list) or not data:
        raise InvalidNodeError(f"nodes file {str(path)!r} must hold a non-empty JSON list of nodes")
    nodes = [NodeCapacity.from_dict(item) for item in data]
    seen: set[str] = set()
    for node in nodes:
        if node.node_id in seen:
            raise InvalidNodeError(f"node id {node.node_id!r} appears twice in {str(path)!r}")
        seen.add(node.node_id)
    return nodes


def format_plan(plan: ShardingPlan) -> str:
    """A readable table: node, score, primary range, replicas, layer count, pipeline position."""
    order = plan.nodes()
    rows = [("node", "score", "primary", "replicas", "layers", "pipeline")]
    for entry in plan.to_dict()["nodes"]:
        primary = entry["primary"]
        rows.append(
            (
                entry["id"],
                f"{entry['score']:.3f}",
                f"{primary[0]}-{primary[1]}" if primary else "-",
                ", ".join(f"{a}-{b}" for a, b in entry["replicas"]) or "-",
                str(entry["layer_count"]),
                str(order.index(entry["id"]) + 1) if entry["id"] in order else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    lines.append("")
    lines.append(f"pipeline: {' -> '.join(order)}   ({plan.total_layers} layers)")
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="show how a model's layers would be split over a cluster",
        description="Plan a model's layers over the nodes described in a JSON file.",
    )
    parser.add_argument("--nodes", type=Path, required=True, help="JSON list of nodes: id, vram_gib, ram_gib, npu_tops, latency_ms, load")
    parser.add_argument("--layers", type=int, required=True, help="number of transformer layers of the model")
    parser.add_argument("--head-ratio", type=float, default=DEFAULT_REPLICATE_HEAD_RATIO, help="share of layers replicated at the head (default %(default)s)")
    parser.add_argument("--min-layers", type=int, default=DEFAULT_MIN_LAYERS_PER_NODE, help="minimum layers per node (default %(default)s)")
    parser.add_argument("--replicas", type=int, default=None, help="nodes holding a head replica (default: max(1, nodes // 3))")
    parser.add_argument("--placement", choices=("split", "replicas", "auto"), default="split",
                        help="split: the layers over the nodes (default); replicas: a whole copy on every node, "
                             "each serving requests alone; auto (an agent's default): a whole copy on every node "
                             "whose memory holds --model-gib, the split where none does (design §11)")
    parser.add_argument("--model-gib", type=float, metavar="GIB",
                        help="with --placement auto: the memory one whole copy takes (its weights and a KV cache "
                             "at full context); a node's memory is its vram_gib where it has one, else its ram_gib "
                             "(a running cluster also counts what other models hold and a margin)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    nodes = load_nodes(args.nodes)
    scores = {node.node_id: score(node) for node in nodes}
    placement, without_copy = args.placement, {}
    if (args.model_gib is None) != (placement != "auto"):
        raise ShardingError("--model-gib goes with --placement auto, and --placement auto needs it: "
                            "the memory one whole copy takes")
    if placement == "auto":
        if not (math.isfinite(args.model_gib) and args.model_gib > 0):
            raise ShardingError(f"--model-gib must be a number > 0, got {args.model_gib}")
        memory_gib = {n.node_id: n.vram_gib or n.ram_gib for n in nodes}  # where its fragments would live
        without_copy = {node_id: gib for node_id, gib in memory_gib.items() if gib < args.model_gib}
        holders = copy_holders(scores, without_copy)
        placement = "replicas" if holders else "split"
        if holders:
            scores = {node_id: value for node_id, value in scores.items() if node_id in holders}
    if placement == "replicas":
        plan = make_copies_plan(scores, args.layers)
    else:
        plan = make_plan(scores, args.layers, replicate_head_ratio=args.head_ratio, replica_count=args.replicas,
                         min_layers_per_node=args.min_layers)
    if args.json:
        json.dump(plan.to_dict(), out, indent=2)
        out.write("\n")
    else:
        out.write(format_plan(plan) + "\n")
        if placement == "replicas":
            copies = [node_id for node_id, _ in reversed(plan.replicas)]
            out.write(f"copies: {', '.join(copies) or 'none'}   (each holds every layer and serves requests alone)\n")
        if without_copy:
            room = ", ".join(f"{node_id} ({gib:g} GiB)" for node_id, gib in without_copy.items())
            out.write(f"no room for a whole copy of {args.model_gib:g} GiB: {room}"
                      + ("; the layers are split instead\n" if placement == "split" else "\n"))
    return 0
