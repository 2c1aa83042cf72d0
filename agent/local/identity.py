"""This node's identity: a node id created once (by first boot or at the first start) and
kept in the state directory. One rule for what a node id is, for both."""

from __future__ import annotations

import logging
import re
import uuid
from pathlib import Path

from agent.local.config import ConfigError
from agent.local.files import write_atomic

log = logging.getLogger(__name__)
NODE_ID_FILE = "node-id"
_NODE_ID = re.compile(r"^[0-9a-f]{12,64}$")


def new_node_id() -> str:
    return uuid.uuid4().hex


def node_id(text: str) -> str:
    """The node id a node-id file holds; ValueError unless it is 12-64 lowercase hex characters."""
    value = text.strip()
    if not _NODE_ID.match(value):
        raise ValueError("the node-id file does not hold 12-64 lowercase hex characters")
    return value


def load_or_create_node_id(state_dir: Path) -> str:
    """Read ``state_dir/node-id``, creating it (32 hex characters) on first start."""
    path = state_dir / NODE_ID_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = ""
    except OSError as error:
        raise ConfigError(f"cannot read node id from {str(path)!r}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{str(path)!r} does not hold text; delete the file to create a new one") from None
    if text.strip():
        try:
            return node_id(text)
        except ValueError as error:
            raise ConfigError(f"{str(path)!r}: {error}; delete the file to create a new one") from None
    created = new_node_id()
    try:
        write_atomic(path, created + "\n", mode=0o644)
    except OSError as error:
        raise ConfigError(f"cannot create node id in {str(state_dir)!r}: {error.strerror}") from None
    log.info("created node id %s in %s", created, path)
    return created
