"""Weight files are checked against the manifest where they are used: before a fragment is
built from them, with the result kept by size and modification time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import shards.store.verify as verify
from shards.errors import CorruptWeightsError
from shards.graph.fragment import build_fragment
from shards.importers.importer import import_model
from shards.store.model_store import ModelStore
from tests.shards.fragment_helpers import write_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("hf") / "llama", layers=3)


@pytest.fixture
def tiny(checkpoint, tmp_path) -> tuple[Path, object]:
    store = ModelStore(tmp_path / "home")
    manifest = import_model(checkpoint, name="tiny", store=store, progress=False)
    return store.models_dir / "tiny", manifest


def flip_a_byte(path: Path) -> None:
    """Change one byte in the middle of ``path``, keeping its size (a bit rot, not a truncation)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    os.unlink(path)  # a file of its own, whatever links it had
    path.write_bytes(bytes(data))


def test_intact_files_pass_and_a_flipped_byte_is_named(tiny) -> None:
    model_dir, manifest = tiny
    keys = manifest.fragment_files(0, manifest.n_layers - 1)
    verify.verify_weight_files(model_dir, manifest, keys)
    flip_a_byte(model_dir / manifest.files["layer.1"].path)
    with pytest.raises(CorruptWeightsError) as caught:
        verify.verify_weight_files(model_dir, manifest, keys)
    assert caught.value.paths == (manifest.files["layer.1"].path,)


def test_a_files_bytes_hashed_in_pieces_from_memory_hash_as_the_file(tiny) -> None:
    model_dir, manifest = tiny
    path = model_dir / manifest.files["layer.0"].path
    data = path.read_bytes()
    pieces = [data[:8], memoryview(data)[8:1000], data[1000:]]
    assert verify.hash_chunks(pieces).hexdigest() == verify.hash_file(path).hexdigest()
    assert verify.hash_chunks(pieces).hexdigest() == manifest.files["layer.0"].sha256


def test_a_missing_or_truncated_file_is_corrupt(tiny) -> None:
    model_dir, manifest = tiny
    (model_dir / manifest.files["layer.0"].path).unlink()
    truncated = model_dir / manifest.files["layer.2"].path
    truncated.write_bytes(truncated.read_bytes()[:-1])
    assert verify.corrupt_files(model_dir, manifest.files.values()) == [
        manifest.files["layer.0"].path, manifest.files["layer.2"].path]


def test_a_file_is_hashed_once_until_it_changes(tiny, monkeypatch) -> None:
    model_dir, manifest = tiny
    hashed: list[Path] = []
    real = verify.hash_file
    monkeypatch.setattr(verify, "hash_file", lambda path: hashed.append(Path(path)) or real(path))
    entries = list(manifest.files.values())
    assert verify.corrupt_files(model_dir, entries) == []
    first = len(hashed)
    assert first == len(entries)
    assert verify.corrupt_files(model_dir, entries) == []
    assert len(hashed) == first  # size and mtime unchanged: the kept result
    flip_a_byte(model_dir / manifest.files["head"].path)
    assert verify.corrupt_files(model_dir, entries) == [manifest.files["head"].path]
    assert hashed[first:] == [model_dir / manifest.files["head"].path]


def test_no_fragment_is_built_from_a_corrupt_file_and_discarding_it_makes_it_missing(tiny, tmp_path) -> None:
    model_dir, manifest = tiny
    corrupt = model_dir / manifest.files["layer.2"].path
    flip_a_byte(corrupt)
    build_fragment(model_dir, 0, 1, cache_dir=tmp_path / "cache")  # layers it does not need are not read
    with pytest.raises(CorruptWeightsError, match="layer"):
        build_fragment(model_dir, 1, 2, cache_dir=tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir() if "-001-002-" in p.name] == []
    verify.discard(model_dir, [manifest.files["layer.2"].path])
    assert not corrupt.exists()
