"""agent.cli.http_client: the command line's blocking JSON calls against a real aiohttp server on
loopback (what it sends, what it returns, every failure as an NcmError that names the URL), and
the admin token of this device's cluster read from real configuration and state files."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from agent.cli.http_client import http_json, local_admin_token
from agent.core.auth import admin_token
from agent.core.errors import NcmError
from agent.local.config import CLUSTER_KEY_FILE, ENV_PREFIX, write_config_file

TIMEOUT_S = 10.0
KEY = "test-cluster-key-0123456789"


async def echo(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response({"method": request.method, "path": request.path_qs,
                              "authorization": request.headers.get("Authorization"),
                              "content_type": request.headers.get("Content-Type"),
                              "body": json.loads(body) if body else None})


def answering(status: int, body: bytes, reason: str | None = None) -> Callable[[web.Request], Any]:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=status, body=body, reason=reason, content_type="application/json")
    return handler


@contextlib.asynccontextmanager
async def server() -> AsyncIterator[str]:
    """An aiohttp server on a loopback port; yields its base URL."""
    app = web.Application()
    app.router.add_route("*", "/echo", echo)
    app.router.add_get("/empty", answering(200, b""))
    app.router.add_get("/busy", answering(409, b'{"error": {"message": "model busy", "code": "model_busy"}}'))
    app.router.add_get("/plain-error", answering(500, b"oops, not json"))
    app.router.add_get("/string-error", answering(400, b'{"error": "boom"}'))
    app.router.add_get("/other-error", answering(404, b'{"detail": "no such thing"}'))
    app.router.add_get("/warming", answering(503, b"", reason="Warming Up"))
    app.router.add_get("/html", answering(200, b"<html>a login page</html>"))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await asyncio.wait_for(runner.cleanup(), TIMEOUT_S)


async def call(*args: Any, **kwargs: Any) -> Any:
    """:func:`http_json` off the event loop that serves it."""
    return await asyncio.wait_for(asyncio.to_thread(http_json, *args, **kwargs), TIMEOUT_S * 2)


def test_a_call_sends_json_and_the_token_and_returns_the_parsed_answer() -> None:
    async def scenario() -> None:
        async with server() as base:
            answer = await call("POST", base + "/echo?x=1", {"model": "m", "n": [1, 2.5, None]}, token="secret-1")
            assert answer == {"method": "POST", "path": "/echo?x=1", "authorization": "Bearer secret-1",
                              "content_type": "application/json", "body": {"model": "m", "n": [1, 2.5, None]}}
            answer = await call("DELETE", base + "/echo")
            assert answer["method"] == "DELETE" and answer["authorization"] is None and answer["body"] is None
            assert (await call("GET", base + "/echo", token=""))["authorization"] is None  # empty: no header
            assert await call("GET", base + "/empty") is None

    asyncio.run(scenario())


@pytest.mark.parametrize(("path", "message"), [
    ("/busy", "HTTP 409: model busy"),  # the API's own error message
    ("/plain-error", "HTTP 500: Internal Server Error"),  # else the status' reason
    ("/string-error", "HTTP 400: Bad Request"),
    ("/other-error", "HTTP 404: Not Found"),
    ("/warming", "HTTP 503: Warming Up"),
])
def test_an_error_answer_names_the_url_the_status_and_the_reason(path: str, message: str) -> None:
    async def scenario() -> None:
        async with server() as base:
            with pytest.raises(NcmError) as caught:
                await call("GET", base + path)
            assert str(caught.value) == f"{base}{path}: {message}"
            assert caught.value.__cause__ is None and caught.value.__suppress_context__

    asyncio.run(scenario())


def test_a_server_that_is_not_there_is_an_error_naming_the_url() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/health"
        with pytest.raises(NcmError, match="Connection refused") as caught:
            http_json("GET", url)
    assert str(caught.value).startswith(f"cannot reach {url}: ")


def test_a_server_that_never_answers_is_an_error_after_the_timeout() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # connections complete in the kernel's backlog; no answer ever comes
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/health"
        started = time.monotonic()
        with pytest.raises(NcmError) as caught:
            http_json("GET", url, timeout_s=0.3)
        assert 0.3 <= time.monotonic() - started < TIMEOUT_S
    assert str(caught.value) == f"cannot reach {url}: timed out"


def test_a_200_answer_that_is_not_json_is_an_ncm_error() -> None:
    async def scenario() -> None:
        async with server() as base:
            with pytest.raises(NcmError, match="/html"):
                await call("GET", base + "/html")

    asyncio.run(scenario())


def test_a_server_that_does_not_speak_http_is_an_ncm_error() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(TIMEOUT_S)

        def greet() -> None:  # an SSH server, say, on the port the user typed
            connection, _ = listener.accept()
            with connection:
                connection.recv(4096)
                connection.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")

        thread = threading.Thread(target=greet, daemon=True)
        thread.start()
        try:
            with pytest.raises(NcmError):
                http_json("GET", f"http://127.0.0.1:{listener.getsockname()[1]}/health", timeout_s=TIMEOUT_S)
        finally:
            thread.join(TIMEOUT_S)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No NCM_* setting of the machine running the tests, and a home of this test's own."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    monkeypatch.setenv("NCM_HOME", str(tmp_path / "home"))


def config_file(tmp_path: Path, **values: Any) -> Path:
    path = tmp_path / "agent.toml"
    write_config_file(path, {"cluster_name": "home", "state_dir": str(tmp_path / "state"), **values})
    return path


def test_the_admin_token_is_derived_from_the_configured_key(tmp_path: Path, clean_env: None) -> None:
    path = config_file(tmp_path, cluster_key=KEY)
    token = local_admin_token(path)
    assert token == admin_token(KEY.encode()) and token.startswith("ncm-admin-")
    assert local_admin_token(path, create=True) == token
    assert not (tmp_path / "state" / CLUSTER_KEY_FILE).exists()  # a configured key is never written out


def test_without_a_configured_key_the_stored_one_counts(tmp_path: Path, clean_env: None) -> None:
    path = config_file(tmp_path)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / CLUSTER_KEY_FILE).write_text("stored-key-of-this-device-0123\n")
    assert local_admin_token(path) == admin_token(b"stored-key-of-this-device-0123")


def test_a_key_is_generated_only_when_asked_and_then_kept(tmp_path: Path, clean_env: None) -> None:
    path = config_file(tmp_path)
    key_file = tmp_path / "state" / CLUSTER_KEY_FILE
    assert local_admin_token(path) is None
    assert not key_file.exists()
    token = local_admin_token(path, create=True)
    key = key_file.read_text().strip()
    assert len(key) == 64 and int(key, 16) >= 0
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert token == admin_token(key.encode())
    assert local_admin_token(path) == token and local_admin_token(path, create=True) == token
    assert key_file.read_text().strip() == key


def test_an_unreadable_configuration_is_no_token_or_an_error_when_one_is_needed(tmp_path: Path,
                                                                             clean_env: None) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("cluster_key = [unclosed\n")
    assert local_admin_token(broken) is None
    with pytest.raises(NcmError, match="^cannot read this device's cluster key: config file .* is not valid TOML"):
        local_admin_token(broken, create=True)
    assert local_admin_token(tmp_path / "missing.toml") is None
    with pytest.raises(NcmError, match="does not exist"):
        local_admin_token(tmp_path / "missing.toml", create=True)
    invalid = config_file(tmp_path, cluster_key="short")
    assert local_admin_token(invalid) is None
    with pytest.raises(NcmError, match="cluster_key"):
        local_admin_token(invalid, create=True)


def test_a_key_file_this_user_cannot_read_is_no_token(tmp_path: Path, clean_env: None) -> None:
    path = config_file(tmp_path)
    (tmp_path / "state" / CLUSTER_KEY_FILE).mkdir(parents=True)  # not a file: reading it fails
    assert local_admin_token(path) is None
    with pytest.raises(NcmError, match="^cannot read this device's cluster key: .*Is a directory"):
        local_admin_token(path, create=True)
