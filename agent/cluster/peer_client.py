"""Signed HTTP calls to other agents' internal endpoints, and the check of their answers."""

from __future__ import annotations

import asyncio
import json
import secrets
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
from yarl import URL

from agent.core.auth import HEADER_NONCE, sign, verify_answer
from agent.core.errors import AuthError, NcmError, StaleRequestError
from agent.local.compat import timeout

USER_AGENT = "ncm-agent"


class PeerError(NcmError):
    """A peer did not answer, answered late or answered with an error."""

    def __init__(self, url: str, message: str, status: int | None = None, answer: Any = None) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.status = status
        self.peer_answer = answer  # the peer's JSON error answer, when it sent one


class PeerAuthError(PeerError):
    """The peer cannot prove it holds the cluster key: it is no member, whatever it says."""


class PeerClient:
    """One pooled aiohttp session for every call to peers' internal endpoints: over TLS with
    this node's certificate (``ssl_context``; the peer must show one of the cluster's CA),
    every call with a timeout, every request signed for the node it is meant for and every
    answer signed by it."""

    def __init__(self, session: aiohttp.ClientSession, key: bytes, node_id: str,
                 ssl_context: ssl.SSLContext | None, clock: Callable[[], float] = time.time) -> None:
        self.session = session
        self.key = key
        self.node_id = node_id
        self.ssl = ssl_context
        self.clock = clock  # wall-clock seconds that sign requests

    def signed_request(self, method: str, base_url: str, path: str, body: bytes = b"", *,
                       target: str) -> tuple[URL, dict[str, str]]:
        """The URL to call and the headers that sign the request for node ``target``."""
        url = URL(base_url.rstrip("/") + path)
        headers = sign(self.key, method, url.raw_path_qs, body, now=self.clock(), nonce=secrets.token_hex(12),
                       node_id=self.node_id, target=target)
        return url, headers

    def check_answer(self, url: Any, sent: Mapping[str, str], status: int, headers: Mapping[str, str],
                     body: bytes | None, *, target: str) -> str:
        """The node that answered the request signed with headers ``sent``; raises
        :class:`PeerAuthError` when the answer is not signed with the cluster key."""
        try:
            return verify_answer(self.key, headers, nonce=sent[HEADER_NONCE], status=status, body=body,
                                 responder=target)
        except StaleRequestError as error:
            raise PeerError(str(url), str(error), status) from None
        except AuthError as error:
            raise PeerAuthError(str(url), str(error), status) from None

    async def request_json(
        self, method: str, base_url: str, path: str, payload: Any = None, *, target: str, timeout_s: float
    ) -> Any:
        """Call an internal endpoint of node ``target`` (:data:`ANY_NODE` for a first contact)."""
        answer, _ = await self.request_json_from(method, base_url, path, payload, target=target, timeout_s=timeout_s)
        return answer

    async def request_json_from(
        self, method: str, base_url: str, path: str, payload: Any = None, *, target: str, timeout_s: float
    ) -> tuple[Any, str]:
        """:meth:`request_json`, and the id of the node that answered."""
        body = b"" if payload is None else json.dumps(payload).encode()
        url, headers = self.signed_request(method, base_url, path, body, target=target)
        if payload is not None:
            headers["Content-Type"] = "application/json"
        try:
            async with self.session.request(
                method, url, data=body or None, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s),
                ssl=self.ssl,
            ) as response:
                raw = await response.read()
                responder = self.check_answer(url, headers, response.status, response.headers, raw, target=target)
                if response.status >= 400:
                    raise PeerError(str(url), f"HTTP {response.status}: {raw[:300].decode(errors='replace')}",
                                    response.status, _json_or_none(raw))
                return (json.loads(raw) if raw else None), responder
        except asyncio.TimeoutError:
            raise PeerError(str(url), f"no answer within {timeout_s:g} s") from None
        except aiohttp.ClientSSLError as error:
            raise PeerAuthError(str(url), f"no TLS certificate of this cluster: {error}") from None
        except (aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError, OSError) as error:
            raise PeerError(str(url), f"{type(error).__name__}: {error}") from None

    async def ws_connect(self, base_url: str, path: str, *, target: str,
                         timeout_s: float) -> aiohttp.ClientWebSocketResponse:
        """A WebSocket to node ``target``, whose first message proves the node holds the key."""
        url, headers = self.signed_request("GET", base_url, path, target=target)
        ws: aiohttp.ClientWebSocketResponse | None = None
        try:
            async with timeout(timeout_s):
                ws = await self.session.ws_connect(
                    url, headers=headers, timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=timeout_s),
                    max_msg_size=0, compress=0, ssl=self.ssl,
                )
                hello = await ws.receive()
            if hello.type != aiohttp.WSMsgType.TEXT:
                raise PeerError(str(url), f"the data plane closed before the node proved it is a member ({hello.type.name})")
            proof = json.loads(hello.data)
            if not isinstance(proof, dict):
                proof = {}
            self.check_answer(url, headers, 101, {k: str(v) for k, v in proof.items()}, None, target=target)
            return ws
        except asyncio.TimeoutError:
            failure: PeerError = PeerError(str(url), f"no connection within {timeout_s:g} s")
        except aiohttp.ClientSSLError as error:
            failure = PeerAuthError(str(url), f"no TLS certificate of this cluster: {error}")
        except (aiohttp.ClientError, OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
            failure = PeerError(str(url), f"{type(error).__name__}: {error}")
        except PeerError as error:
            failure = error
        if ws is not None:
            await ws.close()
        raise failure


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
