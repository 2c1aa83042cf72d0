"""What a client may read of an error: no network addresses of nodes, no answers of peers (the
orchestrator's log has those)."""

from __future__ import annotations

import re

from agent.cluster.peer_client import PeerError
from agent.core.errors import NcmError
from agent.stage.weights import WeightTransferError
from shards.errors import ShardsError

# What a public error must not show: URLs, and IPv4 / IPv6 addresses with a port.
_ADDRESS = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s,;'\"()]+|\b\d{1,3}(?:\.\d{1,3}){3}:\d+\b|\[[0-9a-fA-F:]+\]:\d+"
                      r"|\('[0-9a-fA-F.:]+', \d+\)")  # also Python's (host, port) tuples
_TLS_CONTEXT = re.compile(r" ?ssl:<[^>]*>")  # aiohttp's connection errors show the TLS context object


def without_addresses(text: str) -> str:
    """``text`` without the network addresses of nodes (what a public error must not show)."""
    return _ADDRESS.sub("(a node)", _TLS_CONTEXT.sub("", text))


def public_reason(error: BaseException) -> str:
    """Why a load failed, as a client may read it: the real reason, without the addresses of
    nodes or what they answered (the orchestrator's log has those)."""
    if isinstance(error, (PeerError, WeightTransferError)):
        return ("a node did not answer, or could not provide the model's files intact "
                "(the orchestrator's log has each node's answer)")
    if isinstance(error, (NcmError, ShardsError)):
        return without_addresses(str(error) or type(error).__name__)
    return f"internal error ({type(error).__name__}; the orchestrator's log has the details)"
