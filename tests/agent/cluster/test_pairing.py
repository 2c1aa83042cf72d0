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

        def answered():  # a request may meet the end of the re-plan (503 with Retry-After): ask again
            status, body = newcomer.post("/v1/chat/completions", QUESTION)
            return status == 200 and body
        body = wait_for(answered, timeout_s=60, what="an answer through the newcomer", interval_s=1.0)
        assert body["choices"][0]["message"]["content"] == before
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


def test_a_removed_device_is_shut_out_by_a_new_cluster_key(smollm2_store, tmp_path):
    """Three devices paired by invites; `ncm remove` of one hands a new key to the others
    (they restart with it, in place); the removed one's old key opens nothing any more."""
    from agent.cluster.tls import issue_node_files
    from agent.core.auth import admin_token

    template = make_agents(tmp_path / "template", smollm2_store.root, 1, start=False, extra_env=REPLAN)  # its env
    first = fresh_device(tmp_path, template, "first")
    first.env["NCM_HOME"] = str(smollm2_store.root)  # the device that holds the model
    first.home = smollm2_store.root
    others = [fresh_device(tmp_path, [first], name) for name in ("second", "third")]
    devices = [first, *others]
    try:
        first.start([])
        wait_for(lambda: first.get("/health", timeout_s=2)[0] == 200, timeout_s=60, what="the first device to start")
        old_key = (first.state_dir / "cluster-key").read_text().strip().encode()
        token = admin_token(old_key)
        result = ncm("invite", "--uses", "3", "--agent", first.url, "--token", token)  # one use stays open
        assert result.returncode == 0, result.stderr
        join_string = result.stdout.strip()
        for device in others:
            device.state_dir.mkdir(parents=True)
            (device.state_dir / "pending-join").write_text(join_string + "\n")
            device.start([])
        wait_for(lambda: cluster_ready(first, 3), timeout_s=300, what="three paired devices to serve")
        pids = [device.process.pid for device in devices]

        removed = others[1].node_id()
        result = ncm("remove", removed, "--agent", others[0].url, "--token", token)
        assert result.returncode == 0, result.stderr
        assert f"removed {removed}" in result.stdout

        wait_for(lambda: cluster_ready(first, 2), timeout_s=300, what="the two remaining devices to serve together")
        assert [device.process.pid for device in devices] == pids and all(d.process.poll() is None for d in devices)
        wait_for(lambda: others[0].post("/v1/chat/completions", QUESTION)[0] == 200, timeout_s=60, interval_s=1.0,
                 what="an answer from the remaining devices")
        # The old key makes no certificate the members accept, and signs nothing they take.
        old_tls = issue_node_files(old_key, "removed", tmp_path / "old-tls").client_context()
        with pytest.raises(OSError):  # urllib's URLError around the failed TLS handshake
            http("GET", first.peer_url() + "/internal/state", tls=old_tls, timeout_s=10)
        wait_for(lambda: sum(n["alive"] for n in others[1].get("/cluster/nodes")[1]["nodes"]) == 1, timeout_s=60,
                 what="the removed device to be alone")
        assert first.post("/cluster/invites", {}, headers={"Authorization": f"Bearer {token}"})[0] == 401
        # The removed device redeems the invite it joined with, which had a use left: void
        # since the removal, on the member that issued it, and no key is handed out.
        join = JoinString.decode(join_string)
        nonce = secrets.token_hex(8)
        status, body = http("POST", join.url + "/cluster/pair",
                            {"invite": join.invite_id, "nonce": nonce, "proof": pairing_proof(join.secret, join.invite_id, nonce)})
        assert status == 403 and body["error"]["code"] == "invite_refused", body
        assert "sealed_key" not in body
        new_token = admin_token((first.state_dir / "joined.toml").read_text().split('cluster_key = "')[1].split('"')[0].encode())
        assert first.get("/cluster/invites", headers={"Authorization": f"Bearer {new_token}"}) == (200, {"data": []})
    finally:
        shut_down(devices, keep_store=smollm2_store.root)
