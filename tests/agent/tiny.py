"""A tiny random Llama (hidden 64, a word-level tokenizer) written and imported like any
Hugging Face checkpoint, and a cluster of in-process agents serving it: it loads and answers in
well under a second, so the API, router and admission tests run on the real path in seconds.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from agent.http.app_keys import MEMBERSHIP, ROUTER
from shards.importers.importer import import_model
from shards.store.model_store import ModelStore
from tests.agent.inprocess import LocalAgent, eventually, local_agents
from tests.shards.fragment_helpers import write_tiny_checkpoint

TINY = "tiny"


def store_tiny_models(tmp: Path, names: tuple[str, ...] = (TINY,), *, layers: int = 2,
                      chat_template: str | None = None) -> ModelStore:
    """The store of the first in-process agent, holding the tiny model under every name
    (``chat_template``: a real one, with a byte-level tokenizer that spells any text)."""
    source = write_tiny_checkpoint(tmp / "checkpoint", layers=layers, chat_template=chat_template)
    store = ModelStore(tmp / "home-0")
    for name in names:
        import_model(source, name=name, store=store, progress=False)
    return store


@contextlib.asynccontextmanager
async def tiny_cluster(tmp: Path, count: int = 2, *, names: tuple[str, ...] = (TINY,), layers: int = 2,
                       election_timeout_s: float = 20, chat_template: str | None = None, **settings: Any
                       ) -> AsyncIterator[tuple[LocalAgent, list[LocalAgent]]]:
    """``count`` in-process agents, the first storing the tiny models; yields the orchestrator
    (once the main model is ready) and the others. An agent's first round, and so the election,
    waits for its backends' self-tests: ``election_timeout_s`` covers those of its providers."""
    store_tiny_models(tmp, names, layers=layers, chat_template=chat_template)
    async with local_agents(tmp, count, model=TINY, **settings) as agents:
        await eventually(lambda: all(a.app[MEMBERSHIP].election for a in agents), timeout_s=election_timeout_s,
                         what="an election")
        leader = agents[0].app[MEMBERSHIP].election.orchestrator
        orchestrator = next(a for a in agents if a.node_id == leader)
        router = orchestrator.app[ROUTER]
        await eventually(lambda: TINY in router.registry.entries and router.registry.entries[TINY].state == "ready",
                         timeout_s=60, what="the tiny model loaded at start")
        yield orchestrator, [a for a in agents if a is not orchestrator]
