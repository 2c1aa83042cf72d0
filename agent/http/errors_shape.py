"""Public errors in the OpenAI shape, {"error": {"message", "type", "param", "code"}}: each
error answers as its class says (:meth:`agent.core.errors.NcmError.answer`), and the middleware
gives every public endpoint that answer (any other failure is a 500)."""

from __future__ import annotations

import logging
import math
from typing import Any

from aiohttp import web

from agent.core.errors import (
    ClusterError,
    InvalidRequestError,
    InviteError,
    NcmError,
    PresetError,
    PublicAnswer,
    RelayedError,
    RouterError,
)
from agent.dataplane.links import StageError

log = logging.getLogger(__name__)


def error_response(status: int, message: str, *, type_: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    kind = type_ or PublicAnswer(status, code or "", message).kind
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}},
                             status=status, headers=headers)


def answer_error(error: NcmError) -> web.Response:
    """The OpenAI-shaped answer of ``error``: what its class says (:meth:`NcmError.answer`)."""
    answer = error.answer()
    headers = {"Retry-After": str(math.ceil(answer.retry_after_s))} if answer.retry_after_s else None  # never sooner
    return error_response(answer.status, answer.message, param=answer.param, code=answer.code, headers=headers)


# The errors a public endpoint answers with their own answer; any other is a 500.
PUBLIC_ERRORS = (InvalidRequestError, StageError, RouterError, PresetError, ClusterError, InviteError, RelayedError)


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Turn every failure of a public endpoint into the OpenAI error shape."""
    try:
        return await handler(request)
    except PUBLIC_ERRORS as error:
        return answer_error(error)
    except web.HTTPException as error:
        if error.status >= 400 and error.content_type != "application/json":
            kept = {k: v for k, v in error.headers.items() if k in ("Allow", "Retry-After")}  # 405 says what is allowed
            message = error.text if error.text and error.text != f"{error.status}: {error.reason}" else error.reason
            return error_response(error.status, message or "error", code=str(error.status), headers=kept or None)
        raise
