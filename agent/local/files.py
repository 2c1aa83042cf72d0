"""Files written whole: a temporary file in the same folder, flushed to disk, given its mode
(and group) and renamed into place, so a reader or a power cut sees the old file or the new
one, never half of one. The one atomic writer of the agent."""

from __future__ import annotations

import grp
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def write_atomic(path: Path, data: bytes | str, *, mode: int = 0o600, group: str | None = None) -> None:
    """Write ``data`` to ``path`` atomically with ``mode`` from the first byte; ``group`` (when
    running as root) owns it, else the group of the file it replaces, where there is one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    gid, mode = _group_and_mode(path, group, mode)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        if gid is not None:
            try:
                os.fchown(fd, -1, gid)
            except PermissionError:
                os.fchmod(fd, mode & 0o700)  # not this user's to give: readable by the owner only
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_private(path: Path, data: bytes | str) -> None:
    """Write a secret: atomically, readable by this user only (0600)."""
    write_atomic(path, data, mode=0o600)


def _group_and_mode(path: Path, group: str | None, mode: int) -> tuple[int | None, int]:
    """The group to give the new file (None: leave it) and its mode."""
    if group is not None:
        if os.geteuid() != 0:
            return None, mode
        try:
            return grp.getgrnam(group).gr_gid, mode
        except KeyError:
            log.warning("group %s does not exist; %s stays readable by its owner only", group, path)
            return None, mode & 0o700
    try:
        gid = path.stat().st_gid
    except FileNotFoundError:
        return None, mode
    return (gid if gid != os.getegid() else None), mode
