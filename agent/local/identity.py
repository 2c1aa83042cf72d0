"""This node's identity: a node id created once and kept in the state directory."""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from agent.local.config import ConfigError

log = logging.getLogger(__name__)
NODE_ID_FILE = "node-id"


def load_or_create_node_id(state_dir: Path) -> str:
    """Read ``state_dir/node-id``, creating it (32 hex characters) on first start."""
    path = state_dir / NODE_ID_FILE
    try:
        node_id = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        node_id = ""
    except OSError as error:
        raise ConfigError(f"cannot read node id from {str(path)!r}: {error.strerror}") from None
    if node_id:
        if not (8 <= len(node_id) <= 64 and node_id.isalnum()):
            raise ConfigError(f"{str(path)!r} holds a malformed node id; delete the file to create a new one")
        return node_id
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        node_id = uuid.uuid4().hex
        temporary = path.with_suffix(".tmp")
        temporary.write_text(node_id + "\n", encoding="utf-8")
        os.replace(temporary, path)
    except OSError as error:
        raise ConfigError(f"cannot create node id in {str(state_dir)!r}: {error.strerror}") from None
    log.info("created node id %s in %s", node_id, path)
    return node_id
