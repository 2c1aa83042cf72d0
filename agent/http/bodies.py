"""Reading a request's body: decompressed, within :data:`BODY_READ_TIMEOUT_S`, and as JSON with
a clear 400 when it is not."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from agent.core.errors import (
    InvalidRequestError,
)
from agent.local.compat import timeout

log = logging.getLogger(__name__)


BODY_READ_TIMEOUT_S = 30.0


async def read_body(request: web.Request) -> bytes:
    """The request body as sent, decompressed (a body that does not decompress is a 400)."""
    try:
        async with timeout(BODY_READ_TIMEOUT_S):  # a truncated compressed body can leave the read waiting
            return await request.read()
    except asyncio.TimeoutError:
        raise InvalidRequestError(f"the request body did not arrive in full within {BODY_READ_TIMEOUT_S:g} s") from None
    except (RequestPayloadError, HttpProcessingError):
        raise InvalidRequestError(
            f"the request body could not be read as {request.headers.get('Content-Encoding', 'sent')}") from None


async def read_json(request: web.Request) -> Any:
    """The body as JSON: UTF-8 whatever charset is declared (JSON's encoding), no unpaired
    surrogates, nesting and numbers that the parser takes without running out of stack."""
    raw = await read_body(request)
    try:
        body = json.loads(raw.decode("utf-8"))
        json.dumps(body, ensure_ascii=False).encode("utf-8")  # unpaired surrogates (\ud800) cannot be text
    except UnicodeError:
        raise InvalidRequestError("the request body must be UTF-8 JSON text without unpaired surrogates") from None
    except RecursionError:
        raise InvalidRequestError("the request body nests too deeply") from None
    except ValueError as error:  # JSONDecodeError, or an integer of more digits than allowed
        raise InvalidRequestError(f"the request body is not valid JSON ({str(error)[:80]})") from None
    return body
