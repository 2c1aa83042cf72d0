"""`ncm status` and `ncm models --remote`: the cluster's devices, models and each model's layer
map drawn in the terminal."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from agent.cli.http_client import http_json, local_admin_token
from agent.core.errors import NcmError

MAP_MAX_COLUMNS = 64  # wider models share columns in the status layer map
ON_ROUTE, STANDBY, NOT_HELD = "█", "░", "·"


def run_status(args: argparse.Namespace) -> int:
    base = args.remote.rstrip("/")
    nodes = http_json("GET", base + "/cluster/nodes", token=args.token)
    try:
        status = http_json("GET", base + "/cluster/status", token=args.token)
    except NcmError as error:
        status = {"state": "unknown", "message": str(error)}
    if args.json:
        json.dump({"status": status, "nodes": nodes}, sys.stdout, indent=2)
        print()
        return 0
    print(f"cluster {nodes['cluster']!r}: {status.get('state')} — {status.get('message', '')}")
    print(f"orchestrator: {nodes['orchestrator']} (epoch {nodes['epoch']})  model: {status.get('model')}")
    print(f"{'node':<34} {'url':<26} {'alive':<6} {'role':<13} {'score':>8}  layers")
    for node in nodes["nodes"]:
        worker = node.get("worker") or {}
        layers = ", ".join(f"{a}-{b}" for a, b in (f["layers"] for f in worker.get("fragments", []))) or "-"
        score = f"{node['score']:.2f}" if node.get("score") is not None else "-"
        print(f"{(node['id'] or '?') + (' *' if node.get('self') else ''):<34} {node['url']:<26} "
              f"{'yes' if node['alive'] else 'no':<6} {node.get('role') or '-':<13} {score:>8}  {layers}")
    for node_id, fault in sorted((status.get("faults") or {}).items()):
        print(f"left out of plans: {node_id}: {fault.get('cause')} ({fault.get('message')})")
    alive = set(status.get("nodes_alive") or ())
    for model_name, entry in sorted((status.get("models") or {}).items()):
        print()
        for line in render_layer_map(model_name, entry, alive):
            print(line)
    return 0


def format_route(route: list[dict[str, Any]]) -> str:
    """'node-0 [0-1] → node-1 [2]': a route of /cluster/status, layer ranges inclusive."""
    hops = []
    for hop in route:
        first, last = hop["layers"]
        hops.append(f"{hop['node']} [{first}]" if first == last else f"{hop['node']} [{first}-{last}]")
    return " → ".join(hops) or "-"


def render_layer_map(model_name: str, entry: dict[str, Any], alive: set[str] | frozenset[str]) -> list[str]:
    """The text lines `ncm status` prints for one loaded model of /cluster/status's "models".

    A title with the route (and what a degraded model serves instead); then, when the agent
    reports "total_layers" and "layers" (older ones do not), a header of layer numbers, one
    row per node and a legend. A row has one character per layer: ON_ROUTE where the node
    runs the layer on the route in use, STANDBY where it holds it without running it (replica
    or standby range), NOT_HELD elsewhere; nodes not in ``alive`` are marked " (dead)".
    Models of more than MAP_MAX_COLUMNS layers share columns evenly; a column shows the
    strongest mark of its layers.
    """
    route = entry.get("route") or []
    title = f"model {model_name}"
    if entry.get("plan_version") is not None:
        title += f" (plan {entry['plan_version']})"
    lines = [f"{title}: {format_route(route)}"]
    if entry.get("degraded"):
        lines.append(f"degraded: serving {entry.get('serving')}")
    total = entry.get("total_layers")
    if not isinstance(total, int) or total < 1 or "layers" not in entry:
        return lines

    running: dict[str, set[int]] = {}
    for hop in route:
        first, last = hop["layers"]
        running.setdefault(hop["node"], set()).update(range(first, last + 1))
    held: dict[str, set[int]] = {}
    for layer in entry.get("layers") or []:
        for node in layer.get("holders") or []:
            held.setdefault(node, set()).add(layer["layer"])
    for node, (first, last) in entry.get("replicas") or []:
        held.setdefault(node, set()).update(range(first, last + 1))
    nodes = list(dict.fromkeys([hop["node"] for hop in route] + sorted(held)))

    per_column = -(-total // MAP_MAX_COLUMNS)  # layers per column, ceiling
    columns = [range(start, min(start + per_column, total)) for start in range(0, total, per_column)]
    width = max(len(node) for node in nodes) if nodes else 0
    step = 4 if len(columns) <= 32 else 8
    header = ""
    for index in range(0, len(columns), step):
        header = header.ljust(index) + str(columns[index].start)
    lines.append(" " * (width + 2) + header)
    for node in nodes:
        on_route, holds = running.get(node, set()), held.get(node, set())
        cells = []
        for column in columns:
            if any(layer in on_route for layer in column):
                cells.append(ON_ROUTE)
            elif any(layer in holds for layer in column):
                cells.append(STANDBY)
            else:
                cells.append(NOT_HELD)
        lines.append(f"{node:<{width}}  {''.join(cells)}{'' if node in alive else ' (dead)'}")
    note = f"{ON_ROUTE} on the route  {STANDBY} replica/standby  {NOT_HELD} not held"
    if per_column > 1:
        note += f"  (one column: {per_column} layers)"
    lines.append(" " * (width + 2) + note)
    return lines


def run_models_remote(args: argparse.Namespace) -> int:
    """`ncm models --remote URL`: the cluster's models as its router sees them."""
    token = args.token or (local_admin_token() if args.reload else None)
    answer = http_json("GET", args.remote.rstrip("/") + "/models" + ("?reload=1" if args.reload else ""), token=token)
    if args.json:
        json.dump(answer, sys.stdout, indent=2)
        print()
        return 0
    print(f"{'model':<28} {'state':<10} {'busy':>4} {'waiting':>7}  {'memory':>10}  aliases / reason")
    for model in answer["data"]:
        memory = model.get("memory") or {}
        held = sum((memory.get("effective_bytes") or memory.get("min_bytes") or {}).values())
        note = model.get("reason") or ", ".join(model.get("aliases") or []) or ""
        if model.get("degraded"):
            note = f"degraded: serving {model.get('serving')}"
        print(f"{model['id']:<28} {model['state']:<10} {model['active_requests']:>4} {model['waiters']:>7}  "
              f"{held / 2**20:>7.0f} MiB  {note}")
    return 0


def extend_models_parser(parser: argparse.ArgumentParser) -> None:
    """`ncm models` lists the local store; with --remote it asks a running cluster."""
    local = parser.get_default("func")
    parser.add_argument("--remote", metavar="URL", help="show the models of the cluster at URL (any agent)")
    parser.add_argument("--reload", action="store_true", help="with --remote: re-read the cluster's model sources")
    parser.add_argument("--token", help="API key of the cluster, or its admin token for --reload (with --remote)")
    parser.add_argument("--json", action="store_true", help="with --remote: print the JSON answer")
    parser.set_defaults(func=lambda args: run_models_remote(args) if args.remote else local(args))
