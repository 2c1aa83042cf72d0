"""Real agent processes for integration tests: start, wait for conditions, kill."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.cluster.tls import issue_node_files
from agent.core.auth import admin_token
from tests.deadlines import Deadline

REPO = Path(__file__).resolve().parents[2]
MAIN, FALLBACK = "smollm2-135m", "smollm2-135m-q4"
CLUSTER_KEY = "test-cluster-key-0123456789"
ADMIN = {"Authorization": f"Bearer {admin_token(CLUSTER_KEY.encode())}"}  # for load, unload, join, reload
FAST_TIMING = {
    "NCM_HEALTH_INTERVAL_S": "0.3",
    "NCM_PEER_TIMEOUT_S": "2.0",
    "NCM_DISCOVERY_GRACE_S": "0.6",
    "NCM_FAILURE_THRESHOLD": "3",
}
# The agents of the seed's tests split every model (its plan, failover and degraded mode); a test
# of whole copies names its placement in a preset, or asks for the product's default (design §11).
SEED_SPLIT = {"NCM_DEFAULT_PLACEMENT": "split"}


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int) -> list[int]:
    """``count`` free loopback ports below the kernel's ephemeral range: a port the kernel hands
    out for ``bind(0)`` (an agent's peer port) or an outgoing connection can never be one of
    them, so an agent started a moment later still finds its port free."""
    chooser = random.Random()
    sockets: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            port = chooser.randrange(10000, _ephemeral_low())
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            sockets.append(s)
            ports.append(port)
    finally:
        for s in sockets:
            s.close()
    return ports


def member_tls(directory: Path) -> ssl.SSLContext:
    """A client TLS context with a certificate of the test cluster's CA, as members hold."""
    return issue_node_files(CLUSTER_KEY.encode(), "tester", directory).client_context()


def http(method: str, url: str, body: Any = None, *, headers: dict[str, str] | None = None,
         raw: bytes | None = None, timeout_s: float = 120.0, tls: ssl.SSLContext | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=tls) as response:
            text = response.read()
            status = response.status
    except urllib.error.HTTPError as error:
        text, status = error.read(), error.code
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text.decode(errors="replace")


class AgentExited(AssertionError):
    """An agent process the test did not stop has exited: waiting on it any longer is pointless."""


def wait_for(condition: Callable[[], Any], *, timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
    """Poll ``condition`` until it returns something truthy, or fail after ``timeout_s``
    (stretched while the machine is busy: :class:`tests.deadlines.Deadline`)."""
    deadline = Deadline(timeout_s)
    last_error: Exception | None = None
    while not deadline.expired():
        try:
            value = condition()
            if value:
                return value
        except AgentExited:
            raise
        except Exception as error:  # noqa: BLE001 - retried until the deadline
            last_error = error
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {deadline.describe()} waiting for {what} (last error: {last_error})")


@dataclass
class Agent:
    name: str
    port: int
    home: Path
    state_dir: Path
    log_path: Path
    process: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable  # another environment's interpreter runs the agent there
    prefix: list[str] = field(default_factory=list)  # runs the agent (e.g. in a mount namespace)
    stopped_by_test: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        return self._call("GET", path, None, kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return self._call("POST", path, body, kw)

    def _call(self, method: str, path: str, body: Any, kw: dict[str, Any]) -> tuple[int, Any]:
        try:
            return http(method, self.url + path, body, **kw)
        except urllib.error.URLError:
            exited = self.process is not None and self.process.poll() is not None
            if exited and not self.stopped_by_test:
                raise AgentExited(f"{self.name} exited with status {self.process.returncode}; "
                                  f"the end of its log:\n{self.log()[-3000:]}") from None
            raise

    def node_id(self) -> str:
        return self.get("/health", timeout_s=5)[1]["node_id"]

    def peer_url(self) -> str:
        """Where its internal endpoints answer (TLS; the port is announced on /health)."""
        return f"https://127.0.0.1:{self.get('/health', timeout_s=5)[1]['peer_port']}"

    def start(self, args: list[str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.stopped_by_test = False
        self.process = subprocess.Popen(
            [*self.prefix, self.python, "-m", "agent.cli", "serve", "--port", str(self.port), *args],
            cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()

    def kill(self) -> None:
        """SIGKILL, as when a device loses power."""
        self.stopped_by_test = True
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        self.stopped_by_test = True
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def make_agents(tmp: Path, model_home: Path | list[Path], count: int, *, extra_env: dict[str, str] | None = None,
                start: bool = True) -> list[Agent]:
    """``count`` agents on loopback with static peers. ``model_home`` is the first agent's store
    (the others start empty), or a list with every agent's store."""
    ports = free_ports(count)
    agents = []
    for index, port in enumerate(ports):
        state = tmp / f"agent-{index}"
        if isinstance(model_home, list):
            home = model_home[index]
        else:
            home = model_home if index == 0 else state / "home"
        env = {
            **os.environ,
            "NCM_HOME": str(home),
            "NCM_STATE_DIR": str(state),
            "NCM_CLUSTER_KEY": CLUSTER_KEY,
            "NCM_CLUSTER_NAME": "test",
            "NCM_MDNS": "false",
            "NCM_HOST": "127.0.0.1",
            "NCM_ADVERTISE_HOST": "127.0.0.1",
            "NCM_THREADS": "1",
            **FAST_TIMING,
            **SEED_SPLIT,
            **(extra_env or {}),
        }
        agents.append(Agent(f"agent-{index}", port, home, state, tmp / f"agent-{index}.log", env=env))
    if start:
        for agent in agents:
            agent.start([f"--peer={other.url}" for other in agents if other is not agent])
    return agents


def give_small_disk(agent: Agent, size_bytes: int) -> str:
    """Put ``agent``'s model store on a disk of ``size_bytes``: a tmpfs in a mount namespace of
    its own where the machine allows it (root), else a store directory that refuses writes.
    Returns which of the two it got."""
    agent.home.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0 and shutil.which("unshare"):
        probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=4k tmpfs {agent.home}"],
                               capture_output=True, timeout=30)
        if probe.returncode == 0:
            agent.prefix = ["unshare", "-m", "sh", "-c",
                            f'mount -t tmpfs -o size={size_bytes} tmpfs "$0" && exec "$@"', str(agent.home)]
            return "tmpfs"
    (agent.home / "models").mkdir(exist_ok=True)
    (agent.home / "models").chmod(0o555)
    return "read-only"


def shut_down(agents: list[Agent], *, keep_store: Path | None = None, log_chars: int = 5000) -> None:
    """Stop every agent and print the end of its log, then delete its model store (pulled
    weights and fragments: gigabytes) unless it is ``keep_store``. Logs and state stay."""
    for agent in agents:
        agent.stop()
    for agent in agents:
        print(f"--- {agent.name} ---\n{agent.log()[-log_chars:]}")
    for agent in agents:
        if agent.home != keep_store:
            shutil.rmtree(agent.home, ignore_errors=True)


def linked_copy(store_root: Path, dest: Path, models: tuple[str, ...] | None = None) -> Path:
    """Each agent gets the models (``models``, default all) as hard links (no fragments: each
    builds its own)."""
    for model in models or [p.name for p in (store_root / "models").iterdir() if not p.name.startswith(".")]:
        shutil.copytree(store_root / "models" / model, dest / "models" / model, copy_function=os.link,
                        ignore=shutil.ignore_patterns("fragments", ".*"))
    return dest


def cluster_ready(agent: Agent, nodes: int) -> dict | None:
    status, body = agent.get("/cluster/status", timeout_s=5)
    if status == 200 and body.get("state") == "ok" and len(body.get("nodes_alive", [])) == nodes:
        return body
    return None


class ModelEvents:
    """`GET /models/sse` of an agent, read in a thread: every event, in order."""

    def __init__(self, agent: Agent) -> None:
        self.events: list[dict[str, Any]] = []
        self.failure: BaseException | None = None
        self._response = urllib.request.urlopen(agent.url + "/models/sse", timeout=120)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for raw in self._response:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    self.events.append(json.loads(line[len("data: "):]))
        except Exception as error:  # noqa: BLE001 - reported by wait()
            self.failure = error

    def wait(self, condition: Callable[[dict[str, Any]], bool], *, after: int = 0, timeout_s: float = 120,
             what: str = "a model event") -> dict[str, Any]:
        """The first event from index ``after`` on that meets ``condition``."""
        def found() -> dict[str, Any] | None:
            return next((e for e in self.events[after:] if condition(e)), None)
        return wait_for(found, timeout_s=timeout_s, what=what)

    def close(self) -> None:
        self._response.close()
