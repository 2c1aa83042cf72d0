"""What needs the admin token (agent/http/admin.py): which requests change the cluster or reveal
its invites (`changes_cluster`), the bearer comparison (`bearer_matches`, `holds_admin_token`)
read off a real aiohttp application, and the 401 an in-process agent answers for every such
endpoint without the token, while the token (however its scheme is spelled) reaches the
handler. What `test_app_keys.py` leaves out: the whole table, the invites, the scheme and
the Ollama path's shape of the same 401."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.http.admin import ADMIN_ENDPOINTS, bearer_matches, changes_cluster, holds_admin_token
from agent.http.app_keys import ADMIN_TOKEN, MEMBERSHIP
from tests.agent.agents import ADMIN
from tests.agent.inprocess import LocalAgent, Loop, call, eventually, local_agents, serving, share_calibration

PROBE_TOKEN = "ncm-admin-probe-0123456789"
PROBE_KEYS = ("app-key-one-0123", "app-key-two-4567")
API_KEY = "app-key-0123456789"


def probe_app() -> web.Application:
    """Every request answered with what admin.py says of it."""
    async def report(request: web.Request) -> web.Response:
        return web.json_response({"changes_cluster": changes_cluster(request), "admin": holds_admin_token(request),
                                  "api_key": bearer_matches(request, PROBE_KEYS)})

    app = web.Application()
    app[ADMIN_TOKEN] = PROBE_TOKEN
    app.router.add_route("*", "/{tail:.*}", report)
    return app


class Shared:
    def __init__(self, loop: Loop, probe: str, agent: LocalAgent) -> None:
        self.loop, self.probe, self.agent = loop, probe, agent

    def ask(self, method: str, path: str, headers: dict[str, str] | None = None) -> dict[str, bool]:
        status, answer = self.loop.run(call(method, self.probe + path, headers=headers))
        assert status == 200, answer
        return answer


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    """The probe application and one in-process agent (API keys on), on a loop of their own."""
    loop = Loop()
    try:
        with pytest.MonkeyPatch.context() as patch:
            share_calibration(patch)
            url = loop.enter(serving(probe_app()))
            (agent,) = loop.enter(local_agents(tmp_path_factory.mktemp("admin"), 1, api_keys=(API_KEY,)))
            loop.run(eventually(lambda: agent.app[MEMBERSHIP].election, timeout_s=20, what="an election"))
            yield Shared(loop, url, agent)
    finally:
        loop.close()


# --- which requests change the cluster ----------------------------------------------------------
CHANGES = [*sorted(ADMIN_ENDPOINTS),
           ("GET", "/cluster/invites"), ("POST", "/cluster/invites"), ("DELETE", "/cluster/invites/abc123"),
           ("GET", "/models?reload=1"), ("GET", "/models?reload=true"), ("POST", "/models?reload=1"),
           ("GET", "/models?reload=1&reload=0")]  # the first value counts, as the handler reads it
READS = [("GET", "/cluster/join"), ("GET", "/models/load"), ("PUT", "/models/unload"), ("GET", "/api/pull"),
         ("GET", "/models"), ("GET", "/models?reload=0"), ("GET", "/models?reload=TRUE"), ("GET", "/models?reload=yes"),
         ("GET", "/models?reload="), ("GET", "/v1/models?reload=1"), ("GET", "/models/sse?reload=1"),
         ("POST", "/models/load/extra"), ("POST", "/cluster/pair"), ("GET", "/cluster/nodes"), ("GET", "/health"),
         ("POST", "/v1/chat/completions"), ("POST", "/api/chat"), ("GET", "/cluster/invite")]


@pytest.mark.parametrize("method, path", CHANGES, ids=[f"{m} {p}" for m, p in CHANGES])
def test_requests_that_change_the_cluster_or_show_invites_need_the_admin_token(shared, method, path):
    assert shared.ask(method, path)["changes_cluster"] is True


@pytest.mark.parametrize("method, path", READS, ids=[f"{m} {p}" for m, p in READS])
def test_other_methods_paths_and_reload_values_do_not(shared, method, path):
    assert shared.ask(method, path)["changes_cluster"] is False


# --- the bearer comparison ----------------------------------------------------------------------
def test_the_bearer_scheme_is_case_insensitive_and_the_token_is_taken_whole(shared):
    cases = {
        f"Bearer {PROBE_TOKEN}": True, f"bearer {PROBE_TOKEN}": True, f"BEARER   {PROBE_TOKEN}": True,
        f"Bearer {PROBE_TOKEN}  ": True,
        PROBE_TOKEN: False, f"Basic {PROBE_TOKEN}": False, f"Token {PROBE_TOKEN}": False, "Bearer": False,
        "Bearer ": False, f"Bearer {PROBE_TOKEN[:-1]}": False, f"Bearer {PROBE_TOKEN}x": False,
        f"Bearer {PROBE_TOKEN} {PROBE_TOKEN}": False, f"Bearer {PROBE_TOKEN.upper()}": False,
        f"Bearer{PROBE_TOKEN}": False,
    }
    for header, expected in cases.items():
        answer = shared.ask("GET", "/anything", {"Authorization": header})
        assert answer["admin"] is expected, header
        assert answer["api_key"] is False, header
    assert shared.ask("GET", "/anything")["admin"] is False  # no header at all


def test_any_of_several_accepted_keys_matches_and_the_admin_token_is_not_one_of_them(shared):
    for key in PROBE_KEYS:
        answer = shared.ask("GET", "/v1/models", {"Authorization": f"Bearer {key}"})
        assert answer == {"changes_cluster": False, "admin": False, "api_key": True}
    answer = shared.ask("GET", "/v1/models", {"Authorization": f"Bearer {PROBE_KEYS[0]}{PROBE_KEYS[1]}"})
    assert answer["api_key"] is False


TOKENS = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=48)


@settings(max_examples=60, deadline=None)
@given(token=TOKENS, scheme=st.sampled_from(["Bearer", "bearer", "BEARER", "bEaReR"]),
       padding=st.sampled_from(["", " ", "   ", "\t"]))
def test_a_token_matches_exactly_itself_whatever_the_scheme_case_and_padding(shared, token, scheme, padding):
    header = {"Authorization": f"{scheme} {padding}{token}{padding}"}
    answer = shared.ask("GET", "/x", header)
    assert answer["admin"] is (token == PROBE_TOKEN)
    assert answer["api_key"] is (token in PROBE_KEYS)
    exact = shared.ask("GET", "/x", {"Authorization": f"{scheme} {padding}{PROBE_TOKEN}{padding}"})
    assert exact["admin"] is True


# --- the agent's 401 ------------------------------------------------------------------------------
# Each admin request with a body its handler refuses, so that reaching the handler changes nothing.
ADMIN_CALLS = [
    ("POST", "/cluster/join", {"url": "ftp://nowhere"}, 400),
    ("POST", "/cluster/remove", {"node": "ghost"}, 400),
    ("POST", "/models/load", {"model": "ghost"}, 404),
    ("POST", "/models/unload", {"model": "ghost"}, 404),
    ("POST", "/models/sleep", {"model": "ghost"}, 404),
    ("POST", "/api/pull", {}, 400),
    ("GET", "/cluster/invites", None, 200),
    ("POST", "/cluster/invites", {"uses": "two"}, 400),
    ("DELETE", "/cluster/invites/0123456789abcdef", None, 404),
    ("GET", "/models?reload=true", None, 200),
]


def test_every_admin_call_is_listed_here():
    listed = {(method, path) for method, path, _, _ in ADMIN_CALLS}
    assert ADMIN_ENDPOINTS <= listed


@pytest.mark.parametrize("method, path, body, reached", ADMIN_CALLS, ids=[f"{c[0]} {c[1]}" for c in ADMIN_CALLS])
def test_an_agent_answers_401_without_the_admin_token_and_serves_with_it(shared, method, path, body, reached):
    url = shared.agent.url + path
    token = shared.agent.app[ADMIN_TOKEN]
    assert ADMIN == {"Authorization": f"Bearer {token}"}

    async def scenario() -> None:
        for headers in (None, {"Authorization": f"Bearer {API_KEY}"}, {"Authorization": f"Basic {token}"},
                        {"Authorization": f"Bearer {token[:-1]}"}, {"Authorization": token}):
            status, answer = await call(method, url, body, headers=headers)
            assert status == 401, (headers, answer)
            if path.startswith("/api/"):  # Ollama's shape: the message alone
                assert set(answer) == {"error"} and "admin token" in answer["error"], answer
                continue
            assert answer == {"error": {
                "message": "this changes the cluster and needs the admin token: send 'Authorization: Bearer "
                           "<admin token>' (`ncm admin-token` on any member prints it)",
                "type": "authentication_error", "param": None, "code": "admin_token_required"}}, answer
        for headers in (ADMIN, {"Authorization": f"bearer   {token}"}):
            status, answer = await call(method, url, body, headers=headers)
            assert status == reached, (headers, answer)

    shared.loop.run(scenario())


def test_the_admin_token_also_serves_where_api_keys_are_asked_for(shared):
    async def scenario() -> None:
        url = shared.agent.url + "/cluster/nodes"
        assert (await call("GET", url))[0] == 401
        for headers in (ADMIN, {"Authorization": f"Bearer {API_KEY}"}):
            status, answer = await call("GET", url, headers=headers)
            assert status == 200 and answer["node_id"] == shared.agent.node_id, answer

    shared.loop.run(scenario())


async def raw_request(port: int, head: bytes) -> bytes:
    """Send ``head`` (a request without a body) as bytes, and read the status line back."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout=10)
    try:
        writer.write(head)
        await asyncio.wait_for(writer.drain(), timeout=10)
        return await asyncio.wait_for(reader.readline(), timeout=10)
    finally:
        writer.close()


def test_a_token_that_is_not_utf8_is_refused_with_a_401(shared):
    head = b"GET /models?reload=1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n"
    status_line = shared.loop.run(raw_request(shared.agent.port, head))
    assert status_line.startswith(b"HTTP/1.1 401"), status_line
