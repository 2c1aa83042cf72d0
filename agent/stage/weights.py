"""Weight distribution: a worker fetches exactly the files of its layers from a peer.

Files travel over `GET /internal/models/{name}/files/{path}` (HTTP Range, so a transfer
that broke resumes where it stopped), are written to `<file>.part`, checked against the
manifest's sha256 and only then renamed into place. The model's manifest and tokenizer
files come first, so a node that holds only some layers still has a usable model entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import weakref
from pathlib import Path
from typing import Callable, Iterator

import aiohttp

from agent.cluster.peer_client import PeerClient, PeerError
from agent.core.errors import NcmError, WireError
from agent.core.protocol import ModelListing, model_file_path, model_listing_path
from shards.errors import ShardsError
from shards.store.encoder_manifest import ENCODER_FILE, EncoderManifest
from shards.store.manifest import Manifest
from shards.store.model_store import ModelStore
from shards.store.verify import hash_file

log = logging.getLogger(__name__)
CHUNK_BYTES = 1 << 20
MANIFEST_FILE = "manifest.json"
META_FILES = ("tokenizer.json", "tokenizer_config.json")
TRANSFER_TIMEOUT_S = 3600.0
READ_TIMEOUT_S = 60.0


class WeightTransferError(NcmError):
    """No peer could provide a model file intact."""


class StoreWriteError(NcmError):
    """This node cannot write a fetched file into its own store (a full disk, a read-only
    store): no other source would do better. ``errno_code`` is the OS error number."""

    def __init__(self, message: str, errno_code: int | None) -> None:
        super().__init__(message)
        self.errno_code = errno_code


def file_digest(path: Path) -> str:
    return hash_file(path).hexdigest()


def describe_model_files(model_dir: Path) -> ModelListing:
    """What a source serves: the manifest (an embedding model's: ``encoder``) and the
    size/digest of the tokenizer files."""
    meta = {name: (path.stat().st_size, file_digest(path)) for name in META_FILES
            if (path := model_dir / name).is_file()}
    kind, file = ("encoder", ENCODER_FILE) if (model_dir / ENCODER_FILE).is_file() else ("manifest", MANIFEST_FILE)
    return ModelListing(kind, json.loads((model_dir / file).read_text(encoding="utf-8")), meta)


def resolve_model_file(model_dir: Path, relative: str) -> Path:
    """A path inside the model directory (no escaping it with '..' or absolute paths)."""
    candidate = (model_dir / relative).resolve()
    if model_dir.resolve() not in candidate.parents or not candidate.is_file():
        raise FileNotFoundError(relative)
    return candidate


def missing_files(model_dir: Path, manifest: Manifest, keys: list[str]) -> list[str]:
    """Keys of weight files that are absent or of the wrong size."""
    missing = []
    for key in keys:
        entry = manifest.files[key]
        path = model_dir / entry.path
        if not path.is_file() or path.stat().st_size != entry.bytes:
            missing.append(key)
    return missing


def complete_models(store: ModelStore) -> dict[str, int]:
    """name -> weight bytes of the models whose every file is here (those this node can share)."""
    complete = {}
    for manifest in store.list():
        if not missing_files(store.models_dir / manifest.name, manifest, list(manifest.files)):
            complete[manifest.name] = sum(entry.bytes for entry in manifest.files.values())
    return complete


Source = tuple[str, str]  # (node id, URL) of a peer to fetch from


async def _download(client: PeerClient, source: Source, name: str, relative: str, dest: Path, size: int,
                    sha256: str) -> None:
    node_id, base_url = source
    part = dest.with_name(dest.name + ".part")
    with _writing(dest):
        dest.parent.mkdir(parents=True, exist_ok=True)
        offset = part.stat().st_size if part.exists() else 0
        if offset > size:
            part.unlink()
            offset = 0
    digest = hashlib.sha256()
    if offset:
        digest = await asyncio.to_thread(hash_file, part)
        log.info("resuming %s of %s at %d / %d bytes", relative, name, offset, size)
    url, headers = client.signed_request("GET", base_url, model_file_path(name, relative),
                                         target=node_id)
    if offset:
        headers["Range"] = f"bytes={offset}-"
    next_report = offset + max(size // 10, CHUNK_BYTES)
    timeout = aiohttp.ClientTimeout(total=TRANSFER_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
    try:
        async with client.session.get(url, headers=headers, timeout=timeout, ssl=client.ssl) as response:
            if response.status not in (200, 206):
                body = await response.read()
                client.check_answer(url, headers, response.status, response.headers, body, target=node_id)
                raise PeerError(base_url, f"HTTP {response.status} for {relative}", response.status)
            # The bytes are checked against the sha256 of the (signed) listing below.
            client.check_answer(url, headers, response.status, response.headers, None, target=node_id)
            if response.status == 200 and offset:
                offset, digest = 0, hashlib.sha256()  # the source ignored the range: start over
            with _writing(dest):
                handle = part.open("ab" if offset else "wb")
            try:
                async for block in response.content.iter_chunked(CHUNK_BYTES):
                    with _writing(dest):
                        handle.write(block)
                    digest.update(block)
                    offset += len(block)
                    if offset >= next_report and size > 0:
                        log.info("fetching %s/%s: %d%% of %d bytes", name, relative, 100 * offset // size, size)
                        next_report = offset + max(size // 10, CHUNK_BYTES)
            finally:
                with _writing(dest):
                    handle.close()
    except StoreWriteError:
        part.unlink(missing_ok=True)  # what did fit would only keep the store full
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
        raise PeerError(base_url, f"transfer of {relative} broke: {type(error).__name__}: {error}") from None
    if offset != size or digest.hexdigest() != sha256:
        part.unlink(missing_ok=True)
        raise WeightTransferError(f"{relative} from {base_url} is corrupt (size or sha256 mismatch)")
    with _writing(dest):
        os.replace(part, dest)


@contextlib.contextmanager
def _writing(dest: Path) -> Iterator[None]:
    """OS errors of writing into the local store become StoreWriteError (not a peer's fault)."""
    try:
        yield
    except StoreWriteError:
        raise
    except OSError as error:
        raise StoreWriteError(f"cannot write {dest.name} into the model store: {error.strerror or error}",
                              error.errno) from error


async def _listing(client: PeerClient, name: str, sources: list[Source], errors: list[str], *,
                   kind: str = "manifest") -> tuple[Source, ModelListing]:
    """The first source's answer to `GET /internal/models/{name}` (one with a ``kind``:
    "manifest", or "encoder" for an embedding model): (source, listing)."""
    for source in sources:
        node_id, base_url = source
        try:
            return source, ModelListing.from_json(await client.request_json(
                "GET", base_url, model_listing_path(name), target=node_id, timeout_s=30.0), kind)
        except WireError as error:
            errors.append(f"{base_url}: malformed model listing ({error})")
        except PeerError as error:
            errors.append(str(error))
    raise WeightTransferError(f"no peer could provide model {name!r}: " + ("; ".join(errors) or "no source known"))


async def _fetch_from_any(client: PeerClient, sources: list[Source], name: str, relative: str, dest: Path,
                          size: int, sha256: str, errors: list[str]) -> None:
    """One file from the first source that has it intact (a source may hold only some layers)."""
    for source in sources:
        try:
            await _download(client, source, name, relative, dest, size, sha256)
            return
        except (PeerError, WeightTransferError) as error:
            errors.append(str(error))
            log.debug("could not fetch %s of %s from %s: %s", relative, name, source[1], error)
    raise WeightTransferError(f"no peer could provide {relative} of model {name!r}: " + "; ".join(errors[-len(sources):]))


async def ensure_model_files(
    client: PeerClient, store: ModelStore, name: str, keys_for: Callable[[Manifest], list[str]], sources: list[Source]
) -> Manifest:
    """Make sure ``name``'s manifest, tokenizer and the weight files ``keys_for(manifest)``
    are in the local store, fetching each missing file from the first source that has it."""
    model_dir = store.models_dir / name
    if store.has(name):
        manifest = store.manifest(name)
        if not missing_files(model_dir, manifest, keys_for(manifest)):
            return manifest
    # One fetch at a time per model directory: two would write the same `.part` files.
    lock = _fetch_locks.setdefault(str(model_dir.resolve()), asyncio.Lock())
    async with lock:
        return await _fetch_model_files(client, store, name, keys_for, sources)


_fetch_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()


async def _fetch_model_files(
    client: PeerClient, store: ModelStore, name: str, keys_for: Callable[[Manifest], list[str]], sources: list[Source]
) -> Manifest:
    model_dir = store.models_dir / name
    if store.has(name):
        manifest = store.manifest(name)
        if not missing_files(model_dir, manifest, keys_for(manifest)):
            return manifest  # fetched meanwhile
    errors: list[str] = []
    source, listing = await _listing(client, name, sources, errors)
    try:
        manifest = Manifest.from_dict(listing.document)
        meta_files = {k: v for k, v in listing.meta_files.items() if k in META_FILES}
    except (ShardsError, KeyError, TypeError, ValueError) as error:
        raise WeightTransferError(f"{source[1]} sent an unusable manifest of {name!r}: {error}") from None
    with _writing(model_dir):
        model_dir.mkdir(parents=True, exist_ok=True)
    ordered = [source] + [s for s in sources if s != source]
    for meta_name, (size, digest) in meta_files.items():
        dest = model_dir / meta_name
        if not dest.is_file() or await asyncio.to_thread(file_digest, dest) != digest:
            await _fetch_from_any(client, ordered, name, meta_name, dest, size, digest, errors)
    wanted = missing_files(model_dir, manifest, keys_for(manifest))
    if wanted:
        log.info("fetching %d weight file(s) of %s (%d bytes)", len(wanted), name,
                 sum(manifest.files[k].bytes for k in wanted))
    for key in wanted:
        entry = manifest.files[key]
        await _fetch_from_any(client, ordered, name, entry.path, model_dir / entry.path, entry.bytes, entry.sha256, errors)
    if not (model_dir / MANIFEST_FILE).is_file():
        with _writing(model_dir / MANIFEST_FILE):
            store.write_manifest(model_dir, manifest)
    return manifest


async def ensure_encoder_files(client: PeerClient, store: ModelStore, name: str, sources: list[Source]) -> None:
    """Make sure embedding model ``name`` is in the local store: its weights, tokenizer and
    ``encoder.json``, fetched whole from the first source that has each intact (into a
    staging folder, so a broken transfer leaves nothing half-stored)."""
    model_dir = store.models_dir / name
    lock = _fetch_locks.setdefault(str(model_dir.resolve()), asyncio.Lock())
    async with lock:
        if store.has_encoder(name):
            return
        errors: list[str] = []
        source, listing = await _listing(client, name, sources, errors, kind="encoder")
        try:
            manifest = EncoderManifest.from_json(json.dumps(listing.document))
            files = {k: v for k, v in listing.meta_files.items() if k in META_FILES}
        except (ShardsError, KeyError, TypeError, ValueError) as error:
            raise WeightTransferError(f"{source[1]} sent an unusable listing of {name!r}: {error}") from None
        if manifest.name != name:
            raise WeightTransferError(f"{source[1]} listed {manifest.name!r} for embedding model {name!r}")
        files.update({entry.path: (entry.bytes, entry.sha256) for entry in manifest.files.values()})
        log.info("fetching embedding model %s (%d bytes)", name, sum(size for size, _ in files.values()))
        ordered = [source] + [s for s in sources if s != source]
        with _writing(model_dir), store.staging(name) as staging:
            for relative, (size, digest) in files.items():
                await _fetch_from_any(client, ordered, name, relative, staging / relative, size, digest, errors)
            (staging / ENCODER_FILE).write_text(manifest.to_json(), encoding="utf-8")
