"""`ncm demo` (the main job of `./dev run`) survives the failures it exists to show: each of
its agents is killed in turn (SIGKILL), the others go on answering, the demo starts the dead
one again, and only Ctrl-C stops the whole cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from agent.cli.demo import LocalAgent, Supervisor
from tests.agent.agents import MAIN, REPO, http, linked_copy, wait_for
from tests.agent.cli.test_demo_failover import consecutive_free_ports

QUESTION = {"model": MAIN, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0, "max_tokens": 8}


def sleeper(index: int) -> LocalAgent:
    """A stand-in process for the supervision rules: the policy is the same for any process."""
    return LocalAgent(index, 1, (sys.executable, "-c", "import time; time.sleep(600)"), dict(os.environ))


def test_the_supervisor_starts_a_stopped_agent_again_after_its_delay_and_gives_up_on_one_that_keeps_stopping(capsys):
    agents = [sleeper(0), sleeper(1)]
    processes = [agent.start() for agent in agents]
    supervisor = Supervisor(agents, processes, restart_delay_s=5.0, max_restarts=1, window_s=100.0)
    try:
        first = processes[0]
        first.kill()
        first.wait(timeout=30)
        supervisor.check(now=0.0)
        assert "agent 0 (port 1) was killed by SIGKILL" in capsys.readouterr().out
        supervisor.check(now=4.0)
        assert supervisor.processes[0] is first  # not yet: the delay shows the failover
        supervisor.check(now=5.0)
        restarted = supervisor.processes[0]
        assert restarted is not first and restarted.poll() is None
        assert supervisor.processes[1] is processes[1] and processes[1].poll() is None

        restarted.kill()  # a second stop within the window: more than max_restarts allows
        restarted.wait(timeout=30)
        supervisor.check(now=10.0)
        assert "not starting it again" in capsys.readouterr().out
        supervisor.check(now=20.0)
        assert supervisor.processes[0] is restarted and supervisor.processes[1].poll() is None
    finally:
        for process in supervisor.processes:
            process.kill()
            process.wait(timeout=30)


def agent_process(demo: subprocess.Popen, port: int) -> psutil.Process | None:
    """The running agent the demo started on ``port``."""
    for child in psutil.Process(demo.pid).children():
        try:
            argv = child.cmdline()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if "serve" in argv and argv[argv.index("--port") + 1] == str(port) and child.status() != psutil.STATUS_ZOMBIE:
            return child
    return None


@pytest.mark.slow
def test_ncm_demo_keeps_serving_while_each_agent_is_killed_in_turn_and_stops_on_ctrl_c(smollm2_store, tmp_path: Path):
    port = consecutive_free_ports(3)
    urls = [f"http://127.0.0.1:{port + i}" for i in range(3)]
    home = linked_copy(smollm2_store.root, tmp_path / "home", (MAIN,))
    log = tmp_path / "demo.log"
    env = {**os.environ, "NCM_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as output:
        demo = subprocess.Popen([sys.executable, "-m", "agent.cli", "demo", "--port", str(port), "--dir",
                                 str(tmp_path / "demo"), "--model", MAIN], cwd=REPO, env=env, stdout=output,
                                stderr=subprocess.STDOUT)

    def printed() -> str:
        if demo.poll() is not None:
            raise AssertionError(f"ncm demo exited ({demo.returncode}):\n{log.read_text(errors='replace')[-6000:]}")
        return log.read_text(errors="replace")

    try:
        wait_for(lambda: "Press Ctrl-C to stop." in printed(), timeout_s=600, what="the demo to serve")
        assert "Paris" in printed()
        for victim in (1, 2, 0):  # agent 0 last: it holds the model store and the printed URL
            process = agent_process(demo, port + victim)
            assert process is not None, printed()
            process.send_signal(signal.SIGKILL)
            wait_for(lambda: f"agent {victim} (port {port + victim}) was killed by SIGKILL" in printed(),
                     timeout_s=60, what=f"the demo to see agent {victim} die")
            other = urls[(victim + 1) % 3]

            def answered() -> bool:  # the re-plan may answer 503 with Retry-After for a moment
                status, body = http("POST", other + "/v1/chat/completions", QUESTION, timeout_s=120)
                return status == 200 and bool(body["choices"][0]["message"]["content"])
            wait_for(answered, timeout_s=300, interval_s=1.0, what=f"an answer while agent {victim} is down")
            wait_for(lambda: (p := agent_process(demo, port + victim)) is not None and p.pid != process.pid,
                     timeout_s=120, what=f"the demo to start agent {victim} again")

            def all_serve() -> bool:
                status, body = http("GET", urls[victim] + "/cluster/status", timeout_s=10)
                return status == 200 and body.get("state") == "ok" and len(body.get("nodes_alive", [])) == 3
            wait_for(all_serve, timeout_s=300, interval_s=1.0, what=f"agent {victim} back in a cluster of three")
        assert printed().count("starts again in") == 3
        children = psutil.Process(demo.pid).children()
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=120) == 0
        _, alive = psutil.wait_procs(children, timeout=60)
        assert alive == [], alive
    finally:
        if demo.poll() is None:
            for child in psutil.Process(demo.pid).children():
                child.kill()
            demo.kill()
        print(log.read_text(errors="replace")[-6000:] if log.exists() else "")
