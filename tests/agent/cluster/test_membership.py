"""Membership, in-process agents on loopback: a member whose clock is off is refused by the
others (its signed requests are stale), and says so in its own log instead of running on as a
1-node cluster in silence."""

from __future__ import annotations

import asyncio
import logging
import time

from agent.http.app_keys import CLIENT, MEMBERSHIP, METRICS
from tests.agent.inprocess import eventually, local_agents


def test_a_member_whose_clock_is_off_says_so(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="agent.cluster.membership")

    def said(text: str) -> int:
        return sum(text in record.getMessage() for record in caplog.records)

    async def scenario() -> None:
        async with local_agents(tmp_path, 2) as agents:
            late = agents[1]
            await eventually(lambda: len(late.app[MEMBERSHIP].alive_nodes()) == 2, timeout_s=30,
                             what="the two agents to see each other")
            late.app[CLIENT].clock = lambda: time.time() - 600  # ten minutes behind
            await eventually(lambda: len(late.app[MEMBERSHIP].alive_nodes()) == 1, timeout_s=60,
                             what="the late member to be refused by the other")
            await eventually(lambda: said("check this device's clock") == 1, timeout_s=30,
                             what="the late member's own warning")
            def refusals() -> float:  # the other member's count of the describe requests it refused
                return agents[0].app[METRICS].registry.get_sample_value(
                    "ncm_requests_total", {"endpoint": "/internal/describe", "model": "", "status": "401"}) or 0.0
            refused = refusals()
            await eventually(lambda: refusals() >= refused + 3, timeout_s=30,
                             what="three more rounds refused by the other member")
            assert said("check this device's clock") == 1  # once per peer, not once per round
            late.app[CLIENT].clock = time.time
            await eventually(lambda: len(late.app[MEMBERSHIP].alive_nodes()) == 2, timeout_s=60,
                             what="the member back once its clock is right")

    asyncio.run(scenario())
