"""Time the planning core on a large cluster: 1,000 nodes x 10,000 layers by default.

    python bench/plan.py [--nodes 1000] [--layers 10000] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.core.capacity import NodeCapacity, score  # noqa: E402
from agent.core.plan import make_plan  # noqa: E402
from agent.core.routing import Telemetry, choose_route, failover  # noqa: E402


def random_cluster(count: int, rng: random.Random) -> dict[str, float]:
    nodes = [
        NodeCapacity(
            f"node-{index:04d}",
            vram_gib=rng.choice([0, 0, 4, 8, 12, 24]),
            ram_gib=rng.choice([4, 8, 16, 32, 64]),
            npu_tops=rng.choice([0, 0, 6, 13, 40]),
            latency_ms=rng.uniform(0.2, 20),
            load=rng.random(),
        )
        for index in range(count)
    ]
    return {node.node_id: score(node) for node in nodes}


def timed(label: str, func):
    start = time.perf_counter()
    result = func()
    print(f"{label:<28} {1000 * (time.perf_counter() - start):9.1f} ms")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    scores = random_cluster(args.nodes, random.Random(args.seed))
    print(f"planning {args.layers} layers over {args.nodes} nodes")
    plan = timed("make_plan", lambda: make_plan(scores, args.layers))
    timed("redundancy_map", lambda: plan.redundancy_map)
    telemetry = {node_id: Telemetry(latency_ms=2.0, capacity_score=value) for node_id, value in scores.items()}
    route = timed("choose_route", lambda: choose_route(plan, scores, telemetry))
    head = route.hops[0].node_id
    decision = timed("failover (head dies)", lambda: failover(route, [head], plan, set(scores) - {head}, telemetry))
    print(f"route: {len(route.hops)} hops; after failover: {len(decision.route.hops)} hops, degraded={decision.degraded}")
    print(f"replicas: {len(plan.replicas)} nodes hold layers 0-{plan.replicas[0][1].last}" if plan.replicas else "replicas: none")


if __name__ == "__main__":
    main()
