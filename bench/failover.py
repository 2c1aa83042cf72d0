"""Failover, freeze, orchestrator loss, failed re-plan and rebalance timings on real 3-agent
clusters on loopback, each from one run (a fresh cluster per scenario).

    python bench/failover.py [--port 18700] [--only kill,freeze,orchestrator,full-disk,join]

kill          the head owner (its layers replicated on the lightest agent) is killed with
              SIGKILL after 8 streamed tokens: time from the kill to the next token the client
              gets (aim <= 1 s with default settings), next to the usual time between tokens.
freeze        the middle agent (its layers replicated) is frozen with SIGSTOP after 8 tokens:
              time to the next token (aim <= 2 s): the stage before it notices the silence.
orchestrator  the orchestrator is killed during a stream that a client reads through another
              agent: time to the next token on the same stream (aim <= 5 s), and whether the
              text equals an undisturbed run.
full-disk     a 4th agent whose model store is a 16 MiB disk joins while a client sends one
              request after another: requests lost (aim: none) and how the cluster marks it.
join          a 4th agent starts: time from its start to a plan that includes it
              (replan_min_interval_s = 0, so this is the work itself).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.cli.demo import _ensure_model, start_local_cluster, stop_processes, wait_ready  # noqa: E402
from agent.cli.http_client import http_json  # noqa: E402
from agent.core.errors import NcmError  # noqa: E402

MODEL = "smollm2-135m"
PROMPT = "Tell me about the history of Paris, the capital of France, in detail."
ENV = {"NCM_DEFAULT_PLACEMENT": "split",  # the seed's pipeline, whose stages the scenarios fail
       "NCM_REPLICATE_HEAD_RATIO": "0.8", "NCM_REPLICA_COUNT": "1", "NCM_REPLAN_MIN_INTERVAL_S": "0",
       "NCM_RAM_GIB": "4", "NCM_THREADS": "1", "NCM_CLUSTER_KEY": "bench-cluster-key-0123456789"}
# agent 0 the head owner, agent 1 the middle, agent 2 the lightest (the tail, with the replica)
NODES = [{"NCM_VRAM_GIB": "24"}, {"NCM_VRAM_GIB": "8"}, {"NCM_VRAM_GIB": "0"}]
SCENARIOS = ("kill", "freeze", "orchestrator", "full-disk", "join")


@contextlib.contextmanager
def cluster(base: Path, port: int, env: dict[str, str], nodes: list[dict[str, str]]) -> Iterator[list[subprocess.Popen]]:
    processes = start_local_cluster(3, port, base, MODEL, env=env, node_env=nodes, log_dir=base / "logs")
    try:
        wait_ready(f"http://127.0.0.1:{port}", processes, 600)
        yield processes
    finally:
        for process in processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGCONT)
        stop_processes([p for p in processes if p.poll() is None])
        shutil.rmtree(base, ignore_errors=True)


def stream(url: str, at_token: int, disrupt: Callable[[], None]) -> tuple[list[float], float, str, list[str]]:
    """Stream a greedy answer from ``url``; call ``disrupt`` after ``at_token`` pieces. Returns the
    piece times, the disruption time, the text and the error events."""
    body = json.dumps({"messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
                       "max_tokens": 48, "stream": True}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    stamps: list[float] = []
    pieces: list[str] = []
    errors: list[str] = []
    at = float("nan")
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[len(b"data: "):])
            if "error" in event:
                errors.append(event["error"]["code"])
                continue
            content = event["choices"][0]["delta"].get("content") if event["choices"] else None
            if content:
                stamps.append(time.monotonic())
                pieces.append(content)
                if len(stamps) == at_token:
                    disrupt()
                    at = time.monotonic()
    return stamps, at, "".join(pieces), errors


def ask(url: str) -> str:
    answer = http_json("POST", url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 48})
    return answer["choices"][0]["message"]["content"]


def report_gap(what: str, stamps: list[float], at: float, aim_ms: float) -> None:
    after = [t for t in stamps if t > at]
    gaps = sorted(b - a for a, b in zip(stamps[:8], stamps[1:8]))
    usual = f"usual time between tokens {1000 * gaps[len(gaps) // 2]:.1f} ms" if gaps else ""
    if not after:
        print(f"{what}: no token came after it ({usual})")
        return
    print(f"{what} -> next token: {1000 * (after[0] - at):.1f} ms (aim <= {aim_ms:g} ms); {usual}")


def route_of(url: str) -> str:
    status = http_json("GET", url + "/cluster/status")
    return f"state {status['state']}, route " + " -> ".join(
        f"{h['node'][:8]}[{h['layers'][0]}-{h['layers'][1]}]" for h in status["route"] or [])


def kill(base: Path, port: int) -> None:
    nodes = [dict(n) for n in NODES]
    nodes[2]["NCM_ORCHESTRATOR"] = "true"
    with cluster(base, port, ENV, nodes) as processes:
        stamps, at, _, errors = stream(f"http://127.0.0.1:{port + 1}", 8, lambda: processes[0].send_signal(signal.SIGKILL))
        report_gap("kill of the head owner", stamps, at, 1000)
        print(f"  error events: {errors or 'none'}; after: {route_of(f'http://127.0.0.1:{port + 2}')}")


def freeze(base: Path, port: int) -> None:
    # Head ratio 1: the lightest agent replicates every layer but the last, so the middle's too.
    nodes = [dict(n) for n in NODES]
    nodes[2]["NCM_ORCHESTRATOR"] = "true"
    with cluster(base, port, {**ENV, "NCM_REPLICATE_HEAD_RATIO": "1.0"}, nodes) as processes:
        stamps, at, _, errors = stream(f"http://127.0.0.1:{port + 2}", 8, lambda: processes[1].send_signal(signal.SIGSTOP))
        report_gap("SIGSTOP of the middle agent", stamps, at, 2000)
        print(f"  error events: {errors or 'none'}; after: {route_of(f'http://127.0.0.1:{port + 2}')}")


def orchestrator(base: Path, port: int) -> None:
    nodes = [dict(n) for n in NODES]
    nodes[0]["NCM_ORCHESTRATOR"] = "true"  # the head owner is the orchestrator
    with cluster(base, port, ENV, nodes) as processes:
        undisturbed = ask(f"http://127.0.0.1:{port + 1}")
        stamps, at, text, errors = stream(f"http://127.0.0.1:{port + 1}", 8,
                                          lambda: processes[0].send_signal(signal.SIGKILL))
        report_gap("kill of the orchestrator", stamps, at, 5000)
        print(f"  error events: {errors or 'none'}; text equals an undisturbed run: {text == undisturbed}")


def full_disk(base: Path, port: int) -> None:
    with cluster(base, port, ENV, NODES):
        url = f"http://127.0.0.1:{port}"
        served, lost, stop = [0], [], threading.Event()

        def client() -> None:
            while not stop.is_set():
                try:
                    ask(url)
                    served[0] += 1
                except NcmError as error:
                    lost.append(str(error))

        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        home = base / "small-disk"
        home.mkdir()
        env = {**os.environ, **ENV, "NCM_VRAM_GIB": "8", "NCM_CLUSTER_NAME": "demo", "NCM_MDNS": "false",
               "NCM_HOST": "127.0.0.1", "NCM_ADVERTISE_HOST": "127.0.0.1", "NCM_MODEL": MODEL,
               "NCM_STATE_DIR": str(base / "node-3"), "NCM_HOME": str(home)}
        command = [sys.executable, "-m", "agent.cli", "serve", "--port", str(port + 3), f"--peer={url}"]
        if os.geteuid() == 0 and shutil.which("unshare"):
            command = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=16m tmpfs "$0" && exec "$@"', str(home),
                       *command]
        else:
            (home / "models").mkdir()
            (home / "models").chmod(0o555)
        log = (base / "logs" / "node-3.log").open("ab")
        newcomer = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            faults: dict = {}
            while time.monotonic() < deadline and not faults:
                with contextlib.suppress(NcmError):
                    faults = http_json("GET", url + "/cluster/status").get("faults") or {}
                time.sleep(0.2)
            time.sleep(5)  # keep asking a little after the failed re-plan
            stop.set()
            thread.join(timeout=120)
            print(f"failed re-plan (a joining agent with a 16 MiB disk): {served[0]} requests served, "
                  f"{len(lost)} lost (aim: 0); marked: {[f['cause'] for f in faults.values()] or 'nothing'}")
            for reason in lost[:3]:
                print(f"  lost: {reason}")
        finally:
            newcomer.terminate()
            newcomer.wait(timeout=40)


def join(base: Path, port: int) -> None:
    nodes = [dict(n) for n in NODES]
    nodes[2]["NCM_ORCHESTRATOR"] = "true"
    with cluster(base, port, ENV, nodes) as processes:
        orchestrator_url = f"http://127.0.0.1:{port + 2}"
        started = time.monotonic()
        processes += start_local_cluster(1, port + 3, base, MODEL, env=ENV, log_dir=base / "logs",
                                         first_index=3, extra_peers=(orchestrator_url,))
        deadline = started + 600
        newcomer = None
        status: dict = {}
        while time.monotonic() < deadline:
            try:
                newcomer = newcomer or http_json("GET", f"http://127.0.0.1:{port + 3}/health")["node_id"]
                status = http_json("GET", orchestrator_url + "/cluster/status")
            except NcmError:
                status = {"state": "starting", "route": None}
            if newcomer and status["state"] == "ok" and newcomer in [h["node"] for h in status["route"] or []]:
                break
            time.sleep(0.05)
        print(f"rebalance on join: {time.monotonic() - started:.2f} s from the new agent's start to a plan "
              f"over {len(status.get('nodes_alive', []))} nodes ({len(status.get('route') or [])} stages)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=18700)
    parser.add_argument("--only", default=",".join(SCENARIOS), help="scenarios to run, comma-separated")
    args = parser.parse_args()
    _ensure_model(MODEL)
    runs = {"kill": kill, "freeze": freeze, "orchestrator": orchestrator, "full-disk": full_disk, "join": join}
    for index, name in enumerate(n.strip() for n in args.only.split(",")):
        if name not in runs:
            raise SystemExit(f"unknown scenario {name!r} (known: {', '.join(SCENARIOS)})")
        with tempfile.TemporaryDirectory(prefix="ncm-bench-") as tmp:
            runs[name](Path(tmp) / "cluster", args.port + 10 * index)


if __name__ == "__main__":
    main()
