"""Whole copies of the fallback model (:mod:`agent.stage.whole_copies`): a node asked to hold
every file of a model fetches it in the background, from an in-process agent on loopback, into
a model store in tmp_path:

- a queued copy is fetched whole, one at a time; a model held whole already, or being copied,
  is not queued again;
- a copy that fails is logged and the next one goes on;
- without room for the copy and its margin only the manifest is fetched, and the node is not
  asked again until its disk has more room than when it declined (the disk's free bytes are
  pinned there: :func:`agent.stage.whole_copies._free_bytes` reads them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from agent.stage import whole_copies
from agent.stage.weights import Source, complete_models
from agent.stage.whole_copies import COPY_MARGIN_BYTES, WholeCopies
from shards.store.model_store import ModelStore
from shards.store.verify import hash_file
from tests.agent.inprocess import eventually
from tests.agent.stage.test_weights import TINY, peers


@contextlib.asynccontextmanager
async def fetching(copies: WholeCopies) -> AsyncIterator[None]:
    """:meth:`WholeCopies.fetch_copies` running, as the service's cleanup context owns it."""
    task = asyncio.create_task(copies.fetch_copies())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert copies.copying is None


@contextlib.asynccontextmanager
async def silent_peer() -> AsyncIterator[Source]:
    """A node that accepts connections and never answers (frozen): a fetch from it waits."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        yield "node-frozen", f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


def whole(store: ModelStore) -> bool:
    if TINY not in complete_models(store):
        return False
    model_dir = store.models_dir / TINY
    return all(hash_file(model_dir / f.path).hexdigest() == f.sha256 for f in store.manifest(TINY).files.values())


def test_a_queued_copy_is_fetched_whole_in_the_background_and_not_queued_again(tmp_path):
    async def scenario() -> None:
        async with peers(tmp_path) as (sources, client):
            store = ModelStore(tmp_path / "node")
            copies = WholeCopies(store, client)
            assert copies.keep_whole_copy(TINY, sources)
            async with fetching(copies):
                await eventually(lambda: whole(store), timeout_s=20, what="the whole copy fetched")
                await eventually(lambda: copies.copying is None, timeout_s=5, what="the copy to end")
            assert store.manifest(TINY) == ModelStore(tmp_path / "home-0").manifest(TINY)
            assert not list((store.models_dir / TINY).rglob("*.part"))
            assert not copies.keep_whole_copy(TINY, sources)  # held whole now

    asyncio.run(scenario())


def test_a_model_held_whole_is_not_queued_and_one_held_in_part_is(tmp_path):
    async def scenario() -> None:
        async with peers(tmp_path, 2, holding=(0,)) as (sources, client):
            holder = WholeCopies(ModelStore(tmp_path / "home-0"), client)
            assert not holder.keep_whole_copy(TINY, sources)

            store = ModelStore(tmp_path / "node")
            copies = WholeCopies(store, client)
            (store.models_dir / TINY).mkdir(parents=True)
            for name in ("manifest.json", "tokenizer.json", "weights"):  # a node holding some layers
                source = tmp_path / "home-0" / "models" / TINY / name
                target = store.models_dir / TINY / name
                if source.is_dir():
                    target.mkdir()
                    (target / "layer_001.safetensors").write_bytes((source / "layer_001.safetensors").read_bytes())
                else:
                    target.write_bytes(source.read_bytes())
            assert complete_models(store) == {}
            assert copies.keep_whole_copy(TINY, sources)
            async with fetching(copies):
                await eventually(lambda: whole(store), timeout_s=20, what="the missing files fetched")

    asyncio.run(scenario())


def test_a_model_being_copied_is_not_queued_twice(tmp_path):
    async def scenario() -> None:
        async with peers(tmp_path) as (_, client), silent_peer() as frozen:
            copies = WholeCopies(ModelStore(tmp_path / "node"), client)
            assert copies.keep_whole_copy(TINY, [frozen])
            async with fetching(copies):
                await eventually(lambda: copies.copying == TINY, timeout_s=10, what="the copy to start")
                assert not copies.keep_whole_copy(TINY, [frozen])

    asyncio.run(scenario())


def test_a_copy_that_fails_is_logged_and_the_next_goes_on(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="agent.stage.whole_copies")

    async def scenario() -> None:
        async with peers(tmp_path) as (sources, client):
            store = ModelStore(tmp_path / "node")
            copies = WholeCopies(store, client)
            assert copies.keep_whole_copy("ghost", sources)  # no source holds it
            assert copies.keep_whole_copy(TINY, [])  # no source at all
            assert copies.keep_whole_copy(TINY, sources)
            async with fetching(copies):
                await eventually(lambda: whole(store), timeout_s=20, what="the copy after two failed ones")
            failures = [r.getMessage() for r in caplog.records if "could not keep a whole copy" in r.getMessage()]
            assert len(failures) == 2, failures
            assert "ghost" in failures[0] and "HTTP 404" in failures[0]
            assert "no source known" in failures[1]
            assert not (store.models_dir / "ghost").exists()
            assert copies.keep_whole_copy("ghost", sources)  # it failed, it was not declined: it may be asked again

    asyncio.run(scenario())


def test_without_room_only_the_manifest_is_fetched_and_the_node_is_asked_again_once_it_has_more(
        tmp_path, monkeypatch):
    free = [0]
    monkeypatch.setattr(whole_copies, "_free_bytes", lambda path: free[0])

    async def scenario() -> None:
        async with peers(tmp_path) as (sources, client):
            weights = sum(f.bytes for f in ModelStore(tmp_path / "home-0").manifest(TINY).files.values())
            store = ModelStore(tmp_path / "node")
            copies = WholeCopies(store, client)
            free[0] = weights + COPY_MARGIN_BYTES - 1  # one byte short of the copy and its margin
            assert copies.keep_whole_copy(TINY, sources)
            async with fetching(copies):
                await eventually(lambda: store.has(TINY) and copies.copying is None, timeout_s=20,
                                 what="the manifest fetched and the copy declined")
                assert not list((store.models_dir / TINY / "weights").glob("*"))  # no weight file
                assert complete_models(store) == {}
                assert not copies.keep_whole_copy(TINY, sources)  # no more room than when it declined
                free[0] -= 1 << 20
                assert not copies.keep_whole_copy(TINY, sources)

                free[0] = weights + COPY_MARGIN_BYTES  # room was made
                assert copies.keep_whole_copy(TINY, sources)
                await eventually(lambda: whole(store), timeout_s=20, what="the whole copy, now that it fits")

    asyncio.run(scenario())
