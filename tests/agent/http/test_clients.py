"""agent.http.clients on a real aiohttp app listening on 127.0.0.1, on a plain port (the API)
and a TLS port (the peer port, clients with a certificate of the cluster's CA): only the
latter is a member. A client is counted by the hash of its API key when the cluster has
keys (the admin token too; never the key itself), else by its address; the name a member
gives in X-Ncm-Client is believed (cut to 80 characters), the same header from anyone else
is not."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from agent.cluster.tls import issue_node_files
from agent.http.app_keys import ADMIN_TOKEN, CONFIG
from agent.http.clients import CLIENT_HEADER, MAX_CLIENT_CHARS, client_of, from_member
from agent.local.config import AgentConfig
from tests.agent.agents import CLUSTER_KEY, member_tls

KEYS = ("key-of-the-laptop", "key-of-the-phone")
ADMIN = "ncm-admin-0123456789abcdef"
TIMEOUT = aiohttp.ClientTimeout(total=10)


def hashed(key: str) -> str:
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]


@contextlib.asynccontextmanager
async def agent_ports(tmp_path: Path, *, api_keys: tuple[str, ...] = (), api_token: str = "") \
        -> AsyncIterator[tuple[str, str]]:
    """An app that answers who it counts the caller as: its plain and its TLS URL."""
    async def who(request: web.Request) -> web.Response:
        return web.json_response({"client": client_of(request), "member": from_member(request)})

    app = web.Application()
    app[CONFIG] = AgentConfig(cluster_name="test", api_keys=api_keys, api_token=api_token, state_dir=tmp_path)
    app[ADMIN_TOKEN] = ADMIN
    app.router.add_get("/who", who)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    server_tls = issue_node_files(CLUSTER_KEY.encode(), "agent", tmp_path / "agent-tls").server_context()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_tls).start()
    plain, peer = (port for _, port in runner.addresses)
    try:
        yield f"http://127.0.0.1:{plain}", f"https://127.0.0.1:{peer}"
    finally:
        await runner.cleanup()


async def who(url: str, headers: dict[str, str] | None = None, tls: ssl.SSLContext | None = None) -> dict:
    async with aiohttp.ClientSession() as session, session.get(url + "/who", headers=headers, ssl=tls,
                                                               timeout=TIMEOUT) as response:
        assert response.status == 200
        return await response.json()


def test_on_the_api_port_a_client_is_its_address_whatever_it_calls_itself(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with agent_ports(tmp_path) as (api, _):
            assert await who(api) == {"client": "address:127.0.0.1", "member": False}
            posing = await who(api, {CLIENT_HEADER: "address:10.0.0.99"})
            assert posing == {"client": "address:127.0.0.1", "member": False}

    asyncio.run(scenario())


def test_on_the_peer_port_a_member_names_the_client_it_passes_on(tmp_path: Path) -> None:
    async def scenario() -> None:
        tls = member_tls(tmp_path / "member-tls")
        async with agent_ports(tmp_path) as (_, peer):
            assert await who(peer, tls=tls) == {"client": "address:127.0.0.1", "member": True}
            named = await who(peer, {CLIENT_HEADER: "address:192.168.1.20"}, tls=tls)
            assert named == {"client": "address:192.168.1.20", "member": True}
            long = await who(peer, {CLIENT_HEADER: "k" * 500}, tls=tls)
            assert long["client"] == "k" * MAX_CLIENT_CHARS
            empty = await who(peer, {CLIENT_HEADER: ""}, tls=tls)  # names nobody: the caller counts
            assert empty["client"] == "address:127.0.0.1"

    asyncio.run(scenario())


def test_a_client_without_a_certificate_of_the_cluster_never_reaches_the_peer_port(tmp_path: Path) -> None:
    async def scenario() -> None:
        stranger = issue_node_files(b"another-cluster-key-987654321", "stranger", tmp_path / "stranger-tls")
        async with agent_ports(tmp_path) as (_, peer):
            with pytest.raises(aiohttp.ClientError):
                await who(peer, {CLIENT_HEADER: "address:10.0.0.1"}, tls=stranger.client_context())
            no_certificate = ssl.create_default_context()
            no_certificate.check_hostname = False
            no_certificate.verify_mode = ssl.CERT_NONE
            with pytest.raises(aiohttp.ClientError):
                await who(peer, {CLIENT_HEADER: "address:10.0.0.1"}, tls=no_certificate)

    asyncio.run(scenario())


def test_with_api_keys_a_client_is_the_hash_of_its_key(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with agent_ports(tmp_path, api_keys=KEYS, api_token="the-old-api-token") as (api, _):
            laptop = await who(api, {"Authorization": f"Bearer {KEYS[0]}"})
            phone = await who(api, {"Authorization": f"Bearer {KEYS[1]}"})
            assert laptop["client"] == hashed(KEYS[0]) and phone["client"] == hashed(KEYS[1])
            assert laptop["client"] != phone["client"] and KEYS[0] not in laptop["client"]
            assert (await who(api, {"Authorization": "Bearer the-old-api-token"}))["client"] == \
                hashed("the-old-api-token")
            assert (await who(api, {"Authorization": f"Bearer {ADMIN}"}))["client"] == hashed(ADMIN)
            # the scheme in any case, space around the key
            assert (await who(api, {"Authorization": f"bEaReR   {KEYS[0]}  "}))["client"] == hashed(KEYS[0])

    asyncio.run(scenario())


@pytest.mark.parametrize("authorization", [f"Bearer {KEYS[0]}x", "Bearer ", f"Basic {KEYS[0]}", KEYS[0], ""])
def test_a_key_that_is_not_accepted_counts_the_client_by_its_address(tmp_path: Path, authorization: str) -> None:
    async def scenario() -> dict:
        async with agent_ports(tmp_path, api_keys=KEYS) as (api, _):
            return await who(api, {"Authorization": authorization})

    assert asyncio.run(scenario())["client"] == "address:127.0.0.1"


def test_without_api_keys_even_a_bearer_token_counts_by_address(tmp_path: Path) -> None:
    """An open API: the admin token is no client key then (it would let one client pose as another)."""
    async def scenario() -> None:
        async with agent_ports(tmp_path) as (api, _):
            for token in (KEYS[0], ADMIN):
                assert (await who(api, {"Authorization": f"Bearer {token}"}))["client"] == "address:127.0.0.1"

    asyncio.run(scenario())


def test_a_member_naming_the_client_wins_over_the_key_it_carries(tmp_path: Path) -> None:
    async def scenario() -> None:
        tls = member_tls(tmp_path / "member-tls")
        async with agent_ports(tmp_path, api_keys=KEYS) as (_, peer):
            named = await who(peer, {CLIENT_HEADER: hashed(KEYS[1]), "Authorization": f"Bearer {KEYS[0]}"}, tls=tls)
            assert named == {"client": hashed(KEYS[1]), "member": True}
            keyed = await who(peer, {"Authorization": f"Bearer {KEYS[0]}"}, tls=tls)
            assert keyed["client"] == hashed(KEYS[0])

    asyncio.run(scenario())
