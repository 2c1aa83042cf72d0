"""`ncm demo`: a local cluster of several agents on this machine serving the default model.

Each agent is a real process with its own state directory (node id, and a model store of
its own: the agents other than the first fetch the layers they serve from the first one),
static peers on loopback, one shared cluster key. The API is served on --port (every agent
answers on its own port too).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.cli.http_client import http_json
from agent.core.errors import NcmError
from agent.local.runtime_env import read_thp_mode, runtime_env
from shards.store.model_store import ModelStore, ncm_home

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 600.0
EXAMPLE_QUESTION = "What is the capital of France?"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="start a local cluster serving the default model",
                                   description="Start several agents on this machine and serve the default model.")
    parser.add_argument("--nodes", type=int, default=3, help="number of agents (default %(default)s)")
    parser.add_argument("--port", type=int, default=8080, help="API port of the first agent; the others take the next ones")
    parser.add_argument("--model", default="smollm2-135m", help="model to serve (default %(default)s)")
    parser.add_argument("--dir", type=Path, help="where the agents keep their state (default: $NCM_HOME/demo)")
    parser.add_argument("--once", action="store_true", help="ask the example question, print the answer and stop")
    parser.set_defaults(func=run)


def _ensure_model(name: str) -> None:
    store = ModelStore()
    if store.has(name):
        return
    from shards.importers.pull import pull_model

    print(f"pulling {name} (first run only)…", flush=True)
    pull_model(name, store=store)


def wait_ready(url: str, processes: list[subprocess.Popen], deadline_s: float) -> dict:
    """Wait until the cluster serves with every started agent in the plan."""
    deadline = time.monotonic() + deadline_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                raise NcmError(f"an agent exited with status {process.returncode} while starting; see its log above")
        try:
            status = http_json("GET", url + "/cluster/status")
            if status.get("state") == "ok" and len(status.get("nodes_alive", [])) == len(processes):
                return status
            last = f"{status.get('state')}: {status.get('message')}"
        except NcmError as error:
            last = str(error)
        time.sleep(0.5)
    raise NcmError(f"the cluster did not become ready within {deadline_s:g} s ({last})")


def ask(url: str, question: str, model: str) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": question}],
                       "temperature": 0, "max_tokens": 64}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"]


@dataclass(frozen=True)
class LocalAgent:
    """How one agent of a local cluster is started (and started again after it died)."""

    index: int
    port: int
    argv: tuple[str, ...]
    env: dict[str, str]
    log_path: Path | None = None

    def start(self) -> subprocess.Popen:
        output = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            output = self.log_path.open("ab")
        return subprocess.Popen(self.argv, env=self.env, stdout=output, stderr=subprocess.STDOUT if output else None)


def local_agents(nodes: int, port: int, base: Path, model: str, *, env: dict[str, str] | None = None,
                 node_env: list[dict[str, str]] | None = None, log_dir: Path | None = None,
                 first_index: int = 0, extra_peers: tuple[str, ...] = ()) -> list[LocalAgent]:
    """``nodes`` agents on loopback ports port..port+nodes-1, each given the others as peers
    (in the environment :func:`~agent.cli.launch.runtime_env` gives).

    Agent 0 uses the model store the model was pulled into; the others start empty and fetch
    the layers they serve from it. ``env`` applies to all agents, ``node_env[i]`` to agent i;
    a cluster key is generated unless ``env`` gives one.
    """
    shared = {"NCM_CLUSTER_KEY": secrets.token_hex(16), **(env or {})}
    ports = [port + i for i in range(nodes)]
    agents = []
    thp = read_thp_mode()
    for index, own_port in enumerate(ports, start=first_index):
        state_dir = base / f"node-{index}"
        agent_env = runtime_env({
            **os.environ, "NCM_CLUSTER_NAME": "demo", "NCM_MDNS": "false", "NCM_HOST": "127.0.0.1",
            "NCM_ADVERTISE_HOST": "127.0.0.1", "NCM_MODEL": model, "NCM_DISCOVERY_GRACE_S": "1.0",
            "NCM_STATE_DIR": str(state_dir), "NCM_HOME": str(ncm_home() if index == 0 else state_dir),
            **shared, **(node_env[index] if node_env and index < len(node_env) else {}),
        }, thp)
        peers = [f"--peer=http://127.0.0.1:{p}" for p in ports if p != own_port] + [f"--peer={u}" for u in extra_peers]
        agents.append(LocalAgent(index, own_port,
                                 (sys.executable, "-m", "agent.cli", "serve", "--port", str(own_port), *peers),
                                 agent_env, log_dir / f"node-{index}.log" if log_dir is not None else None))
    return agents


def start_local_cluster(nodes: int, port: int, base: Path, model: str, **options: Any) -> list[subprocess.Popen]:
    """Start the agents of :func:`local_agents` (same arguments); returns their processes."""
    return [agent.start() for agent in local_agents(nodes, port, base, model, **options)]


def stop_processes(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=40)
        except subprocess.TimeoutExpired:
            process.kill()


class Supervisor:
    """Keeps a local cluster's agents running: an agent that stops is reported, the cluster's
    failover is shown as it happens, and the agent is started again after ``restart_delay_s``
    (as systemd restarts a device's agent), unless it stopped ``max_restarts`` times within
    ``window_s``: then it stays down and the others serve on."""

    def __init__(self, agents: list[LocalAgent], processes: list[subprocess.Popen], *, restart_delay_s: float = 5.0,
                 max_restarts: int = 5, window_s: float = 300.0) -> None:
        self.agents, self.processes = agents, processes
        self.restart_delay_s, self.max_restarts, self.window_s = restart_delay_s, max_restarts, window_s
        self.stops: dict[int, list[float]] = {agent.index: [] for agent in agents}
        self.restart_at: dict[int, float] = {}  # agent index -> when it starts again
        self.given_up: set[int] = set()
        self.last_state: str | None = None

    def check(self, now: float) -> None:
        """One look: report agents that stopped, start those whose delay is over, show the state."""
        for position, (agent, process) in enumerate(zip(self.agents, self.processes)):
            if agent.index in self.restart_at:
                if now >= self.restart_at[agent.index]:
                    del self.restart_at[agent.index]
                    print(f"starting agent {agent.index} again (port {agent.port})", flush=True)
                    self.processes[position] = agent.start()
            elif agent.index not in self.given_up and process.poll() is not None:
                self._stopped(agent, process.returncode, now)
        self._show_state()

    def _stopped(self, agent: LocalAgent, returncode: int, now: float) -> None:
        how = f"was killed by {signal.Signals(-returncode).name}" if returncode < 0 else f"exited with status {returncode}"
        stops = [t for t in self.stops[agent.index] if now - t < self.window_s] + [now]
        self.stops[agent.index] = stops
        print(f"\nagent {agent.index} (port {agent.port}) {how}: the others take over its work", flush=True)
        if len(stops) > self.max_restarts:
            self.given_up.add(agent.index)
            print(f"agent {agent.index} stopped {len(stops)} times within {self.window_s:g} s: not starting it again "
                  "(see its output above); the other agents serve on", flush=True)
            return
        self.restart_at[agent.index] = now + self.restart_delay_s
        print(f"agent {agent.index} starts again in {self.restart_delay_s:g} s", flush=True)

    def _show_state(self) -> None:
        """Print the cluster's state when it changes, asked of an agent that runs."""
        for agent, process in zip(self.agents, self.processes):
            if process.poll() is not None:
                continue
            try:
                status = http_json("GET", f"http://127.0.0.1:{agent.port}/cluster/status", timeout_s=5.0)
            except NcmError:
                continue
            alive = len(status.get("nodes_alive", []))
            state = f"{status.get('state')} with {alive} of {len(self.agents)} agents, serving {status.get('model')}"
            if status.get("state") != "ok" and status.get("message"):
                state += f" ({status['message']})"
            if state != self.last_state:
                self.last_state = state
                print(f"cluster: {state}", flush=True)
            return


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.nodes <= 16:
        raise NcmError("--nodes must be between 1 and 16")
    _ensure_model(args.model)
    processes: list[subprocess.Popen] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the agents on SIGTERM too
    try:
        agents = local_agents(args.nodes, args.port, args.dir or ncm_home() / "demo", args.model)
        processes = [agent.start() for agent in agents]
        url = f"http://127.0.0.1:{args.port}"
        print(f"starting {args.nodes} agents on ports {args.port}-{args.port + args.nodes - 1}…", flush=True)
        status = wait_ready(url, processes, READY_TIMEOUT_S)
        route = " -> ".join(f"{hop['node'][:8]}[{hop['layers'][0]}-{hop['layers'][1]}]" for hop in status["route"])
        copies = status.get("models", {}).get(status["model"], {}).get("copies", [])
        if copies:  # placed as whole copies (design §11): each serves requests alone
            route += ", whole copies on " + ", ".join(node[:8] for node in copies)
        print(f"\nncm is serving {status['model']} on {args.nodes} agents: {route}")
        answer = ask(url, EXAMPLE_QUESTION, args.model)
        print(f"\n> {EXAMPLE_QUESTION}\n{answer}\n")
        if args.once:
            return 0
        print("Call it like the OpenAI API, for example:")
        print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\")
        print(f"    -d '{{\"model\": \"{args.model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'")
        print(f"  {sys.argv[0]} status --remote {url}")
        if args.nodes > 1:
            print(f"Every agent answers on its own port too. Stop one to see the failover (kill {processes[-1].pid}): "
                  "the others go on serving and the demo starts it again.")
        print("Press Ctrl-C to stop.", flush=True)
        supervisor = Supervisor(agents, processes)
        while True:
            time.sleep(1.0)
            supervisor.check(time.monotonic())
    except KeyboardInterrupt:
        return 0
    finally:
        stop_processes(processes)
