"""The rules of the settings a device is set up with, one per setting, used by the agent's
configuration (:class:`~agent.local.config.AgentConfig`) and by first boot's setup file alike:
the same value is accepted or refused by both, with the same reason.

Each function returns the value (normalised where it says) or raises ValueError saying why.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

MIN_CLUSTER_KEY_LENGTH = 16
MAX_CLUSTER_KEY_LENGTH = 256
_CLUSTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")


def cluster_name(name: str) -> str:
    if not _CLUSTER_NAME.match(name):
        raise ValueError(f"a cluster name is 1-63 letters, digits, '-' or '_', starting with a letter or digit, "
                         f"got {name!r}")
    return name


def cluster_key(key: str) -> str:
    """A cluster key (never quoted in the error)."""
    if not MIN_CLUSTER_KEY_LENGTH <= len(key) <= MAX_CLUSTER_KEY_LENGTH:
        raise ValueError(f"the cluster key must have {MIN_CLUSTER_KEY_LENGTH}-{MAX_CLUSTER_KEY_LENGTH} characters")
    if any(ch.isspace() or not ch.isprintable() for ch in key):
        raise ValueError("the cluster key must not contain spaces or control characters")
    return key


def peer_url(url: str) -> str:
    """A static peer: ``http(s)://host[:port]`` without credentials, path, query or fragment;
    returns it normalised (no trailing slash, IPv6 hosts in brackets)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"a peer URL starts with http:// or https://, got {url!r}")
    if not parts.hostname:
        raise ValueError(f"a peer URL needs a host, got {url!r}")
    if parts.username or parts.password:
        raise ValueError("a peer URL must not carry a user or password")
    try:
        port = parts.port
    except ValueError as error:
        raise ValueError(f"bad port in peer URL {url!r}: {error}") from None
    if port == 0:
        raise ValueError(f"bad port in peer URL {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"a peer URL takes no ?query or #fragment, got {url!r}")
    if parts.path.rstrip("/"):
        raise ValueError(f"a peer URL has no path: give only http://host:port, got {url!r}")
    host = parts.hostname
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass
    return f"{parts.scheme}://{host}" + (f":{port}" if port else "")
