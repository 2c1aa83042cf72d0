"""Pairing: a fresh device joins a running cluster with `ncm join STRING` and nothing else,
and serves its share; expired, revoked and used-up invites are refused with a clear line."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import pytest

from agent.core.invites import JoinString, pairing_proof
from tests.agent.agents import ADMIN, REPO, Agent, cluster_ready, free_ports, http, make_agents, shut_down, wait_for

pytestmark = pytest.mark.slow
QUESTION = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0,
            "max_tokens": 12}
REPLAN = {"NCM_REPLAN_MIN_INTERVAL_S": "1"}


def ncm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], cwd=REPO, env=env or os.environ.copy(),
                          capture_output=True, text=True, timeout=120)


def invite(member: Agent, *args: str) -> str:
    result = ncm("invite", "--agent", member.url, "--token", ADMIN["Authorization"].split()[1], *args)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def fresh_device(tmp_path, members: list[Agent], name: str = "newcomer") -> Agent:
    """An agent as a newly flashed device starts: its own key and the default cluster name."""
    port = free_ports(1)[0]
    state = tmp_path / name
    env = {k: v for k, v in members[0].env.items() if k not in ("NCM_CLUSTER_KEY", "NCM_CLUSTER_NAME", "NCM_HOME",
                                                                  "NCM_STATE_DIR")}
    env.update(NCM_HOME=str(state / "home"), NCM_STATE_DIR=str(state))
    return Agent(name, port, state / "home", state, tmp_path / f"{name}.log", env=env)


def test_a_fresh_device_joins_with_a_join_string_and_serves_its_share(smollm2_store, tmp_path):
    members = make_agents(tmp_path, smollm2_store.root, 2, extra_env=REPLAN)
    newcomer = fresh_device(tmp_path, members)
    flashed = fresh_device(tmp_path, members, "flashed")
    try:
        wait_for(lambda: cluster_ready(members[0], 2) or cluster_ready(members[1], 2), timeout_s=300,
                 what="the 2-agent cluster to serve")
        before = members[0].post("/v1/chat/completions", QUESTION)[1]["choices"][0]["message"]["content"]
        newcomer.start([])
        wait_for(lambda: newcomer.get("/health", timeout_s=2)[0] == 200, timeout_s=60, what="the newcomer to start")
        as_newcomer = {**newcomer.env}  # `ncm join` on the device reads its own admin token

        # Invites that cannot be used are refused, each with its reason, and change nothing.
        status, _ = members[0].post("/cluster/invites", {"ttl_s": 60})
        assert status == 401  # issuing one needs the admin token
        expired = invite(members[0], "--ttl", "1s")
        wait_for(lambda: "no open invites" in ncm("invite", "--list", "--agent", members[0].url, "--token",
                                                   ADMIN["Authorization"].split()[1]).stdout,
                 timeout_s=30, what="the short invite to expire")
        revoked = invite(members[0])
        listed = ncm("invite", "--list", "--agent", members[0].url, "--token", ADMIN["Authorization"].split()[1]).stdout
        ncm("invite", "--revoke", JoinString.decode(revoked).invite_id, "--agent", members[0].url,
            "--token", ADMIN["Authorization"].split()[1])
        assert JoinString.decode(revoked).invite_id in listed
        for text in (expired, revoked, "ncm1.garbage"):
            result = ncm("join", text, "--agent", newcomer.url, env=as_newcomer)
            assert result.returncode != 0
            assert "expired, was revoked or used up" in result.stderr or "damaged" in result.stderr, result.stderr

        good = invite(members[0])
        result = ncm("join", good, "--agent", newcomer.url, env=as_newcomer)
        assert result.returncode == 0, result.stderr
        assert "joined cluster 'test'" in result.stdout

        # The same string again (a single-use invite) is refused by the member.
        join = JoinString.decode(good)
        nonce = secrets.token_hex(8)
        status, body = http("POST", join.url + "/cluster/pair",
                            {"invite": join.invite_id, "nonce": nonce, "proof": pairing_proof(join.secret, join.invite_id, nonce)})
        assert status == 403 and body["error"]["code"] == "invite_refused"

        # The newcomer restarted in place as a member: it holds part of the plan and the cluster answers as before.
        def newcomer_serves():
            status, view = newcomer.get("/cluster/nodes", timeout_s=5)
            worker = view["nodes"][0]["worker"] if status == 200 else {}
            return status == 200 and view["cluster"] == "test" and worker.get("fragments") and view
        view = wait_for(newcomer_serves, timeout_s=300, what="the newcomer to hold fragments of the plan")
        assert sum(1 for node in view["nodes"] if node["alive"]) == 3
        assert newcomer.process.poll() is None  # the same process, never exited
        wait_for(lambda: cluster_ready(newcomer, 3), timeout_s=120, what="the re-plan with the newcomer to settle")
        status, body = newcomer.post("/v1/chat/completions", QUESTION)
        assert status == 200 and body["choices"][0]["message"]["content"] == before, body
        key_file = newcomer.state_dir / "cluster-key"
        assert oct(key_file.stat().st_mode & 0o777) == "0o600"
        assert (newcomer.state_dir / "invites.json").exists() is False
        assert oct((members[0].state_dir / "invites.json").stat().st_mode & 0o777) == "0o600"

        # A freshly flashed device whose setup file held a join string (first boot left it
        # in pending-join) joins by itself once it runs.
        flashed.state_dir.mkdir(parents=True)
        (flashed.state_dir / "pending-join").write_text(invite(members[1]) + "\n")
        flashed.start([])
        wait_for(lambda: cluster_ready(members[0], 4) or cluster_ready(members[1], 4), timeout_s=300,
                 what="the flashed device to join and the cluster to serve on four nodes")
        assert not (flashed.state_dir / "pending-join").exists()
        assert flashed.get("/cluster/nodes")[1]["cluster"] == "test"
    finally:
        shut_down([*members, newcomer, flashed], keep_store=smollm2_store.root)
