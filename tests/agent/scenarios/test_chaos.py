"""A bounded randomized schedule of failures on a real 3-agent cluster while a client streams
through the one agent never disturbed: SIGKILL and restart, SIGSTOP/SIGCONT, a graceful
restart, a corrupted layer file, and a joining agent whose disk is full. The schedule is
seeded (``NCM_CHAOS_SEED``: a number replays that schedule, ``random`` draws one; the seed is
printed; by default a schedule with every action once) and after every step:

- the stream completed with the text of an undisturbed greedy run, or ended with one clear
  error event;
- no agent died that was not killed on purpose;
- once the disturbed agent is back, `/cluster/status` says `ok` and a probe request gets the
  undisturbed text;
and at the end no session is left on any agent once idle ones are freed, and no agent's
memory grew without bound.

Every agent holds the model whole, so the fallback (the smallest model held whole) is the
model itself: degraded or not, the greedy text is the same."""

from __future__ import annotations

import os
import random
import shutil
import signal

import psutil
import pytest

from tests.agent.agents import (
    MAIN,
    Agent,
    cluster_ready,
    give_small_disk,
    linked_copy,
    make_agents,
    shut_down,
    wait_for,
)
from tests.agent.scenarios.test_failover import QUESTION, TOKENS, Stream

pytestmark = pytest.mark.slow
STEPS = 5
DEFAULT_SEED = 6  # a schedule with every action once; NCM_CHAOS_SEED=random explores others
ACTIONS = ("kill", "freeze", "restart", "corrupt", "full-disk")
# Sessions of requests abandoned mid-step (a frozen stage answering late) are freed when idle:
# after 20 s here, so that the run can check that none is left.
ENV = {"NCM_REPLICATE_HEAD_RATIO": "0.8", "NCM_REPLICA_COUNT": "1", "NCM_REPLAN_MIN_INTERVAL_S": "2",
       "NCM_RAM_GIB": "4", "NCM_SESSION_IDLE_TIMEOUT_S": "20"}


def peers(agents: list[Agent], agent: Agent) -> list[str]:
    return [f"--peer={other.url}" for other in agents if other is not agent]


def answer(agent: Agent) -> str:
    status, body = agent.post("/v1/chat/completions", {"messages": QUESTION, "temperature": 0, "max_tokens": TOKENS})
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def leftovers(agent: Agent) -> tuple[int, int]:
    """Sessions held, and fragments held beyond those of the orders served (with standby)."""
    view = agent.get("/cluster/nodes", timeout_s=10)[1]
    worker = next(n for n in view["nodes"] if n["self"])["worker"]
    return worker["sessions"], worker["fragments_held"] - len(worker["fragments"]) - len(worker["standby"])


def flip_a_layer_byte(agent: Agent) -> str:
    model_dir = agent.home / "models" / "smollm2-135m"
    layer = sorted((model_dir / "weights").glob("layer_*.safetensors"))[7]
    data = bytearray(layer.read_bytes())
    data[len(data) // 2] ^= 0x10
    layer.unlink()  # a file of its own: the others' stores are links to the same bytes
    layer.write_bytes(bytes(data))
    shutil.rmtree(model_dir / "fragments", ignore_errors=True)  # built again, from the files
    return layer.name


def test_a_randomized_schedule_of_failures_keeps_every_stream_whole_or_clearly_ended(smollm2_store, tmp_path):
    chosen = os.environ.get("NCM_CHAOS_SEED", str(DEFAULT_SEED))
    seed = random.randrange(2**32) if chosen == "random" else int(chosen)
    rng = random.Random(seed)
    print(f"chaos seed {seed} (NCM_CHAOS_SEED={seed} replays this schedule)")
    # The model alone (other tests add a q4 copy to the shared store): it is its own fallback.
    homes = [linked_copy(smollm2_store.root, tmp_path / f"home-{i}", (MAIN,)) for i in range(3)]
    agents = make_agents(tmp_path, homes, 3, extra_env=ENV, start=False)
    agents[0].env["NCM_ORCHESTRATOR"] = "false"
    for agent in agents:
        agent.start(peers(agents, agent))
    client = agents[0]
    extra: list[Agent] = []
    try:
        wait_for(lambda: cluster_ready(client, 3), timeout_s=300, what="the cluster to serve")
        undisturbed = answer(client)
        rss_before = psutil.Process(client.process.pid).memory_info().rss
        for step in range(STEPS):
            action, victim = rng.choice(ACTIONS), rng.choice(agents[1:])
            where = f"seed {seed}, step {step}: {action} of {victim.name}"
            print(where)
            stream = Stream(client)
            stream.wait_pieces(3)
            newcomer = None
            if action == "kill":
                victim.kill()
            elif action == "freeze":
                victim.process.send_signal(signal.SIGSTOP)
            elif action == "restart":
                victim.stop()
            elif action == "full-disk":
                newcomer = make_agents(tmp_path / f"newcomer-{step}", tmp_path / f"newcomer-{step}-home", 1,
                                       extra_env={**ENV, "NCM_VRAM_GIB": "8"}, start=False)[0]
                give_small_disk(newcomer, 8 << 20)
                newcomer.start([f"--peer={client.url}"])
                extra.append(newcomer)
            stream.join()
            assert (stream.errors == [] and stream.done and stream.text == undisturbed) or \
                   (len(stream.errors) == 1 and not stream.done), (where, stream.errors, stream.text)
            if action == "freeze":
                victim.process.send_signal(signal.SIGCONT)
            elif action in ("kill", "restart", "corrupt"):
                victim.kill()
                if action == "corrupt":
                    flip_a_layer_byte(victim)
                victim.start(peers(agents, victim))
            elif newcomer is not None:
                newcomer_id = wait_for(newcomer.node_id, timeout_s=60, what="the joining agent")
                wait_for(lambda: newcomer_id in (client.get("/cluster/status", timeout_s=10)[1].get("faults") or {}),
                         timeout_s=180, what=f"{where}: the full disk marked")
                newcomer.stop()
            for agent in agents:
                if agent is not victim:
                    assert agent.process.poll() is None, f"{where}: {agent.name} died"
            wait_for(lambda: cluster_ready(client, 3), timeout_s=240, what=f"{where}: the cluster back on 3 agents")
            assert answer(client) == undisturbed, where
        for agent in agents:  # nothing held beyond what the orders served need (retired ones go in 30 s)
            wait_for(lambda: leftovers(agent) == (0, 0), timeout_s=90,
                     what=f"seed {seed}: no session or extra fragment left on {agent.name}")
        rss_after = psutil.Process(client.process.pid).memory_info().rss
        # Plans changed on the way (standby and degraded fragments came and went): a gross
        # bound only, fragments held are checked exactly above.
        assert rss_after < 3 * rss_before + (512 << 20), f"seed {seed}: {rss_before >> 20} -> {rss_after >> 20} MiB"
    finally:
        shut_down(agents + extra, keep_store=None)
