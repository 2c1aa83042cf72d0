"""Failover and rebalance timings on a real 3-agent cluster on loopback, from one run.

    python bench/failover.py [--port 18700]

1. Gap: a greedy request streams from agent 1; the head owner (agent 0, whose layers the
   lightest agent replicates) is killed with SIGKILL after 8 tokens. Prints the time from the
   kill to the next token the client receives (aim <= 1 s with default settings), next to
   the usual time between tokens.
2. Rebalance on join: a 4th agent starts; prints the time from its start to the cluster
   serving a plan that includes it (replan_min_interval_s = 0, so this is the work itself).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.commands import http_json  # noqa: E402
from agent.core.errors import NcmError  # noqa: E402
from agent.demo import _ensure_model, start_local_cluster, stop_processes, wait_ready  # noqa: E402

PROMPT = "Tell me about the history of Paris, the capital of France, in detail."
ENV = {"NCM_REPLICATE_HEAD_RATIO": "0.8", "NCM_REPLICA_COUNT": "1", "NCM_REPLAN_MIN_INTERVAL_S": "0",
       "NCM_RAM_GIB": "4", "NCM_THREADS": "1", "NCM_CLUSTER_KEY": "bench-cluster-key-0123456789"}
NODES = [{"NCM_VRAM_GIB": "24"}, {"NCM_VRAM_GIB": "8"}, {"NCM_VRAM_GIB": "0", "NCM_ORCHESTRATOR": "true"}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=18700)
    args = parser.parse_args()
    _ensure_model("smollm2-135m")
    with tempfile.TemporaryDirectory(prefix="ncm-bench-") as tmp:
        base = Path(tmp)
        processes = start_local_cluster(3, args.port, base, "smollm2-135m", env=ENV, node_env=NODES, log_dir=base / "logs")
        try:
            orchestrator = f"http://127.0.0.1:{args.port + 2}"
            wait_ready(orchestrator, processes, 600)
            body = json.dumps({"messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
                               "max_tokens": 48, "stream": True}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{args.port + 1}/v1/chat/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            stamps: list[float] = []
            killed_at = None
            with urllib.request.urlopen(request, timeout=300) as response:
                for line in response:
                    if line.startswith(b"data: {") and b'"content"' in line and b'"content": ""' not in line:
                        stamps.append(time.monotonic())
                        if len(stamps) == 8:
                            processes[0].send_signal(signal.SIGKILL)
                            killed_at = time.monotonic()
            assert killed_at is not None, "the answer ended before the kill"
            after = [t for t in stamps if t > killed_at]
            gaps = sorted(b - a for a, b in zip(stamps[:8], stamps[1:8]))
            print(f"usual time between tokens: {1000 * gaps[len(gaps) // 2]:.1f} ms")
            print(f"kill -> next token: {1000 * (after[0] - killed_at):.1f} ms  (aim <= 1000 ms)")
            status = http_json("GET", orchestrator + "/cluster/status")
            print(f"after the kill: state {status['state']}, route "
                  + " -> ".join(f"{h['node'][:8]}[{h['layers'][0]}-{h['layers'][1]}]" for h in status["route"]))

            started = time.monotonic()
            processes += start_local_cluster(1, args.port + 3, base, "smollm2-135m", env=ENV, log_dir=base / "logs",
                                             first_index=3, extra_peers=(orchestrator,))
            deadline = started + 600
            newcomer = None
            while time.monotonic() < deadline:
                try:
                    newcomer = newcomer or http_json("GET", f"http://127.0.0.1:{args.port + 3}/health")["node_id"]
                    status = http_json("GET", orchestrator + "/cluster/status")
                except NcmError:
                    status = {"state": "starting", "route": None}
                if newcomer and status["state"] == "ok" and newcomer in [h["node"] for h in status["route"] or []]:
                    break
                time.sleep(0.05)
            print(f"rebalance on join: {time.monotonic() - started:.2f} s from the new agent's start to a plan "
                  f"over {len(status['nodes_alive'])} nodes ({len(status['route'])} stages)")
        finally:
            stop_processes([p for p in processes if p.poll() is None])


if __name__ == "__main__":
    main()
