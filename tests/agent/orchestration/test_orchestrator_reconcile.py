"""Reconciliation, in-process agents serving the tiny model: a node that missed an unload (it
was frozen or away) keeps the model's fragments until the orchestrator, comparing what
nodes report with its deployments, tells it again."""

from __future__ import annotations

import asyncio

from agent.http.app_keys import ROUTER, WORKER
from agent.orchestration import orchestrator as orchestrator_module
from tests.agent.inprocess import eventually
from tests.agent.tiny import TINY, tiny_cluster


def test_a_node_that_missed_an_unload_drops_the_model_when_the_orchestrator_looks_again(tmp_path, monkeypatch):
    monkeypatch.setattr(orchestrator_module, "RECONCILE_INTERVAL_S", 1.0)

    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2) as (leader, others):
            away = others[0].app[WORKER]
            await eventually(lambda: TINY in away.serving, timeout_s=30, what="the other node serving its part")
            unload = away.unload

            async def missed(name: str, epoch: int) -> dict:
                away.unload = unload  # the next one reaches it
                raise ConnectionResetError("the node was frozen")

            away.unload = missed
            await leader.app[ROUTER].unload(TINY)
            assert leader.app[ROUTER].registry.entries[TINY].state == "unloaded"
            assert TINY in away.serving and away.fragments.runners  # it kept them
            await eventually(lambda: TINY not in away.serving, timeout_s=30,
                             what="the orchestrator to drop the orphaned order on that node")
            await eventually(lambda: not away.fragments.runners, timeout_s=30, what="its fragments freed")
            assert TINY not in leader.app[WORKER].serving

    asyncio.run(scenario())
