"""`POST /cluster/pair` and `/cluster/invites` on an in-process agent: a join string altered on
the way (its cluster name or fingerprint) is refused without using the invite up, so the
right string still works; absurd invite settings are a 400, never a 500."""

from __future__ import annotations

import asyncio
import secrets

from agent.core.invites import JoinString, fingerprint, pairing_proof
from tests.agent.agents import ADMIN
from tests.agent.inprocess import call, local_agents


def pair_body(join: JoinString, **claims: str) -> dict[str, str]:
    nonce = secrets.token_hex(8)
    return {"invite": join.invite_id, "nonce": nonce, "proof": pairing_proof(join.secret, join.invite_id, nonce),
            "cluster": join.cluster, "fingerprint": join.fingerprint, **claims}


def test_an_altered_join_string_does_not_use_up_its_invite(tmp_path):
    async def scenario() -> None:
        async with local_agents(tmp_path, 1) as (agent,):
            status, made = await call("POST", agent.url + "/cluster/invites", {"uses": 1}, headers=ADMIN)
            assert status == 200, made
            join = JoinString.decode(made["join"])
            for altered in ({"cluster": "neighbours"}, {"fingerprint": fingerprint(b"another-cluster-key")}):
                status, answer = await call("POST", agent.url + "/cluster/pair", pair_body(join, **altered))
                assert status == 403 and answer["error"]["code"] == "invite_refused", answer
                assert "still open" in answer["error"]["message"]
            status, answer = await call("POST", agent.url + "/cluster/pair", pair_body(join))
            assert status == 200 and answer["cluster"] == join.cluster and answer["sealed_key"], answer
            status, answer = await call("POST", agent.url + "/cluster/pair", pair_body(join))
            assert status == 403, answer  # a single use: now it is used up

    asyncio.run(scenario())


def test_absurd_invite_settings_are_refused_by_name(tmp_path):
    async def scenario() -> None:
        async with local_agents(tmp_path, 1) as (agent,):
            for body, param in (({"ttl_s": int("9" * 401)}, "ttl_s"), ({"ttl_s": 0}, "ttl_s"), ({"uses": 1000}, "uses"),
                                ({"uses": "two"}, "uses")):
                status, answer = await call("POST", agent.url + "/cluster/invites", body, headers=ADMIN)
                assert status == 400 and answer["error"]["param"] == param, (body, answer)
            status, answer = await call("POST", agent.url + "/cluster/pair", {"invite": "x", "nonce": 1, "proof": "p"})
            assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer

    asyncio.run(scenario())
