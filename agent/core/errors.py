"""Errors of the agent: one base, one subclass per kind of problem, each knowing how the public
API answers it (:meth:`NcmError.answer`: HTTP status, public code and field, message, and
Retry-After). Every public and internal handler answers from these classes, so one table
says what a caller reads (docs/api.md lists it).

Caller errors (bad input) and cluster errors (a device failed) are distinct classes so
that the service never answers a caller's mistake with a failover.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

RETRY_AFTER_LOAD_S = 5.0  # a model that failed to load may be asked again this soon
# What a public error must not show: URLs, and IPv4 / IPv6 addresses with a port.
_ADDRESS = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s,;'\"()]+|\b\d{1,3}(?:\.\d{1,3}){3}:\d+\b|\[[0-9a-fA-F:]+\]:\d+"
                      r"|\('[0-9a-fA-F.:]+', \d+\)")  # also Python's (host, port) tuples
_TLS_CONTEXT = re.compile(r" ?ssl:<[^>]*>")  # aiohttp's connection errors show the TLS context object


def without_addresses(text: str) -> str:
    """``text`` without the network addresses of nodes (what a public error must not show)."""
    return _ADDRESS.sub("(a node)", _TLS_CONTEXT.sub("", text))


@dataclass(frozen=True)
class PublicAnswer:
    """What a caller reads of an error: the HTTP status, a stable code, the field at fault,
    the message, and when to try again (None: no Retry-After)."""

    status: int
    code: str
    message: str
    param: str | None = None
    retry_after_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        """An internal endpoint's refusal, as a member reads it back (:meth:`from_json`)."""
        return {"error": self.message, "code": self.code, "param": self.param, "retry_after_s": self.retry_after_s}

    @classmethod
    def from_json(cls, status: int, body: Any) -> PublicAnswer | None:
        """The answer a member sent with ``status`` (None: ``body`` is no such answer)."""
        if not isinstance(body, dict) or not isinstance(body.get("error"), str) or not isinstance(body.get("code"), str):
            return None
        param, retry_after_s = body.get("param"), body.get("retry_after_s")
        return cls(status, body["code"], body["error"], param if isinstance(param, str) else None,
                   float(retry_after_s) if isinstance(retry_after_s, (int, float)) and not isinstance(retry_after_s, bool)
                   else None)

    @property
    def kind(self) -> str:
        """The OpenAI error ``type`` of this status."""
        return {400: "invalid_request_error", 401: "authentication_error", 403: "invalid_request_error",
                404: "invalid_request_error", 409: "invalid_request_error", 429: "requests",
                503: "service_unavailable"}.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")


class NcmError(Exception):
    """Base of every error raised by ``agent``. A subclass sets how it is answered: its
    ``http_status``, ``public_code``, ``public_param`` and ``default_retry_after_s`` (used
    when the error carries no ``retry_after_s`` of its own)."""

    http_status = 500
    public_code = "internal_error"
    public_param: str | None = None
    default_retry_after_s: float | None = None

    def public_message(self) -> str:
        return str(self)

    def answer(self) -> PublicAnswer:
        return PublicAnswer(self.http_status, self.public_code, self.public_message(), self.public_param,
                            self.__dict__.get("retry_after_s", self.default_retry_after_s))


class InvalidNodeError(NcmError, ValueError):
    """A node description is malformed (missing field, negative memory, bad load...)."""

    http_status, public_code = 400, "invalid_node"


class ShardingError(NcmError):
    """The layers cannot be split over the nodes as asked (e.g. too many nodes for the minimum)."""


class RoutingFailure(NcmError):
    """Some layer has no live holder and no fallback model is allowed."""


class ClusterError(NcmError):
    """The cluster cannot serve at all (no survivor, or a plan that does not fit)."""

    http_status, public_code, default_retry_after_s = 503, "cluster_unavailable", 5.0


class ElectionError(NcmError):
    """An orchestrator cannot be chosen (e.g. an empty membership)."""


class WireError(NcmError, ValueError):
    """A message from a peer is malformed (bad frame, bad TXT record, bad signature...)."""

    http_status, public_code = 400, "malformed_message"


class AuthError(WireError):
    """A peer request or answer is not signed with the cluster key: the peer is no member."""

    http_status, public_code = 401, "bad_cluster_key"


class StaleRequestError(AuthError):
    """A correctly signed request that is stale, a replay or meant for another node: the
    sender is a member, the request is refused."""

    public_code = "stale_request"


class PresetError(NcmError):
    """The presets file or a preset value is invalid."""

    http_status, public_code = 400, "invalid_presets"

    def public_message(self) -> str:
        return f"the model presets are invalid: {self}"


class InvalidRequestError(NcmError, ValueError):
    """A caller's request is malformed; ``param`` names the offending field (its own status
    and code where the table's 400 does not fit)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status

    def answer(self) -> PublicAnswer:
        return PublicAnswer(self.status, self.code or "invalid_request", str(self), self.param)


class RelayedError(NcmError):
    """What another node answered for work it did for this one (an embedding model the router
    placed there): the caller reads that node's answer as it was."""

    def __init__(self, answer: PublicAnswer) -> None:
        super().__init__(answer.message)
        self.relayed = answer

    def answer(self) -> PublicAnswer:
        return self.relayed


# --- the model router (design §10) ---------------------------------------------------------------
class RouterError(NcmError):
    """The model router cannot serve the request."""

    http_status, public_code, default_retry_after_s = 503, "model_unavailable", 5.0


class UnknownModelError(RouterError):
    http_status, public_code, public_param, default_retry_after_s = 404, "model_not_found", "model", None

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.known = tuple(sorted(known))
        super().__init__(f"model {name!r} does not exist; known models: {', '.join(self.known) or 'none'}")


class ModelNotLoadedError(RouterError):
    """Autoload is off and the model is not loaded."""

    http_status, public_code, public_param, default_retry_after_s = 400, "model_not_loaded", "model", None


class ModelBusyError(RouterError):
    """The model cannot be unloaded now: it is serving, loading or waited for."""

    http_status, public_code, public_param, default_retry_after_s = 409, "model_busy", "model", None


class CapacityError(RouterError):
    """The model does not fit now (``retry_after_s`` set) or at all (None)."""

    public_code = "model_capacity"

    def __init__(self, message: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelLoadError(RouterError):
    """Loading (or measuring) the model failed; a new request may try again after
    ``retry_after_s`` (None: not before something changes, the message says what)."""

    public_code = "model_load_failed"

    def __init__(self, message: str, retry_after_s: float | None = RETRY_AFTER_LOAD_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def public_message(self) -> str:
        # Without a Retry-After, retrying cannot help yet: the message says what to do.
        return f"{self}; retry the request to load it again" if self.retry_after_s else str(self)


class AdmissionError(RouterError):
    """A request could not be admitted."""


class TooManyRequestsError(AdmissionError):
    """Every slot of the model is busy and its queue is full: retry after ``retry_after_s``."""

    http_status, public_code = 429, "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


# --- pairing -------------------------------------------------------------------------------------
class InviteError(NcmError):
    """An invite or join string cannot be used; the message says why."""

    http_status, public_code = 403, "invite_refused"


class InviteNotFoundError(InviteError):
    """No open invite has that id (revoking one)."""

    http_status, public_code = 404, "invite_not_found"


class KeyChangeRefusedError(InviteError):
    """This agent cannot take a new cluster key (its environment sets the key or the name)."""

    http_status, public_code = 409, "key_change_refused"


class MemberUnreachable(InviteError):
    """The member a join string names did not answer (try again later)."""

    http_status, public_code, default_retry_after_s = 503, "member_unreachable", 10.0
