"""Public errors in the OpenAI shape (agent/http/errors_shape.py), read by aiohttp's client from a
real application on loopback whose handlers raise the errors of agent/core/errors.py behind the
`openai_errors` middleware: each public error answers as its class says (status, type, param,
code, message, Retry-After), any other failure is a 500 that shows nothing of it, aiohttp's own
4xx (unknown paths, methods, bodies too large) get the same shape, and `error_response` /
`answer_error` write exactly what they are given. The answers themselves (the table of
statuses and codes) are `tests/agent/core/test_errors.py`'s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core.errors import (
    AuthError,
    CapacityError,
    ClusterError,
    InvalidNodeError,
    InvalidRequestError,
    InviteError,
    InviteNotFoundError,
    KeyChangeRefusedError,
    MemberUnreachable,
    ModelBusyError,
    ModelLoadError,
    ModelNotLoadedError,
    NcmError,
    PresetError,
    PublicAnswer,
    RelayedError,
    RouterError,
    ShardingError,
    TooManyRequestsError,
    UnknownModelError,
    WireError,
)
from agent.dataplane.links import StageError
from agent.http.errors_shape import PUBLIC_ERRORS, answer_error, error_response, openai_errors
from tests.agent.inprocess import Loop, serving

MAX_BODY = 1024
TIMEOUT = aiohttp.ClientTimeout(total=10)


# --- the application ------------------------------------------------------------------------------
# (error raised, status, type, param, code, message, Retry-After)
PUBLIC = [
    (InvalidRequestError("'temperature' must be a number", "temperature"), 400, "invalid_request_error",
     "temperature", "invalid_request", "'temperature' must be a number", None),
    (InvalidRequestError("the prompt is too long", "messages", "context_length_exceeded"), 400,
     "invalid_request_error", "messages", "context_length_exceeded", "the prompt is too long", None),
    (InvalidRequestError("pulling failed", "model", status=502), 502, "server_error", "model", "invalid_request",
     "pulling failed", None),
    (StageError("bad_request", "step 3 is malformed", None), 400, "invalid_request_error", None, "bad_request",
     "step 3 is malformed", None),
    (StageError("stage_failed", "node-2 at https://10.0.0.7:41000 stopped answering", "node-2"), 503,
     "service_unavailable", None, "stage_failed", "node-2 at (a node) stopped answering (retry in a moment)", "2"),
    (UnknownModelError("gpt-9", ["tiny-b", "tiny"]), 404, "invalid_request_error", "model", "model_not_found",
     "model 'gpt-9' does not exist; known models: tiny, tiny-b", None),
    (ModelNotLoadedError("model 'b' is unloaded"), 400, "invalid_request_error", "model", "model_not_loaded",
     "model 'b' is unloaded", None),
    (ModelBusyError("model 'b' is serving"), 409, "invalid_request_error", "model", "model_busy",
     "model 'b' is serving", None),
    (CapacityError("does not fit now", 30.0), 503, "service_unavailable", None, "model_capacity", "does not fit now",
     "30"),
    (CapacityError("does not fit at all", None), 503, "service_unavailable", None, "model_capacity",
     "does not fit at all", None),
    (ModelLoadError("loading b failed"), 503, "service_unavailable", None, "model_load_failed",
     "loading b failed; retry the request to load it again", "5"),
    (ModelLoadError("no node stores b", None), 503, "service_unavailable", None, "model_load_failed",
     "no node stores b", None),
    (TooManyRequestsError("model 'b' is busy", 7), 429, "requests", None, "rate_limit_exceeded",
     "model 'b' is busy", "7"),
    (RouterError("the router stopped"), 503, "service_unavailable", None, "model_unavailable", "the router stopped",
     "5"),
    (PresetError("line 3: bad key"), 400, "invalid_request_error", None, "invalid_presets",
     "the model presets are invalid: line 3: bad key", None),
    (ClusterError("no survivor"), 503, "service_unavailable", None, "cluster_unavailable", "no survivor", "5"),
    (InviteError("wrong invite secret"), 403, "invalid_request_error", None, "invite_refused", "wrong invite secret",
     None),
    (InviteNotFoundError("no open invite abc"), 404, "invalid_request_error", None, "invite_not_found",
     "no open invite abc", None),
    (KeyChangeRefusedError("NCM_CLUSTER_KEY is set"), 409, "invalid_request_error", None, "key_change_refused",
     "NCM_CLUSTER_KEY is set", None),
    (MemberUnreachable("the member did not answer"), 503, "service_unavailable", None, "member_unreachable",
     "the member did not answer", "10"),
    (RelayedError(PublicAnswer(429, "rate_limit_exceeded", "node-2 is busy", "model", 3.0)), 429, "requests",
     "model", "rate_limit_exceeded", "node-2 is busy", "3"),
    (RelayedError(PublicAnswer(400, "invalid_request", "'input' is empty", "input")), 400, "invalid_request_error",
     "input", "invalid_request", "'input' is empty", None),
]
# Failures that are no public error: a 500 that shows nothing of them.
PRIVATE = [RuntimeError("a bug at 10.0.0.7:41000"), KeyError("secret-key-material"), NcmError("an agent bug"),
           WireError("bad frame from node-3"), AuthError("not signed with key 1234"), InvalidNodeError("bad node"),
           ShardingError("too many nodes")]


def application() -> web.Application:
    """Handlers raising each error above by its index, and a few of aiohttp's exceptions."""
    async def public(request: web.Request) -> web.Response:
        raise PUBLIC[int(request.match_info["index"])][0]

    async def private(request: web.Request) -> web.Response:
        raise PRIVATE[int(request.match_info["index"])]

    async def http_error(request: web.Request) -> web.Response:
        kind = request.match_info["kind"]
        if kind == "forbidden":
            raise web.HTTPForbidden(text="the text of a plain HTTP error")
        if kind == "reason":
            raise web.HTTPNotFound(reason="no dashboard file 'x.js'")
        if kind == "json":
            raise web.HTTPConflict(text='{"answer": "already shaped"}', content_type="application/json")
        if kind == "redirect":
            raise web.HTTPFound("/elsewhere")
        raise web.HTTPTooManyRequests()

    async def shaped(request: web.Request) -> web.Response:
        """error_response with what the body says."""
        body = await request.json()
        return error_response(body["status"], body["message"], type_=body.get("type"), param=body.get("param"),
                              code=body.get("code"), headers=body.get("headers"))

    async def answered(request: web.Request) -> web.Response:
        """answer_error of a capacity refusal with the Retry-After the query says."""
        retry = request.query.get("retry")
        return answer_error(CapacityError("full", None if retry is None else float(retry)))

    async def upload(request: web.Request) -> web.Response:
        return web.json_response({"bytes": len(await request.read())})

    app = web.Application(middlewares=[openai_errors], client_max_size=MAX_BODY)
    app.router.add_get("/public/{index}", public)
    app.router.add_get("/private/{index}", private)
    app.router.add_get("/http/{kind}", http_error)
    app.router.add_post("/shaped", shaped)
    app.router.add_get("/answered", answered)
    app.router.add_post("/upload", upload)
    return app


class Server:
    def __init__(self, loop: Loop, url: str) -> None:
        self.loop, self.url = loop, url

    def request(self, method: str, path: str, **kwargs: Any) -> tuple[int, dict[str, str], str]:
        async def go() -> tuple[int, dict[str, str], str]:
            async with aiohttp.ClientSession(timeout=TIMEOUT) as session, \
                    session.request(method, self.url + path, allow_redirects=False, **kwargs) as response:
                return response.status, dict(response.headers), await response.text()

        return self.loop.run(go())


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    loop = Loop()
    try:
        yield Server(loop, loop.enter(serving(application())))
    finally:
        loop.close()


def error_of(status: int, text: str, content_type: str) -> dict[str, Any]:
    """The ``error`` object of an answer, which must be exactly the OpenAI shape."""
    assert content_type.startswith("application/json"), (status, content_type, text)
    body = json.loads(text)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# --- public errors ----------------------------------------------------------------------------------
def test_every_kind_of_public_error_is_in_the_table():
    assert {type(case[0]) for case in PUBLIC} >= set(PUBLIC_ERRORS)
    assert all(isinstance(case[0], PUBLIC_ERRORS) for case in PUBLIC)
    assert not any(isinstance(error, PUBLIC_ERRORS) for error in PRIVATE)


@pytest.mark.parametrize("index", range(len(PUBLIC)), ids=[type(case[0]).__name__ for case in PUBLIC])
def test_a_public_error_answers_as_its_class_says_in_the_openai_shape(server, index):
    _, status, kind, param, code, message, retry_after = PUBLIC[index]
    got, headers, text = server.request("GET", f"/public/{index}")
    assert got == status, text
    assert error_of(got, text, headers["Content-Type"]) == {"message": message, "type": kind, "param": param,
                                                             "code": code}
    assert headers.get("Retry-After") == retry_after


@pytest.mark.parametrize("index", range(len(PRIVATE)), ids=[type(error).__name__ for error in PRIVATE])
def test_any_other_failure_is_a_500_that_shows_nothing_of_it(server, index):
    status, _, text = server.request("GET", f"/private/{index}")
    assert status == 500
    for secret in ("10.0.0.7", "secret-key-material", "agent bug", "node-3", "1234", "bad node", "too many nodes"):
        assert secret not in text


def test_the_application_serves_on_after_its_handlers_failed(server):
    for index in range(len(PRIVATE)):
        assert server.request("GET", f"/private/{index}")[0] == 500
    status, headers, text = server.request("GET", "/public/0")
    assert status == 400 and error_of(status, text, headers["Content-Type"])["param"] == "temperature"


# --- aiohttp's own errors ---------------------------------------------------------------------------
def test_an_unknown_path_is_a_404_in_the_openai_shape(server):
    status, headers, text = server.request("GET", "/no/such/path")
    assert status == 404
    assert error_of(status, text, headers["Content-Type"]) == {"message": "Not Found", "type": "invalid_request_error",
                                                               "param": None, "code": "404"}


def test_a_plain_http_error_raised_by_a_handler_gets_its_status_and_reason(server):
    status, headers, text = server.request("GET", "/http/forbidden")
    assert status == 403 and error_of(status, text, headers["Content-Type"]) == {  # its own text, when it has one
        "message": "the text of a plain HTTP error", "type": "invalid_request_error", "param": None, "code": "403"}
    status, headers, text = server.request("GET", "/http/reason")
    assert status == 404 and error_of(status, text, headers["Content-Type"])["message"] == "no dashboard file 'x.js'"
    status, headers, text = server.request("GET", "/http/too-many")
    assert status == 429 and error_of(status, text, headers["Content-Type"]) == {
        "message": "Too Many Requests", "type": "requests", "param": None, "code": "429"}


def test_a_json_http_error_and_a_redirect_pass_as_they_are(server):
    status, headers, text = server.request("GET", "/http/json")
    assert status == 409 and json.loads(text) == {"answer": "already shaped"}
    status, headers, text = server.request("GET", "/http/redirect")
    assert status == 302 and headers["Location"] == "/elsewhere" and "error" not in text


def test_a_wrong_method_and_a_body_too_large_get_the_openai_shape(server):
    status, headers, text = server.request("DELETE", "/public/0")
    assert status == 405 and error_of(status, text, headers["Content-Type"])["code"] == "405"
    status, headers, text = server.request("POST", "/upload", data=b"x" * (MAX_BODY + 1))
    assert status == 413
    error = error_of(status, text, headers["Content-Type"])
    assert error["code"] == "413" and f"size {MAX_BODY} exceeded" in error["message"] and error["param"] is None
    status, _, text = server.request("POST", "/upload", data=b"x" * MAX_BODY)
    assert status == 200 and json.loads(text) == {"bytes": MAX_BODY}


def test_a_405_still_says_which_methods_are_allowed(server):
    status, headers, _ = server.request("DELETE", "/public/0")
    assert status == 405 and "GET" in headers.get("Allow", "").split(",")


def test_a_client_error_is_never_typed_a_server_error(server):
    for method, path, kwargs in (("DELETE", "/public/0", {}), ("POST", "/upload", {"data": b"x" * (MAX_BODY + 1)})):
        status, headers, text = server.request(method, path, **kwargs)
        assert 400 <= status < 500 and error_of(status, text, headers["Content-Type"])["type"] != "server_error"


# --- error_response and answer_error ---------------------------------------------------------------
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "invalid_request_error",
         404: "invalid_request_error", 409: "invalid_request_error", 429: "requests", 503: "service_unavailable"}
STATUSES = st.sampled_from([400, 401, 403, 404, 409, 413, 422, 429, 500, 502, 503, 504])
OPTIONAL_TEXT = st.none() | st.text(max_size=40)


@settings(max_examples=60, deadline=None)
@given(status=STATUSES, message=st.text(max_size=200), param=OPTIONAL_TEXT, code=OPTIONAL_TEXT,
       type_=st.none() | st.sampled_from(["invalid_request_error", "server_error", "custom"]))
def test_error_response_writes_what_it_is_given_with_the_type_of_its_status(server, status, message, param, code,
                                                                             type_):
    body = {"status": status, "message": message, "param": param, "code": code, "type": type_}
    got, headers, text = server.request("POST", "/shaped", json=body)
    assert got == status
    assert error_of(got, text, headers["Content-Type"]) == {
        "message": message, "param": param, "code": code,
        "type": type_ or TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")}
    assert "Retry-After" not in headers


def test_error_response_adds_the_headers_it_is_given(server):
    body = {"status": 429, "message": "slow down", "code": "rate_limit_exceeded", "headers": {"Retry-After": "12"}}
    status, headers, text = server.request("POST", "/shaped", json=body)
    assert status == 429 and headers["Retry-After"] == "12"
    assert error_of(status, text, headers["Content-Type"]) == {"message": "slow down", "type": "requests",
                                                               "param": None, "code": "rate_limit_exceeded"}


@pytest.mark.parametrize("retry, header", [(None, None), ("0", None), ("1", "1"), ("30", "30"), ("7.0", "7"),
                                           ("90.4", "91"), ("3600", "3600")])  # rounded up: never sooner than said
def test_answer_error_gives_retry_after_in_whole_seconds_only_when_there_is_a_delay(server, retry, header):
    status, headers, text = server.request("GET", "/answered" + ("" if retry is None else f"?retry={retry}"))
    assert status == 503 and headers.get("Retry-After") == header
    assert error_of(status, text, headers["Content-Type"]) == {
        "message": "full", "type": "service_unavailable", "param": None, "code": "model_capacity"}
