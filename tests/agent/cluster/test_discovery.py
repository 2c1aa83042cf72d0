"""mDNS discovery with real multicast: three agents in their own network namespaces, joined by
veth pairs to a bridge, given no peers at all, find each other, elect one orchestrator and
serve a request. A fourth namespace holds a stranger without the cluster key that announces
itself as the cluster's orchestrator: nobody follows it. Needs root (ip netns); skipped with
the reason elsewhere."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys

import pytest

from agent.cli.demo import stop_processes
from tests.agent.agents import CLUSTER_KEY, FAST_TIMING, REPO, SEED_SPLIT, wait_for
from tests.agent.impostor import NODE_ID as IMPOSTOR_ID
from tests.agent.impostor import SEEN_PATH

pytestmark = pytest.mark.slow
SUBNET = "10.213.77"
PORT = 8080


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def ns_http(ns: str, method: str, url: str, body: object = None, timeout_s: float = 120.0) -> tuple[int, object]:
    """An HTTP call made from inside namespace ``ns``."""
    script = (
        "import json, sys, urllib.request, urllib.error\n"
        "method, url, body, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])\n"
        "req = urllib.request.Request(url, data=body.encode() if body else None, method=method,"
        " headers={'Content-Type': 'application/json'})\n"
        "try:\n"
        "    r = urllib.request.urlopen(req, timeout=timeout); print(r.status); print(r.read().decode())\n"
        "except urllib.error.HTTPError as e:\n"
        "    print(e.code); print(e.read().decode())\n"
    )
    result = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", script, method, url, json.dumps(body) if body is not None else "", str(timeout_s)],
        capture_output=True, text=True, timeout=timeout_s + 30,
    )
    if result.returncode != 0:
        raise ConnectionError(result.stderr.strip().splitlines()[-1:] or "request failed")
    status, _, text = result.stdout.partition("\n")
    return int(status), json.loads(text)


@pytest.fixture
def namespaces():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    tag = secrets.token_hex(3)
    bridge_ns = f"ncm-br-{tag}"
    nodes = [f"ncm-n{i}-{tag}" for i in range(4)]
    try:
        ip("netns", "add", bridge_ns)
    except subprocess.CalledProcessError as error:
        pytest.skip(f"cannot create network namespaces here: {error.stderr.decode().strip()}")
    created = [bridge_ns]
    try:
        ip("-n", bridge_ns, "link", "add", "br0", "type", "bridge")
        ip("-n", bridge_ns, "link", "set", "br0", "up")
        for index, ns in enumerate(nodes):
            ip("netns", "add", ns)
            created.append(ns)
            inner, outer = f"nv{tag}{index}a", f"nv{tag}{index}b"
            ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            ip("link", "set", inner, "netns", ns)
            ip("link", "set", outer, "netns", bridge_ns)
            ip("-n", ns, "link", "set", inner, "name", "eth0")
            ip("-n", ns, "addr", "add", f"{SUBNET}.{index + 1}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")
            ip("-n", bridge_ns, "link", "set", outer, "master", "br0")
            ip("-n", bridge_ns, "link", "set", outer, "up")
        yield nodes
    finally:
        for ns in reversed(created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_agents_without_peers_find_each_other_by_mdns_and_serve(namespaces, smollm2_store, tmp_path):
    agents, impostor_ns = namespaces[:3], namespaces[3]
    impostor_url = f"http://{SUBNET}.4:{PORT}"
    processes = []
    logs = []
    try:
        for index, ns in enumerate(agents):
            state = tmp_path / f"agent-{index}"
            env = {
                **os.environ,
                "NCM_HOME": str(smollm2_store.root if index == 0 else state / "home"),
                "NCM_STATE_DIR": str(state),
                "NCM_CLUSTER_KEY": CLUSTER_KEY,
                "NCM_CLUSTER_NAME": "netns",
                "NCM_MDNS": "true",
                "NCM_THREADS": "1",
                **FAST_TIMING,
                **SEED_SPLIT,
                "NCM_DISCOVERY_GRACE_S": "3",
            }
            log_path = tmp_path / f"agent-{index}.log"
            logs.append(log_path)
            with log_path.open("wb") as log:
                processes.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns, sys.executable, "-m", "agent.cli", "serve", "--port", str(PORT)],
                    cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                ))
        log_path = tmp_path / "impostor.log"
        logs.append(log_path)
        with log_path.open("wb") as log:
            processes.append(subprocess.Popen(
                ["ip", "netns", "exec", impostor_ns, sys.executable, "-m", "tests.agent.impostor", "--port", str(PORT),
                 "--peer-port", str(PORT + 1), "--cluster", "netns", "--mdns", f"{SUBNET}.4"],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            ))
        first = f"http://{SUBNET}.1:{PORT}"

        def three_alive():
            status, view = ns_http(agents[0], "GET", first + "/cluster/nodes", timeout_s=5)
            return status == 200 and sum(1 for n in view["nodes"] if n["alive"]) == 3 and view

        view = wait_for(three_alive, timeout_s=90, what="3 agents to discover each other over mDNS", interval_s=0.5)
        assert {n["source"] for n in view["nodes"] if n["alive"] and not n["self"]} == {"mdns"}

        def views():
            return [ns_http(ns, "GET", f"http://{SUBNET}.{index + 1}:{PORT}/cluster/nodes", timeout_s=5)[1]
                    for index, ns in enumerate(agents)]

        def one_orchestrator():
            seen = {nodes["orchestrator"] for nodes in views()}
            return len(seen) == 1 and None not in seen

        wait_for(one_orchestrator, timeout_s=30, what="all three agents to name the same orchestrator", interval_s=0.5)

        def impostor_rejected_by_all():
            return all(impostor_url in [r["url"] for r in nodes["rejected"]] for nodes in views())

        wait_for(impostor_rejected_by_all, timeout_s=60, what="every agent to find the impostor by mDNS and reject it",
                 interval_s=0.5)

        def serving():
            status, body = ns_http(agents[2], "GET", f"http://{SUBNET}.3:{PORT}/cluster/status", timeout_s=5)
            return status == 200 and body["state"] == "ok" and len(body["nodes_alive"]) == 3

        wait_for(serving, timeout_s=300, what="the cluster to serve", interval_s=1.0)
        status, body = ns_http(agents[1], "POST", f"http://{SUBNET}.2:{PORT}/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                                "temperature": 0, "max_tokens": 16})
        assert status == 200, body
        assert "Paris" in body["choices"][0]["message"]["content"]
        for nodes in views():
            assert nodes["orchestrator"] != IMPOSTOR_ID
            assert IMPOSTOR_ID not in [n["id"] for n in nodes["nodes"]]
        # Each agent asked its public health once, failed to verify its TLS certificate, and
        # never contacted it again.
        _, seen = ns_http(impostor_ns, "GET", impostor_url + SEEN_PATH, timeout_s=5)
        assert {(s["method"], s["path"]) for s in seen} == {("GET", "/health")}
        assert len(seen) == 3 and len({s["from"] for s in seen}) == 3
    finally:
        stop_processes(processes)
        for log_path in logs:
            print(f"--- {log_path.name} ---\n{log_path.read_text(errors='replace')[-3000:]}")
