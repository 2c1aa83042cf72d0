"""Access to the public API: the admin token for what changes the cluster, API keys for the
rest when configured, and neither secret echoed anywhere. In-process agents, no model."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from agent.core.auth import admin_token
from agent.http.app_keys import MEMBERSHIP
from tests.agent.agents import ADMIN, CLUSTER_KEY
from tests.agent.inprocess import call, eventually, local_agents

API_KEY = "app-key-0123456789"
ADMIN_CALLS = [("POST", "/cluster/join", {"url": "http://127.0.0.1:9"}), ("POST", "/models/load", {"model": "x"}),
               ("POST", "/models/unload", {"model": "x"}), ("GET", "/models?reload=1", None)]


def bearer(token):
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize("method, path, body", ADMIN_CALLS)
def test_what_changes_the_cluster_needs_the_admin_token(tmp_path, method, path, body):
    async def scenario():
        async with local_agents(tmp_path, 2, api_keys=(API_KEY,)) as agents:
            for agent in agents:
                for headers in (None, bearer(API_KEY), bearer("ncm-admin-guess")):
                    status, answer = await call(method, agent.url + path, body, headers=headers)
                    assert status == 401, answer
                    assert answer["error"]["code"] == "admin_token_required"
                    assert set(answer["error"]) == {"message", "type", "param", "code"}
            # With the token, the request reaches its handler (here on the orchestrator too).
            status, answer = await call(method, agents[1].url + path, body, headers=ADMIN)
            assert status != 401, answer

    asyncio.run(scenario())


def test_api_keys_guard_inference_and_health_stays_open(tmp_path):
    async def scenario():
        async with local_agents(tmp_path, 1, api_keys=(API_KEY,)) as (agent,):
            chat = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
            status, answer = await call("POST", agent.url + "/v1/chat/completions", chat)
            assert status == 401 and answer["error"]["code"] == "invalid_api_key"
            assert answer["error"]["type"] == "authentication_error"
            status, answer = await call("POST", agent.url + "/v1/chat/completions", chat, headers=bearer("wrong-key-1"))
            assert status == 401
            for headers in (bearer(API_KEY), ADMIN):
                status, answer = await call("GET", agent.url + "/cluster/nodes", headers=headers)
                assert status == 200, answer
            assert (await call("GET", agent.url + "/health"))[0] == 200

    asyncio.run(scenario())


def test_without_api_keys_inference_is_open_but_admin_calls_are_not(tmp_path):
    async def scenario():
        async with local_agents(tmp_path, 1) as (agent,):
            assert (await call("GET", agent.url + "/cluster/nodes"))[0] == 200
            assert (await call("GET", agent.url + "/models"))[0] != 401
            assert (await call("GET", agent.url + "/models?reload=1"))[0] == 401

    asyncio.run(scenario())


def test_no_secret_appears_in_answers_or_logs(tmp_path, caplog):
    secrets = (CLUSTER_KEY, admin_token(CLUSTER_KEY.encode()), API_KEY)

    async def scenario():
        async with local_agents(tmp_path, 2, api_keys=(API_KEY,)) as agents:
            await eventually(lambda: all(len(a.app[MEMBERSHIP].alive_nodes()) == 2 for a in agents),
                             timeout_s=20, what="two agents to see each other")
            texts = []
            for agent in agents:
                for path in ("/health", "/cluster/nodes", "/cluster/status", "/models", "/v1/models"):
                    texts.append(json.dumps(await call("GET", agent.url + path, headers=bearer(API_KEY))))
                for method, path, body in ADMIN_CALLS:
                    texts.append(json.dumps(await call(method, agent.url + path, body, headers=bearer(API_KEY))))
                texts.append(json.dumps(await call("POST", agent.url + "/internal/describe", {})))
            return texts

    with caplog.at_level(logging.DEBUG):
        texts = asyncio.run(scenario())
    texts.append(caplog.text)
    for text in texts:
        for secret in secrets:
            assert secret not in text
