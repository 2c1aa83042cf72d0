"""Manifest validation / JSON round trip and the model store's atomic writes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from shards.errors import ModelFormatError, ModelNotFoundError
from shards.store.manifest import Manifest, WeightFile, layer_key
from shards.store.model_store import ModelStore, ncm_home

SHA = "ab" * 32


def make_manifest(**over) -> Manifest:
    n = over.pop("n_layers", 2)
    files = {k: WeightFile(path=f"weights/{k}.safetensors", bytes=10 + i, sha256=SHA)
             for i, k in enumerate(["embed", "head"] + [layer_key(i) for i in range(n)])}
    kw = dict(name="tiny", architecture="llama", n_layers=n, hidden_size=64, intermediate_size=128,
              n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=100, rope_theta=10000.0, rms_norm_eps=1e-5,
              context_length=256, tied_embeddings=True, attention_bias=False, weight_format="f32",
              files=files, source_digest=SHA)
    kw.update(over)
    return Manifest(**kw)


def test_manifest_round_trips_through_json() -> None:
    m = make_manifest(rope_freq_factors=tuple(float(i + 1) for i in range(8)))
    back = Manifest.from_json(m.to_json())
    assert back == m
    assert back.layer_bytes(1) == m.files["layer.1"].bytes and back.embed_bytes == 10 and back.head_bytes == 11
    assert m.fragment_files(0, 1) == ["embed", "layer.0", "layer.1", "head"]
    assert m.fragment_files(1, 1) == ["layer.1", "head"]


def test_a_partial_rotary_round_trips_and_an_older_manifest_turns_the_whole_head() -> None:
    m = make_manifest(rotary_dim=8, rotary_scale=1.2, rope_freq_factors=(1.0, 1.5, 2.0, 4.0))
    assert Manifest.from_json(m.to_json()) == m and m.rotary_width == 8
    plain = make_manifest()
    assert "rotary_dim" not in plain.to_json() and plain.rotary_width == 16 and plain.rotary_scale == 1.0


def test_manifest_is_frozen() -> None:
    m = make_manifest()
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.n_layers = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        m.files["embed"] = m.files["head"]  # type: ignore[index]


@pytest.mark.parametrize("bad", [
    {"architecture": "gpt2"}, {"weight_format": "q8"}, {"n_layers": 0}, {"n_heads": 5},
    {"head_dim": 15}, {"rope_theta": float("nan")}, {"rms_norm_eps": -1.0}, {"name": "../evil"},
    {"source_digest": "xyz"}, {"rope_freq_factors": (1.0, 2.0)}, {"tied_embeddings": "yes"},
    {"rotary_dim": 7}, {"rotary_dim": 16}, {"rotary_dim": -2}, {"rotary_scale": 0.0}, {"rotary_scale": "1"},
    {"rotary_dim": 8, "rope_freq_factors": (1.0,) * 8},  # factors cover the turned dims only: 4
])
def test_manifest_rejects_nonsense(bad) -> None:
    with pytest.raises(ModelFormatError):
        make_manifest(**bad)


def test_manifest_rejects_bad_file_tables() -> None:
    m = make_manifest()
    d = json.loads(m.to_json())
    del d["files"]["layer.1"]
    with pytest.raises(ModelFormatError, match="missing"):
        Manifest.from_dict(d)
    d = json.loads(m.to_json())
    d["files"]["embed"]["path"] = "../../etc/passwd"
    with pytest.raises(ModelFormatError):
        Manifest.from_dict(d)
    with pytest.raises(ModelFormatError):
        Manifest.from_json("[1, 2]")
    with pytest.raises(ModelFormatError):
        Manifest.from_json("{not json")


def test_ncm_home_precedence(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("NCM_HOME", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "x"))
    assert ncm_home() == tmp_path / "a"
    monkeypatch.delenv("NCM_HOME")
    assert ncm_home() == tmp_path / "x" / "ncm"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert ncm_home() == tmp_path / "h" / ".local" / "share" / "ncm"


def test_store_staging_commits_and_lists(tmp_path) -> None:
    store = ModelStore(tmp_path)
    assert store.list() == []
    m = make_manifest()
    with store.staging("tiny") as d:
        (d / "weights").mkdir()
        store.write_manifest(d, m)
    assert store.has("tiny") and store.list() == [m] and store.manifest("tiny") == m
    assert store.model_dir("tiny") == store.models_dir / "tiny"
    assert [p.name for p in store.models_dir.iterdir()] == ["tiny"]
    store.remove("tiny")
    assert not store.has("tiny") and list(store.models_dir.iterdir()) == []


def test_the_store_reads_a_manifest_as_its_file_says_now(tmp_path) -> None:
    store = ModelStore(tmp_path)
    first, second = make_manifest(), make_manifest(n_layers=3)
    with store.staging("tiny") as d:
        store.write_manifest(d, first)
    assert store.manifest("tiny") == first
    store.write_manifest(store.model_dir("tiny"), second)  # rewritten in place
    assert store.manifest("tiny") == second
    with store.staging("tiny") as d:  # replaced by a new import
        store.write_manifest(d, first)
    assert store.manifest("tiny") == first


def test_store_staging_leaves_nothing_on_error(tmp_path) -> None:
    store = ModelStore(tmp_path)
    with pytest.raises(RuntimeError):
        with store.staging("tiny") as d:
            (d / "half.bin").write_bytes(b"x" * 100)
            raise RuntimeError("boom")
    with pytest.raises(ModelFormatError):  # no manifest written -> not committed
        with store.staging("tiny") as d:
            (d / "half.bin").write_bytes(b"x")
    assert list(store.models_dir.iterdir()) == []


def test_unknown_model_names_the_known_ones(tmp_path) -> None:
    store = ModelStore(tmp_path)
    with store.staging("tiny") as d:
        store.write_manifest(d, make_manifest())
    with pytest.raises(ModelNotFoundError, match="tiny"):
        store.manifest("other")
    with pytest.raises(ModelNotFoundError):
        store.remove("other")
    assert not store.has("../tiny")


def test_staging_left_by_a_killed_import_is_swept_and_a_live_ones_is_kept(tmp_path):
    """A process killed half way through an import leaves its staging folder (up to a whole
    model); the next staging, or an agent's start, removes it. A live process's is kept."""
    import os
    import subprocess
    import sys
    import time

    from shards.store.model_store import ModelStore

    store = ModelStore(tmp_path)
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        dead_dir = store.models_dir / f".tmp-{killed.pid}-big-model-abcd1234"
        live_dir = store.models_dir / f".tmp-{alive.pid}-other-model-efgh5678"
        old_dir = store.models_dir / ".tmp-from-an-older-version-x1y2"
        for folder in (dead_dir, live_dir, old_dir):
            folder.mkdir(parents=True)
            (folder / "layer-000.bin").write_bytes(b"\0" * 1024)
        os.utime(old_dir, (time.time() - 2 * 86400,) * 2)
        killed.kill()
        killed.wait(timeout=30)
        with store.staging("fresh") as staging:
            assert staging.name.startswith(f".tmp-{os.getpid()}-fresh-")
            assert not dead_dir.exists() and not old_dir.exists() and live_dir.exists()
            (staging / "manifest.json").write_text("{}")
        assert store.sweep_staging() == []  # the live process's folder stays
        alive.kill()
        alive.wait(timeout=30)
        assert store.sweep_staging() == [live_dir.name]
    finally:
        for process in (killed, alive):
            if process.poll() is None:
                process.kill()
