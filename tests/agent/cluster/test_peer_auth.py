"""Nothing unauthenticated steers the cluster: in-process agents and a keyless impostor that
claims to be a newer orchestrator."""

from __future__ import annotations

import asyncio
import secrets
import ssl
import time

import aiohttp
import pytest

from agent.cluster.tls import issue_node_files
from agent.core.auth import HEADER_NODE, HEADER_SIGNATURE, sign
from agent.core.protocol import DESCRIBE_PATH
from agent.http.app_keys import MEMBERSHIP
from tests.agent.agents import ADMIN, CLUSTER_KEY, free_ports, member_tls
from tests.agent.impostor import NODE_ID as IMPOSTOR_ID
from tests.agent.impostor import SEEN_PATH, start_impostor
from tests.agent.inprocess import FAST, call, eventually, local_agents, start_app

ROUNDS_WATCHED = 10


def elections(agents):
    return {agent.node_id: agent.app[MEMBERSHIP].election for agent in agents}


async def agree(agents):
    seen = set(elections(agents).values())
    return len(seen) == 1 and None not in seen and all(
        len(agent.app[MEMBERSHIP].alive_nodes()) == len(agents) for agent in agents)


async def rounds_pass(agent, peer, count):
    """Wait until ``agent`` has contacted its real ``peer`` ``count`` more times."""
    entry = agent.app[MEMBERSHIP].table.entries[peer.url]
    target = (entry.last_contact or 0.0) + count * FAST["health_interval_s"]
    await eventually(lambda: (entry.last_contact or 0.0) >= target, timeout_s=30,
                     what=f"{count} more membership rounds")


def test_a_keyless_server_joined_by_an_unauthenticated_request_changes_nothing(tmp_path):
    async def scenario():
        async with local_agents(tmp_path, 3) as agents:
            await eventually(lambda: agree(agents), timeout_s=20, what="three agents to agree on an orchestrator")
            before = elections(agents)
            impostor_port, impostor_peer_port = free_ports(2)
            impostor = await start_impostor("test", "127.0.0.1", impostor_port, impostor_peer_port)
            impostor_url = f"http://127.0.0.1:{impostor_port}"
            try:
                # The request that took the cluster over, with no credential: refused now.
                status, body = await call("POST", agents[0].url + "/cluster/join", {"url": impostor_url})
                assert status == 401 and body["error"]["code"] == "admin_token_required"
                # Joined by an admin fooled into it: the stranger still proves nothing.
                status, _ = await call("POST", agents[0].url + "/cluster/join", {"url": impostor_url},
                                       headers=ADMIN)
                assert status == 200
                membership = agents[0].app[MEMBERSHIP]
                await eventually(lambda: impostor_url in membership.table.rejected, timeout_s=10,
                                 what="the impostor to be rejected")
                await rounds_pass(agents[0], agents[1], ROUNDS_WATCHED)
                assert elections(agents) == before
                for agent in agents:
                    view = agent.app[MEMBERSHIP]
                    assert IMPOSTOR_ID not in view.alive_nodes()
                    assert impostor_url not in view.table.entries
                _, nodes = await call("GET", agents[0].url + "/cluster/nodes")
                assert IMPOSTOR_ID not in [n["id"] for n in nodes["nodes"]]
                assert [r["url"] for r in nodes["rejected"]] == [impostor_url]
                assert "no TLS certificate of this cluster" in nodes["rejected"][0]["reason"]
                # The public health check of the node that was told to join, a TLS handshake
                # that fails on its certificate, then silence: no signed request, no prompt,
                # and the other nodes never heard of it.
                _, seen = await call("GET", impostor_url + SEEN_PATH)
                assert [(s["method"], s["path"]) for s in seen] == [("GET", "/health")]
                # Told again, or told elsewhere by gossip: still nothing.
                await call("POST", agents[0].url + "/cluster/join", {"url": impostor_url}, headers=ADMIN)
                await rounds_pass(agents[0], agents[1], 3)
                _, seen = await call("GET", impostor_url + SEEN_PATH)
                assert len(seen) == 1
            finally:
                await impostor.cleanup()

    asyncio.run(scenario())


def test_signed_requests_bind_the_target_node_and_the_whole_url(tmp_path):
    async def scenario():
        async with local_agents(tmp_path, 2) as agents:
            await eventually(lambda: agree(agents), timeout_s=20, what="two agents to agree")
            key, tls = CLUSTER_KEY.encode(), member_tls(tmp_path / "tester-tls")

            def signed(path, target, body=b""):
                return sign(key, "GET", path, body, now=time.time(), nonce=secrets.token_hex(12), node_id="tester",
                            target=target)

            headers = signed("/internal/state", agents[0].node_id)
            status, answer = await call("GET", agents[0].peer_url + "/internal/state", headers=headers, tls=tls)
            assert status == 200, answer
            # The same request, captured and replayed to another node, is refused there.
            status, body = await call("GET", agents[1].peer_url + "/internal/state", headers=headers, tls=tls)
            assert status == 401 and "addressed to node" in body["error"]["message"]
            # A query string added to a signed URL breaks the signature.
            headers = signed("/internal/state", agents[0].node_id)
            status, body = await call("GET", agents[0].peer_url + "/internal/state?x=1", headers=headers, tls=tls)
            assert status == 401 and "bad signature" in body["error"]["message"]
            # Only describe may be addressed to any node (a first contact), and its answer is signed.
            status, _ = await call("GET", agents[0].peer_url + "/internal/state", headers=signed("/internal/state", "*"),
                                   tls=tls)
            assert status == 401

    asyncio.run(scenario())


def test_internal_endpoints_answer_only_over_tls_with_a_certificate_of_the_cluster(tmp_path):
    async def scenario():
        async with local_agents(tmp_path, 1) as (agent,):
            headers = sign(CLUSTER_KEY.encode(), "GET", "/internal/state", b"", now=time.time(),
                           nonce=secrets.token_hex(12), node_id="tester", target=agent.node_id)
            # On the public port, even correctly signed: refused.
            status, body = await call("GET", agent.url + "/internal/state", headers=headers)
            assert status == 403 and body["error"]["code"] == "peer_port_only"
            # On the peer port without a client certificate, or with one of another cluster: no TLS session.
            stranger = issue_node_files(b"some-other-cluster-key", "stranger", tmp_path / "stranger").client_context()
            no_certificate = ssl.create_default_context()
            no_certificate.check_hostname, no_certificate.verify_mode = False, ssl.CERT_NONE
            for context in (no_certificate, stranger):
                with pytest.raises((aiohttp.ClientError, ssl.SSLError, ConnectionError)):
                    await call("GET", agent.peer_url + "/internal/state", headers=headers, tls=context)
            status, _ = await call("GET", agent.peer_url + "/internal/state", headers=headers,
                                   tls=member_tls(tmp_path / "tester-tls"))
            assert status == 200

    asyncio.run(scenario())


@pytest.mark.parametrize("forged", [{}, {HEADER_NODE: "node-1", HEADER_SIGNATURE: "0" * 64}])
def test_answers_without_the_key_are_not_believed(tmp_path, forged):
    """The peer client refuses an answer that is not signed for its request, whatever it says."""
    from aiohttp import web

    from agent.cluster.peer_client import PeerAuthError

    async def scenario():
        async def describe(request):
            return web.json_response({"advert": {}}, headers=forged)

        app = web.Application()
        app.router.add_post(DESCRIBE_PATH, describe)
        port = free_ports(1)[0]
        runner = await start_app(app, port)
        try:
            async with local_agents(tmp_path, 1) as (agent,):
                client = agent.app[MEMBERSHIP].client
                with pytest.raises(PeerAuthError, match="cluster's key"):
                    await client.request_json("POST", f"http://127.0.0.1:{port}", DESCRIBE_PATH, {}, target="*",
                                              timeout_s=5)
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
