"""`ncm demo`'s cluster (3 agents on this machine, only the first holding the model, default
timing and placement: a whole copy on each) keeps serving a stream after losing any one agent:
the stream completes with the text of an undisturbed run and the status is `ok` or `degraded`."""

from __future__ import annotations

import shutil
import signal
import socket
from pathlib import Path

import pytest

from agent.cli.demo import start_local_cluster, stop_processes, wait_ready
from tests.agent.agents import MAIN, http, linked_copy, wait_for
from tests.agent.scenarios.test_failover import QUESTION, TOKENS

pytestmark = pytest.mark.slow


def consecutive_free_ports(count: int) -> int:
    """The first of ``count`` consecutive free loopback ports (the demo numbers its agents so)."""
    for base in range(23000, 60000, 97):
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise AssertionError("no consecutive free ports")


def ask(url: str) -> str:
    status, body = http("POST", url + "/v1/chat/completions",
                        {"messages": QUESTION, "temperature": 0, "max_tokens": TOKENS})
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


@pytest.mark.parametrize(("client", "victim"), [(0, 1), (0, 2), (1, 0)],
                         ids=["client-on-the-holder-lose-1", "client-on-the-holder-lose-2", "lose-the-holder"])
def test_a_demo_cluster_keeps_streaming_after_losing_any_one_agent(smollm2_store, tmp_path: Path, client, victim):
    from tests.agent.scenarios.test_failover import Stream

    port = consecutive_free_ports(3)
    urls = [f"http://127.0.0.1:{port + i}" for i in range(3)]
    # The first agent's store holds the model alone (other tests add a q4 copy to the shared one).
    home = linked_copy(smollm2_store.root, tmp_path / "demo" / "home-0", (MAIN,))
    processes = start_local_cluster(3, port, tmp_path / "demo", MAIN, log_dir=tmp_path / "logs",
                                    node_env=[{"NCM_HOME": str(home)}])
    logs = [tmp_path / "logs" / f"node-{i}.log" for i in range(3)]
    try:
        wait_ready(urls[0], processes, 300)
        # Only the first agent was given the model; the others keep whole copies of the
        # fallback (here the model itself: the smallest one held whole) when they have room.
        wait_for(lambda: all("holding a whole copy" in logs[i].read_text(errors="replace") for i in (1, 2)),
                 timeout_s=300, what="whole copies of the fallback on the other agents")
        # the default placement (design §11): every agent has room, so each serves a whole copy
        wait_for(lambda: len(http("GET", urls[0] + "/cluster/status", timeout_s=10)[1]["models"][MAIN]["copies"]) == 2,
                 timeout_s=120, what="the model placed as whole copies on the other two agents")
        undisturbed = ask(urls[client])

        class Agent:  # what Stream needs of an agent
            url = urls[client]

        stream = Stream(Agent())  # type: ignore[arg-type]
        stream.wait_pieces(4)
        processes[victim].send_signal(signal.SIGKILL)
        stream.join()
        assert stream.errors == [] and stream.done, stream.errors
        assert stream.text == undisturbed
        state = wait_for(lambda: (s := http("GET", urls[client] + "/cluster/status", timeout_s=10)[1]).get("state")
                         in ("ok", "degraded") and len(s.get("nodes_alive", [])) == 2 and s["state"],
                         timeout_s=60, what="the status of the two agents left")
        assert state in ("ok", "degraded")
        assert ask(urls[client]) == undisturbed
    finally:
        stop_processes(processes)
        for i, log in enumerate(logs):
            print(f"--- node-{i} ---\n{log.read_text(errors='replace')[-4000:] if log.exists() else ''}")
        shutil.rmtree(tmp_path / "demo", ignore_errors=True)  # the other agents' stores: a model each
