"""Model router timings on a real 3-agent cluster on loopback, from one run.

    python bench/router.py [--port 18800] [--repeat 5]

Two models: smollm2-135m (f32, loaded at start) and smollm2-135m-q4 (sleeps after 2 s idle).
Prints the time from request to first token (streamed, one token asked) for:
- a ready model;
- a cold one (unloaded; the first load of the run also fetches weights and builds fragments);
- a sleeping one (plan kept, fragments released);
and the router's own part of a request to a ready model (its `Server-Timing: router`
header: resolving the name and admitting the request), next to the whole time to first token.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.cli.demo import _ensure_model, start_local_cluster, stop_processes, wait_ready  # noqa: E402
from agent.cli.http_client import http_json  # noqa: E402
from agent.core.auth import admin_token  # noqa: E402

MAIN, OTHER = "smollm2-135m", "smollm2-135m-q4"
PRESETS = f"[{OTHER}]\nsleep-idle-seconds = 2\n"
ENV = {"NCM_DEFAULT_PLACEMENT": "split",  # the figures of earlier notes: split models
       "NCM_THREADS": "1", "NCM_RAM_GIB": "4", "NCM_CLUSTER_KEY": "bench-cluster-key-0123456789",
       "NCM_REPLAN_MIN_INTERVAL_S": "600"}


def first_token(url: str, model: str) -> tuple[float, float]:
    """(seconds to the first token, the router's milliseconds) of one streamed request."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": 1, "temperature": 0, "stream": True}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        router_ms = float(response.headers.get("Server-Timing", "router;dur=nan").split("dur=")[1])
        for line in response:
            if line.startswith(b"data: {") and b'"content"' in line:
                elapsed = time.perf_counter() - started
                for _ in response:
                    pass
                return elapsed, router_ms
    raise RuntimeError("no token came back")


def state(url: str, model: str) -> str:
    return {m["id"]: m["state"] for m in http_json("GET", url + "/models")["data"]}[model]


def wait_state(url: str, model: str, wanted: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while state(url, model) != wanted:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{model} never became {wanted}")
        time.sleep(0.1)


def report(name: str, seconds: list[float]) -> None:
    print(f"{name:<34} median {1000 * statistics.median(seconds):8.1f} ms   "
          f"min {1000 * min(seconds):8.1f}   max {1000 * max(seconds):8.1f}   (n={len(seconds)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=18800)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    _ensure_model(MAIN)
    _ensure_model(OTHER)
    with tempfile.TemporaryDirectory(prefix="ncm-bench-") as tmp:
        base = Path(tmp)
        (base / "models.ini").write_text(PRESETS)
        env = {**ENV, "NCM_MODELS_PRESET": str(base / "models.ini"), "NCM_CLUSTER_KEY": secrets.token_hex(16)}
        admin = admin_token(env["NCM_CLUSTER_KEY"].encode())
        processes = start_local_cluster(3, args.port, base, MAIN, env=env, node_env=[{"NCM_ORCHESTRATOR": "true"}],
                                        log_dir=base / "logs")
        try:
            url = f"http://127.0.0.1:{args.port}"
            wait_ready(url, processes, 600)
            entry = f"http://127.0.0.1:{args.port + 1}"  # requests enter at a worker, as apps do

            first_token(entry, MAIN)  # warm the path once
            ready = [first_token(entry, MAIN) for _ in range(4 * args.repeat)]
            report("ready model: first token", [t for t, _ in ready])
            router_ms = statistics.median(ms for _, ms in ready)
            print(f"{'ready model: router part':<34} median {router_ms:8.3f} ms   "
                  f"({100 * router_ms / 1000 / statistics.median(t for t, _ in ready):.2f}% of the first token)")

            cold = []
            for _ in range(args.repeat):
                if state(url, OTHER) not in ("unloaded", "failed"):
                    http_json("POST", url + "/models/unload", {"model": OTHER}, token=admin)
                cold.append(first_token(entry, OTHER)[0])
            print(f"{'cold model, first load of the run':<34} {1000 * cold[0]:15.1f} ms   (fetches weights, builds fragments)")
            report("cold model: first token", cold[1:] or cold)

            sleeping = []
            for _ in range(args.repeat):
                wait_state(url, OTHER, "sleeping")
                sleeping.append(first_token(entry, OTHER)[0])
            report("sleeping model: first token", sleeping)
        finally:
            stop_processes(processes)


if __name__ == "__main__":
    main()
