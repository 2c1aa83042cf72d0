"""Memory of agents under a steady load: does an agent's RSS stay flat, or does it leak?

    python bench/soak.py [--minutes 30] [--nodes 3] [--warmup-minutes 5] [--clients 3]

Starts the demo's cluster of the default model and keeps ``--clients`` clients asking it for
short streamed and plain answers, one after the other each, through every agent in turn, for
``--minutes``. Every 30 s it samples each agent's RSS (psutil) and prints it; at the end it
prints, per agent, the RSS after the warm-up, the last, their ratio (aim <= 1.10: flat within
10 %), and the slope of a least-squares line over the samples after the warm-up (MiB/min).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.cli.demo import _ensure_model, start_local_cluster, stop_processes, wait_ready  # noqa: E402

MODEL = "smollm2-135m"
SAMPLE_S = 30.0
MIB = 1024 * 1024


def ask(url: str, index: int) -> None:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": f"Say something about the number {index}."}],
                       "max_tokens": 24, "temperature": 0.7, "stream": index % 2 == 0}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        response.read()


def client(urls: list[str], stop: threading.Event, counts: list[int], errors: list[str], offset: int) -> None:
    index = offset
    while not stop.is_set():
        try:
            ask(urls[index % len(urls)], index)
            counts[0] += 1
        except Exception as error:  # noqa: BLE001 - counted and shown: a soak goes on
            errors.append(f"{type(error).__name__}: {error}")
            stop.wait(1.0)
        index += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup-minutes", type=float, default=5.0)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--port", type=int, default=18080)
    args = parser.parse_args()
    _ensure_model(MODEL)
    with tempfile.TemporaryDirectory(prefix="ncm-soak-") as base:
        processes = start_local_cluster(args.nodes, args.port, Path(base), MODEL, log_dir=Path(base) / "logs")
        urls = [f"http://127.0.0.1:{args.port + i}" for i in range(args.nodes)]
        stop, counts, errors = threading.Event(), [0], []
        try:
            wait_ready(urls[0], processes, 600)
            workers = [threading.Thread(target=client, args=(urls, stop, counts, errors, i), daemon=True)
                       for i in range(args.clients)]
            for worker in workers:
                worker.start()
            started = time.monotonic()
            samples: list[tuple[float, list[float]]] = []
            while (elapsed := time.monotonic() - started) < args.minutes * 60:
                rss = [psutil.Process(p.pid).memory_info().rss / MIB for p in processes]
                samples.append((elapsed / 60, rss))
                print(f"{elapsed / 60:5.1f} min  requests {counts[0]:6d}  errors {len(errors):4d}  RSS MiB "
                      + "  ".join(f"{value:7.1f}" for value in rss), flush=True)
                stop.wait(SAMPLE_S)
        finally:
            stop.set()
            stop_processes(processes)
    after = [(minute, rss) for minute, rss in samples if minute >= args.warmup_minutes]
    if len(after) < 2:
        print("too short a soak to judge (lengthen --minutes or shorten --warmup-minutes)")
        return 1
    print(f"\n{counts[0]} requests, {len(errors)} errors{': ' + errors[-1] if errors else ''}")
    print("agent  after warm-up  last    last/warm-up  slope MiB/min")
    flat = True
    for agent in range(args.nodes):
        minutes = np.array([m for m, _ in after])
        values = np.array([rss[agent] for _, rss in after])
        slope = float(np.polyfit(minutes, values, 1)[0])
        ratio = values[-1] / values[0]
        flat &= ratio <= 1.10
        print(f"{agent:5d}  {values[0]:12.1f}  {values[-1]:6.1f}  {ratio:12.3f}  {slope:13.2f}")
    print("flat within 10 % after the warm-up" if flat else "NOT flat: an agent grew more than 10 % after the warm-up")
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
