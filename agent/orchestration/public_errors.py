"""What a client may read of an error: no network addresses of nodes, no answers of peers (the
orchestrator's log has those)."""

from __future__ import annotations

from agent.cluster.peer_client import PeerError
from agent.core.errors import NcmError, without_addresses
from agent.stage.weights import WeightTransferError
from shards.errors import ShardsError


def public_reason(error: BaseException) -> str:
    """Why a load failed, as a client may read it: the real reason, without the addresses of
    nodes or what they answered (the orchestrator's log has those)."""
    if isinstance(error, (PeerError, WeightTransferError)):
        return ("a node did not answer, or could not provide the model's files intact "
                "(the orchestrator's log has each node's answer)")
    if isinstance(error, (NcmError, ShardsError)):
        return without_addresses(str(error) or type(error).__name__)
    return f"internal error ({type(error).__name__}; the orchestrator's log has the details)"
