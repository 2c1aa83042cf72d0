"""The model store: one directory per model under ``<ncm_home>/models``, written atomically."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from shards.errors import ModelFormatError, ModelNotFoundError
from shards.store.encoder_manifest import ENCODER_FILE, EncoderManifest
from shards.store.manifest import Manifest, valid_model_name

log = logging.getLogger(__name__)
MANIFEST_FILE = "manifest.json"
_TMP_PREFIX = ".tmp-"
# A staging folder is named .tmp-<pid>-...: what a process that died (a killed import or fetch)
# left is swept. One of an older version, without its pid, is swept once a day old.
_STAGING_PID = re.compile(r"^\.tmp-(\d+)-")
UNOWNED_STAGING_AGE_S = 86400.0


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def ncm_home() -> Path:
    """$NCM_HOME, else $XDG_DATA_HOME/ncm, else ~/.local/share/ncm."""
    if os.environ.get("NCM_HOME"):
        return Path(os.environ["NCM_HOME"])
    if os.environ.get("XDG_DATA_HOME"):
        return Path(os.environ["XDG_DATA_HOME"]) / "ncm"
    return Path.home() / ".local" / "share" / "ncm"


class ModelStore:
    """Models on disk: ``models/NAME/manifest.json`` plus weight and tokenizer files."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else ncm_home()
        self.models_dir = self.root / "models"
        self._parsed: dict[str, tuple[str, Manifest]] = {}  # name -> (manifest text, what it parsed to)

    def _names(self) -> list[str]:
        if not self.models_dir.is_dir():
            return []
        return sorted(p.name for p in self.models_dir.iterdir()
                      if not p.name.startswith(".") and (p / MANIFEST_FILE).is_file())

    def list(self) -> list[Manifest]:
        """Manifests of every stored model (unreadable ones are logged and skipped)."""
        out = []
        for name in self._names():
            try:
                out.append(self.manifest(name))
            except ModelFormatError as e:
                log.warning("skipping model %s: %s", name, e)
        return out

    def has(self, name: str) -> bool:
        return valid_model_name(name) and (self.models_dir / name / MANIFEST_FILE).is_file()

    def model_dir(self, name: str) -> Path:
        """Directory of model ``name`` (ModelNotFoundError if absent)."""
        if not self.has(name):
            known = ", ".join(self._names()) or "none"
            raise ModelNotFoundError(f"model {name!r} is not in the store (known models: {known})")
        return self.models_dir / name

    def manifest(self, name: str) -> Manifest:
        """Model ``name``'s manifest, as its file says now (parsed again only when its text
        changed: peers ask what this node holds every few seconds)."""
        text = (self.model_dir(name) / MANIFEST_FILE).read_text(encoding="utf-8")
        parsed = self._parsed.get(name)
        if parsed is None or parsed[0] != text:
            parsed = self._parsed[name] = (text, Manifest.from_json(text))
        return parsed[1]

    # --- embedding models (an encoder.json instead of a manifest.json) ----------------------------
    def encoders(self) -> list[str]:
        """Names of the stored embedding models."""
        if not self.models_dir.is_dir():
            return []
        return sorted(p.name for p in self.models_dir.iterdir()
                      if not p.name.startswith(".") and (p / ENCODER_FILE).is_file())

    def has_encoder(self, name: str) -> bool:
        return valid_model_name(name) and (self.models_dir / name / ENCODER_FILE).is_file()

    def encoder_manifest(self, name: str) -> EncoderManifest:
        """Embedding model ``name``'s manifest (ModelNotFoundError if it is not stored)."""
        if not self.has_encoder(name):
            raise ModelNotFoundError(f"embedding model {name!r} is not in the store "
                                     f"(known: {', '.join(self.encoders()) or 'none'})")
        return EncoderManifest.from_json((self.models_dir / name / ENCODER_FILE).read_text(encoding="utf-8"))

    def remove(self, name: str) -> None:
        """Delete model ``name`` (ModelNotFoundError if absent)."""
        d = self.models_dir / name if self.has_encoder(name) else self.model_dir(name)
        self._parsed.pop(name, None)
        trash = self.models_dir / f"{_TMP_PREFIX}{os.getpid()}-rm-{name}"
        os.replace(d, trash)
        shutil.rmtree(trash, ignore_errors=True)

    @contextlib.contextmanager
    def staging(self, name: str) -> Iterator[Path]:
        """Yield a temp dir inside models_dir; on success it becomes models/NAME, else it is removed.

        The caller writes manifest.json (an embedding model: encoder.json) last. An existing
        model of the same name is replaced.
        """
        if not valid_model_name(name):
            raise ModelFormatError(f"bad model name {name!r}: use letters, digits, '.', '_', '-'")
        self.models_dir.mkdir(parents=True, exist_ok=True)
        self.sweep_staging()
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-{name}-", dir=self.models_dir))
        try:
            yield tmp
            if not (tmp / MANIFEST_FILE).is_file() and not (tmp / ENCODER_FILE).is_file():
                raise ModelFormatError(f"import of {name} wrote no manifest")
            final = self.models_dir / name
            if final.exists():
                old = self.models_dir / f"{_TMP_PREFIX}{os.getpid()}-old-{name}"
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def sweep_staging(self, *, now: float | None = None) -> list[str]:
        """Delete the staging folders of processes that are gone (an import or a fetch killed
        half way: up to a whole model each); returns their names. Folders of live processes,
        this one's included, are left alone."""
        if not self.models_dir.is_dir():
            return []
        now = time.time() if now is None else now
        swept = []
        for path in self.models_dir.iterdir():
            if not path.name.startswith(_TMP_PREFIX) or not path.is_dir():
                continue
            owner = _STAGING_PID.match(path.name)
            if owner is not None:
                stale = int(owner.group(1)) != os.getpid() and not _process_alive(int(owner.group(1)))
            else:
                stale = now - path.stat().st_mtime > UNOWNED_STAGING_AGE_S
            if stale:
                shutil.rmtree(path, ignore_errors=True)
                swept.append(path.name)
        if swept:
            log.info("removed %d staging folder(s) left by processes that stopped: %s", len(swept), ", ".join(swept))
        return swept

    def write_manifest(self, model_dir: Path, manifest: Manifest) -> None:
        """Write ``manifest.json`` into ``model_dir`` atomically."""
        tmp = model_dir / (MANIFEST_FILE + ".part")
        tmp.write_text(manifest.to_json(), encoding="utf-8")
        os.replace(tmp, model_dir / MANIFEST_FILE)
