"""Signed HTTP calls to other agents' internal endpoints."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any

import aiohttp

from agent.core.auth import sign
from agent.core.errors import NcmError

USER_AGENT = "ncm-agent"


class PeerError(NcmError):
    """A peer did not answer, answered late or answered with an error."""

    def __init__(self, url: str, message: str, status: int | None = None) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.status = status


class PeerClient:
    """One pooled aiohttp session for every call to peers; every call has a timeout."""

    def __init__(self, session: aiohttp.ClientSession, key: bytes, node_id: str) -> None:
        self.session = session
        self.key = key
        self.node_id = node_id

    def signed_headers(self, method: str, path: str, body: bytes = b"") -> dict[str, str]:
        return sign(self.key, method, path, body, now=time.time(), nonce=secrets.token_hex(12), node_id=self.node_id)

    async def request_json(
        self, method: str, base_url: str, path: str, payload: Any = None, *, timeout_s: float
    ) -> Any:
        body = b"" if payload is None else json.dumps(payload).encode()
        headers = self.signed_headers(method, path, body)
        if payload is not None:
            headers["Content-Type"] = "application/json"
        url = base_url.rstrip("/") + path
        try:
            async with self.session.request(
                method, url, data=body or None, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as response:
                text = await response.text()
                if response.status >= 400:
                    raise PeerError(url, f"HTTP {response.status}: {text[:300]}", response.status)
                return json.loads(text) if text else None
        except TimeoutError:
            raise PeerError(url, f"no answer within {timeout_s:g} s") from None
        except (aiohttp.ClientError, json.JSONDecodeError, OSError) as error:
            raise PeerError(url, f"{type(error).__name__}: {error}") from None

    async def ws_connect(self, base_url: str, path: str, *, timeout_s: float) -> aiohttp.ClientWebSocketResponse:
        url = base_url.rstrip("/") + path
        try:
            async with asyncio.timeout(timeout_s):
                return await self.session.ws_connect(
                    url,
                    headers=self.signed_headers("GET", path),
                    timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=timeout_s),
                    max_msg_size=0,
                    compress=0,
                )
        except TimeoutError:
            raise PeerError(url, f"no connection within {timeout_s:g} s") from None
        except (aiohttp.ClientError, OSError) as error:
            raise PeerError(url, f"{type(error).__name__}: {error}") from None
