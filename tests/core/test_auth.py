import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.auth import ReplayGuard, sign, verify
from agent.core.errors import AuthError

KEY = b"0123456789abcdef-cluster"


def signed(now=1000.0, nonce="abcdef0123456789", body=b"{}", key=KEY, path="/internal/routing"):
    return sign(key, "POST", path, body, now=now, nonce=nonce, node_id="n1")


def test_good_signature_names_the_sender():
    assert verify(KEY, "POST", "/internal/routing", b"{}", signed(), now=1001.0, guard=ReplayGuard()) == "n1"


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(key=b"another-key-entirely"), "bad signature"),
        (dict(body=b'{"epoch": 9}'), "bad signature"),
        (dict(path="/internal/describe"), "bad signature"),
        (dict(now=900.0), "off"),
    ],
)
def test_tampering_or_stale_requests_fail(change, message):
    headers = signed(**change)
    with pytest.raises(AuthError, match=message):
        verify(KEY, "POST", "/internal/routing", b"{}", headers, now=1000.0, guard=ReplayGuard())


def test_replay_within_the_window_fails_and_nonces_are_forgotten_after_it():
    guard = ReplayGuard(window_s=30.0)
    headers = signed(now=1000.0)
    verify(KEY, "POST", "/internal/routing", b"{}", headers, now=1000.0, guard=guard)
    with pytest.raises(AuthError, match="replayed"):
        verify(KEY, "POST", "/internal/routing", b"{}", headers, now=1010.0, guard=guard)
    # Outside the window the timestamp check refuses it anyway.
    with pytest.raises(AuthError, match="off"):
        verify(KEY, "POST", "/internal/routing", b"{}", headers, now=1040.0, guard=guard)


def test_missing_headers_say_what_is_needed():
    with pytest.raises(AuthError, match="cluster key"):
        verify(KEY, "GET", "/internal/describe", b"", {}, now=0.0, guard=ReplayGuard())


@given(st.integers(0, 10_000))
def test_guard_memory_is_bounded(count):
    guard = ReplayGuard(window_s=1e9, max_nonces=50)
    for index in range(min(count, 300)):
        guard.check_and_remember(f"nonce{index:08d}", 0.0, 0.0)
    assert len(guard._seen) <= 50
