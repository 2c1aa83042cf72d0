"""Files that hold secrets: written whole (a temporary file renamed into place) and readable
by this user only."""

from __future__ import annotations

from pathlib import Path


def write_private(path: Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` atomically, mode 0600 from the first byte."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.touch(mode=0o600)
    temporary.chmod(0o600)
    temporary.write_bytes(data.encode() if isinstance(data, str) else data)
    temporary.replace(path)
