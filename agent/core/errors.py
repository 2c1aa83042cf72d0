"""Errors of the agent: one base, one subclass per kind of problem.

Caller errors (bad input) and cluster errors (a device failed) are distinct classes so
that the service never answers a caller's mistake with a failover.
"""


class NcmError(Exception):
    """Base of every error raised by ``agent``."""


class InvalidNodeError(NcmError, ValueError):
    """A node description is malformed (missing field, negative memory, bad load...)."""


class ShardingError(NcmError):
    """The layers cannot be split over the nodes as asked (e.g. too many nodes for the minimum)."""


class RoutingFailure(NcmError):
    """Some layer has no live holder and no fallback model is allowed."""


class ClusterError(NcmError):
    """The cluster cannot serve at all (no survivor, or a plan that does not fit)."""


class ElectionError(NcmError):
    """An orchestrator cannot be chosen (e.g. an empty membership)."""


class WireError(NcmError, ValueError):
    """A message from a peer is malformed (bad frame, bad TXT record, bad signature...)."""


class AuthError(WireError):
    """A peer request or answer is not signed with the cluster key: the peer is no member."""


class StaleRequestError(AuthError):
    """A correctly signed request that is stale, a replay or meant for another node: the
    sender is a member, the request is refused."""


class PresetError(NcmError):
    """The presets file or a preset value is invalid."""
