"""Weight files checked against the manifest's sha256 where they are used.

A fragment is built only from files whose sha256 matches the manifest, and a node offers a
peer only such files. Hashing a model takes a moment, so each result is kept in
``<model>/.verified.json`` keyed by the file's size and modification time: a file that was
not touched since costs one ``stat`` the next time, also after a restart.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from shards.errors import CorruptWeightsError
from shards.store.manifest import Manifest, WeightFile

log = logging.getLogger(__name__)
VERIFIED_FILE = ".verified.json"
_CHUNK_BYTES = 1 << 20
_lock = threading.Lock()  # one writer of the cache file per process


def hash_file(path: Path, digest: Any = None, *, after_block: Callable[[bytes], None] | None = None) -> Any:
    """The sha256 object of ``path``'s bytes (it can go on hashing bytes appended later), or
    ``digest`` (a hashlib object) fed with them: the one file hasher of ncm. ``after_block``
    sees each block once hashed (the scrub paces its reads with it)."""
    with Path(path).open("rb") as handle:
        return hash_chunks(iter(lambda: handle.read(_CHUNK_BYTES), b""), digest, after_block=after_block)


def hash_chunks(chunks: Iterable[bytes | memoryview], digest: Any = None, *,
                after_block: Callable[[bytes], None] | None = None) -> Any:
    """:func:`hash_file` of a file's bytes given in pieces (a file being written, hashed from
    memory rather than read back)."""
    digest = hashlib.sha256() if digest is None else digest
    for block in chunks:
        digest.update(block)
        if after_block is not None:
            after_block(block)
    return digest


def _read_cache(model_dir: Path) -> dict[str, Any]:
    try:
        cache = json.loads((model_dir / VERIFIED_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_cache(model_dir: Path, cache: dict[str, Any]) -> None:
    tmp = model_dir / f"{VERIFIED_FILE}.{os.getpid()}.{threading.get_ident()}"
    try:
        tmp.write_text(json.dumps(cache, sort_keys=True), encoding="utf-8")
        os.replace(tmp, model_dir / VERIFIED_FILE)
    except OSError as error:  # a full or read-only store: the files are hashed again next time
        tmp.unlink(missing_ok=True)
        log.debug("cannot keep the verification cache of %s: %s", model_dir.name, error)


def intact(model_dir: Path, entry: WeightFile) -> bool:
    """Whether ``entry``'s file is present with the manifest's size and sha256."""
    return not corrupt_files(model_dir, [entry])


def corrupt_files(model_dir: Path, entries: Iterable[WeightFile]) -> list[str]:
    """Paths (relative to ``model_dir``) of the files among ``entries`` that are absent or whose
    size or sha256 differs from the manifest."""
    model_dir = Path(model_dir)
    with _lock:
        cache = _read_cache(model_dir)
        changed = False
        bad: list[str] = []
        for entry in entries:
            path = model_dir / entry.path
            try:
                stat = path.stat()
            except OSError:
                bad.append(entry.path)
                continue
            stamp = [stat.st_size, stat.st_mtime_ns]
            known = cache.get(entry.path)
            if isinstance(known, list) and known[:2] == stamp and len(known) == 3:
                digest = known[2]
            else:
                digest = hash_file(path).hexdigest() if stat.st_size == entry.bytes else ""
                cache[entry.path] = [*stamp, digest]
                changed = True
            if stat.st_size != entry.bytes or digest != entry.sha256:
                bad.append(entry.path)
        if changed:
            _write_cache(model_dir, cache)
    return bad


def verify_weight_files(model_dir: Path, manifest: Manifest, keys: Iterable[str]) -> None:
    """CorruptWeightsError naming every file of ``keys`` that does not match the manifest."""
    bad = corrupt_files(model_dir, [manifest.files[key] for key in keys])
    if bad:
        raise CorruptWeightsError(f"weight file(s) of {manifest.name} do not match the manifest: {', '.join(bad)}",
                                  tuple(bad))


def discard(model_dir: Path, paths: Iterable[str]) -> None:
    """Delete corrupt files, so that they count as missing and are fetched again."""
    for relative in paths:
        (Path(model_dir) / relative).unlink(missing_ok=True)
        log.warning("weight file %s of %s is corrupt: deleted, to be fetched again", relative, Path(model_dir).name)
