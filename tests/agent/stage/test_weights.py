"""Weight distribution (:mod:`agent.stage.weights`): files fetched from in-process agents on
loopback (their real `GET /internal/models/...` endpoints, signed and over TLS) into a model
store in tmp_path, as a worker fetches them:

- a worker fetches exactly the files of its layers, after the manifest and the tokenizer, each
  checked against the manifest; what is already here is not fetched again;
- a source that does not answer, lacks the model or lacks a file is skipped for the next; with
  none left the error names the model and what each source said;
- a source never offers a file it finds corrupt, and bytes that do not match the manifest are
  refused by the fetcher, nothing of them kept;
- a broken transfer resumes from its ``.part`` file (HTTP Range); one longer than the file starts over;
- a store this node cannot write into is this node's fault (StoreWriteError), not a peer's;
- a file is served only from inside its model's directory;
- an embedding model is fetched whole, or not at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.cluster.peer_client import PeerClient
from agent.core.protocol import ModelListing
from agent.stage.weights import (
    META_FILES,
    Source,
    StoreWriteError,
    WeightTransferError,
    complete_models,
    describe_model_files,
    ensure_encoder_files,
    ensure_model_files,
    file_digest,
    missing_files,
    resolve_model_file,
)
from shards.importers.encoder import import_encoder
from shards.importers.importer import import_model
from shards.store.manifest import Manifest
from shards.store.model_store import ModelStore
from shards.store.verify import hash_file, intact
from tests.agent.agents import CLUSTER_KEY, free_ports, member_tls
from tests.agent.inprocess import local_agents
from tests.shards.fragment_helpers import write_tiny_checkpoint

TINY = "tiny"
LAYER_1 = "weights/layer_001.safetensors"


@contextlib.asynccontextmanager
async def peers(tmp: Path, count: int = 1, *, holding: Sequence[int] = (0,)) -> AsyncIterator[
        tuple[list[Source], PeerClient]]:
    """``count`` in-process agents, those of ``holding`` storing the tiny model (``home-<i>``
    under ``tmp``), and a client that signs as a member of their cluster: (the agents as weight
    sources, the client)."""
    checkpoint = write_tiny_checkpoint(tmp / "checkpoint")
    for index in holding:
        import_model(checkpoint, name=TINY, store=ModelStore(tmp / f"home-{index}"), progress=False)
    # no fallback: no agent fetches a whole copy of the tiny model by itself meanwhile
    async with local_agents(tmp, count, allow_fallback=False) as agents, aiohttp.ClientSession() as session:
        client = PeerClient(session, CLUSTER_KEY.encode(), "tester", member_tls(tmp / "tester-tls"))
        yield [(agent.node_id, agent.peer_url) for agent in agents], client


def source_manifest(tmp: Path, index: int = 0) -> Manifest:
    return ModelStore(tmp / f"home-{index}").manifest(TINY)


def files_in(model_dir: Path) -> set[str]:
    return {str(p.relative_to(model_dir)) for p in model_dir.rglob("*") if p.is_file() and p.name != ".verified.json"}


def flip_a_byte(path: Path, *, keep_mtime: bool) -> None:
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    if keep_mtime:  # what a failing card does: the size and the time say nothing changed
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def intact_files(store: ModelStore, manifest: Manifest, keys: Sequence[str]) -> bool:
    model_dir = store.models_dir / TINY
    return all(hash_file(model_dir / manifest.files[k].path).hexdigest() == manifest.files[k].sha256 for k in keys)


def test_a_worker_fetches_exactly_the_files_of_its_layers_after_the_manifest_and_tokenizer(tmp_path):
    async def scenario() -> None:
        async with peers(tmp_path) as (sources, client):
            expected = source_manifest(tmp_path)
            store = ModelStore(tmp_path / "worker")
            model_dir = store.models_dir / TINY
            manifest = await asyncio.wait_for(
                ensure_model_files(client, store, TINY, lambda m: m.fragment_files(1, 1), sources), timeout=30)
            assert manifest == expected and store.manifest(TINY) == expected
            # the tail's layer and the head (the output layer): no embedding, no other layer
            assert files_in(model_dir) == {"manifest.json", *META_FILES, LAYER_1, "weights/head.safetensors"}
            assert intact_files(store, manifest, ["layer.1", "head"])
            for name in META_FILES:
                assert file_digest(model_dir / name) == file_digest(tmp_path / "home-0" / "models" / TINY / name)
            assert complete_models(store) == {}  # it holds some layers only: nothing to share whole

            await asyncio.wait_for(
                ensure_model_files(client, store, TINY, lambda m: m.fragment_files(0, 0), sources), timeout=30)
            assert complete_models(store) == {TINY: sum(f.bytes for f in expected.files.values())}
            assert intact_files(store, expected, list(expected.files))
            # everything is here: no source is asked (there is none)
            assert await asyncio.wait_for(
                ensure_model_files(client, store, TINY, lambda m: list(m.files), []), timeout=30) == expected

    asyncio.run(scenario())


def test_fetches_of_one_model_at_once_take_turns_and_all_end_intact(tmp_path):
    async def scenario() -> None:
        async with peers(tmp_path) as (sources, client):
            store = ModelStore(tmp_path / "worker")
            wanted = [lambda m: list(m.files), lambda m: m.fragment_files(0, 1), lambda m: m.fragment_files(1, 1)]
            manifests = await asyncio.wait_for(asyncio.gather(
                *(ensure_model_files(client, store, TINY, keys, sources) for keys in wanted)), timeout=30)
            expected = source_manifest(tmp_path)
            assert manifests == [expected] * 3
            assert intact_files(store, expected, list(expected.files))
            assert not list((store.models_dir / TINY).rglob("*.part"))

    asyncio.run(scenario())


def test_sources_that_do_not_answer_or_lack_the_model_or_a_file_are_skipped_for_the_next(tmp_path):
    async def scenario() -> None:
        # node-0 lost a layer file; node-1 stores nothing; node-2 holds the model whole
        async with peers(tmp_path, 3, holding=(0, 2)) as (sources, client):
            (tmp_path / "home-0" / "models" / TINY / "weights" / "layer_000.safetensors").unlink()
            (dead_port,) = free_ports(1)
            dead: Source = ("node-9", f"https://127.0.0.1:{dead_port}")
            store = ModelStore(tmp_path / "worker")
            manifest = await asyncio.wait_for(ensure_model_files(
                client, store, TINY, lambda m: list(m.files), [dead, sources[1], sources[0], sources[2]]), timeout=30)
            assert complete_models(store) == complete_models(ModelStore(tmp_path / "home-2"))
            assert intact_files(store, manifest, list(manifest.files))

    asyncio.run(scenario())


def test_with_no_source_left_the_error_names_the_model_and_what_each_source_said(tmp_path):
    async def scenario() -> None:
        async with peers(tmp_path, 2, holding=()) as (sources, client):
            store = ModelStore(tmp_path / "worker")
            with pytest.raises(WeightTransferError) as nobody:
                await asyncio.wait_for(ensure_model_files(client, store, TINY, lambda m: list(m.files), []), timeout=30)
            assert str(nobody.value) == "no peer could provide model 'tiny': no source known"
            with pytest.raises(WeightTransferError) as none_has_it:
                await asyncio.wait_for(ensure_model_files(client, store, TINY, lambda m: list(m.files), sources),
                                       timeout=30)
            message = str(none_has_it.value)
            assert message.startswith("no peer could provide model 'tiny': ")
            assert all(url in message for _, url in sources) and message.count("HTTP 404") == 2, message
            assert not store.has(TINY) and not (store.models_dir / TINY).exists()

    asyncio.run(scenario())


def test_a_source_never_offers_a_file_it_finds_corrupt(tmp_path):
    async def scenario() -> None:
        async with peers(tmp_path) as (sources, client):
            flip_a_byte(tmp_path / "home-0" / "models" / TINY / LAYER_1, keep_mtime=False)  # hashed again there
            store = ModelStore(tmp_path / "worker")
            with pytest.raises(WeightTransferError) as refused:
                await asyncio.wait_for(
                    ensure_model_files(client, store, TINY, lambda m: m.fragment_files(1, 1), sources), timeout=30)
            assert f"no peer could provide {LAYER_1} of model 'tiny'" in str(refused.value)
            assert "HTTP 404" in str(refused.value)
            assert not (store.models_dir / TINY / LAYER_1).exists()

    asyncio.run(scenario())


def test_bytes_that_do_not_match_the_manifest_are_refused_and_a_good_source_is_used_instead(tmp_path):
    async def scenario() -> None:
        async with peers(tmp_path, 2, holding=(0, 1)) as (sources, client):
            source_dir = tmp_path / "home-0" / "models" / TINY
            manifest = source_manifest(tmp_path)
            assert intact(source_dir, manifest.files["layer.1"])  # the source's check is kept by size and time
            flip_a_byte(source_dir / LAYER_1, keep_mtime=True)  # so node-0 serves the bad bytes unknowingly

            store = ModelStore(tmp_path / "worker")
            with pytest.raises(WeightTransferError) as corrupt:
                await asyncio.wait_for(
                    ensure_model_files(client, store, TINY, lambda m: m.fragment_files(1, 1), sources[:1]), timeout=30)
            assert "is corrupt (size or sha256 mismatch)" in str(corrupt.value)
            model_dir = store.models_dir / TINY
            assert not (model_dir / LAYER_1).exists() and not list(model_dir.rglob("*.part"))  # nothing of it kept

            await asyncio.wait_for(
                ensure_model_files(client, store, TINY, lambda m: m.fragment_files(1, 1), sources), timeout=30)
            assert intact_files(store, manifest, ["layer.1", "head"])  # from node-1

    asyncio.run(scenario())


def test_a_broken_transfer_resumes_from_its_part_file(tmp_path):
    async def scenario() -> None:
        async with peers(tmp_path) as (sources, client):
            manifest = source_manifest(tmp_path)
            real = (tmp_path / "home-0" / "models" / TINY / LAYER_1).read_bytes()
            store = ModelStore(tmp_path / "worker")
            part = store.models_dir / TINY / (LAYER_1 + ".part")
            part.parent.mkdir(parents=True)

            def fetch():
                return asyncio.wait_for(
                    ensure_model_files(client, store, TINY, lambda m: ["layer.1"], sources), timeout=30)

            # only the rest is asked for: bytes already there that are not the file's stay wrong ...
            part.write_bytes(bytes(len(real) // 2))
            with pytest.raises(WeightTransferError, match="corrupt"):
                await fetch()
            assert not part.exists()  # ... and are dropped with the result, so the next try starts over

            part.write_bytes(real[:len(real) // 3])  # what a broken transfer left
            await fetch()
            assert not part.exists() and intact_files(store, manifest, ["layer.1"])

            (store.models_dir / TINY / LAYER_1).unlink()
            part.write_bytes(real + b"more than the file has")
            await fetch()
            assert intact_files(store, manifest, ["layer.1"])

    asyncio.run(scenario())


def test_a_store_this_node_cannot_write_into_is_its_own_fault_not_a_peers(tmp_path):
    async def scenario() -> None:
        async with peers(tmp_path, 2, holding=(0, 1)) as (sources, client):
            store = ModelStore(tmp_path / "worker")
            blocked = store.models_dir / TINY / "weights"
            blocked.parent.mkdir(parents=True)
            blocked.write_text("a file where the weights' folder goes")
            with pytest.raises(StoreWriteError) as failed:
                await asyncio.wait_for(
                    ensure_model_files(client, store, TINY, lambda m: ["layer.0"], sources), timeout=30)
            assert failed.value.errno_code == errno.EEXIST
            assert "cannot write layer_000.safetensors into the model store" in str(failed.value)
            assert blocked.read_text() == "a file where the weights' folder goes"

    asyncio.run(scenario())


def test_missing_files_are_those_absent_or_of_the_wrong_size_and_only_whole_models_are_complete(tmp_path):
    checkpoint = write_tiny_checkpoint(tmp_path / "checkpoint")
    store = ModelStore(tmp_path / "home")
    for name in (TINY, "other"):
        import_model(checkpoint, name=name, store=store, progress=False)
    manifest = store.manifest(TINY)
    model_dir = store.models_dir / TINY
    assert missing_files(model_dir, manifest, list(manifest.files)) == []
    total = sum(f.bytes for f in manifest.files.values())
    assert complete_models(store) == {TINY: total, "other": total}

    (model_dir / manifest.files["layer.0"].path).unlink()
    with (model_dir / manifest.files["head"].path).open("ab") as handle:
        handle.write(b"x")
    flip_a_byte(model_dir / manifest.files["embed"].path, keep_mtime=False)  # the right size: not missing
    assert missing_files(model_dir, manifest, list(manifest.files)) == ["head", "layer.0"]
    assert missing_files(model_dir, manifest, ["layer.1", "embed"]) == []
    assert complete_models(store) == {"other": total}


def test_a_source_describes_the_manifest_and_its_tokenizer_files(tmp_path):
    checkpoint = write_tiny_checkpoint(tmp_path / "checkpoint")
    store = ModelStore(tmp_path / "home")
    import_model(checkpoint, name=TINY, store=store, progress=False)
    model_dir = store.models_dir / TINY
    described = describe_model_files(model_dir)
    assert described.kind == "manifest" and Manifest.from_dict(described.document) == store.manifest(TINY)
    assert described.meta_files == {name: ((model_dir / name).stat().st_size, hash_file(model_dir / name).hexdigest())
                                    for name in META_FILES}
    assert ModelListing.from_json(json.loads(json.dumps(described.to_json())), "manifest") == described
    (model_dir / "tokenizer_config.json").unlink()
    assert set(describe_model_files(model_dir).meta_files) == {"tokenizer.json"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A stored tiny model, a sibling model and a file outside the store."""
    tmp = tmp_path_factory.mktemp("served")
    checkpoint = write_tiny_checkpoint(tmp / "checkpoint")
    store = ModelStore(tmp / "home")
    for name in (TINY, "sibling"):
        import_model(checkpoint, name=name, store=store, progress=False)
    (tmp / "secret.txt").write_text("not a model file")
    (store.models_dir / TINY / "escape").symlink_to(tmp / "secret.txt")
    return store.models_dir / TINY


def test_a_file_is_served_only_from_inside_its_model_directory(model_dir):
    assert resolve_model_file(model_dir, LAYER_1) == (model_dir / LAYER_1).resolve()
    assert resolve_model_file(model_dir, "weights/../manifest.json") == (model_dir / "manifest.json").resolve()
    assert resolve_model_file(model_dir, str(model_dir / "manifest.json")) == (model_dir / "manifest.json").resolve()
    secret = model_dir.parents[2] / "secret.txt"
    for outside in ("../sibling/manifest.json", "../../../secret.txt", str(secret), "escape", "weights",
                    "weights/nope.safetensors", "", "."):
        with pytest.raises(FileNotFoundError):
            resolve_model_file(model_dir, outside)


SEGMENTS = st.sampled_from(["..", ".", "weights", "manifest.json", "tokenizer.json", "layer_000.safetensors",
                            "sibling", "escape", "secret.txt", "", "/"])


@settings(max_examples=100, deadline=None)
@given(st.lists(SEGMENTS, min_size=1, max_size=6))
def test_whatever_path_a_peer_asks_for_only_a_file_inside_the_model_directory_is_served(model_dir, segments):
    relative = "/".join(segments)
    try:
        served = resolve_model_file(model_dir, relative)
    except FileNotFoundError:
        return
    assert served.is_file() and model_dir.resolve() in served.parents
    assert served.read_bytes() != b"not a model file"


@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> Path:
    """The folder of a tiny random sentence encoder, as an import reads it."""
    from tests.shards.importers.test_encoder import write_tiny_encoder

    folder = tmp_path_factory.mktemp("encoder") / "source"
    write_tiny_encoder(folder)
    return folder


def test_an_embedding_model_is_fetched_whole_or_not_at_all(tmp_path, encoder):
    async def scenario() -> None:
        source_store = ModelStore(tmp_path / "home-0")
        import_encoder(encoder, name="embedder", store=source_store)
        async with peers(tmp_path, holding=()) as (sources, client):
            expected = source_store.encoder_manifest("embedder")
            weights = next(iter(expected.files.values())).path
            source_dir = source_store.models_dir / "embedder"
            assert intact(source_dir, next(iter(expected.files.values())))
            flip_a_byte(source_dir / weights, keep_mtime=True)  # served, then refused by the fetcher

            store = ModelStore(tmp_path / "worker")
            with pytest.raises(WeightTransferError, match="corrupt"):
                await asyncio.wait_for(ensure_encoder_files(client, store, "embedder", sources), timeout=30)
            assert not store.has_encoder("embedder") and not (store.models_dir / "embedder").exists()
            assert [p.name for p in store.models_dir.iterdir()] == []  # no staging folder left either

            flip_a_byte(source_dir / weights, keep_mtime=True)  # the bytes are right again
            await asyncio.wait_for(ensure_encoder_files(client, store, "embedder", sources), timeout=30)
            assert store.has_encoder("embedder") and store.encoder_manifest("embedder") == expected
            fetched = store.models_dir / "embedder"
            assert all(file_digest(fetched / f.path) == f.sha256 for f in expected.files.values())
            assert files_in(fetched) == files_in(source_dir)
            await asyncio.wait_for(ensure_encoder_files(client, store, "embedder", []), timeout=30)  # no source needed

    asyncio.run(scenario())
