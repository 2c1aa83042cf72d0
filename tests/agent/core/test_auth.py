import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.auth import (
    ANY_NODE,
    HEADER_NODE,
    HEADER_SIGNATURE,
    ReplayGuard,
    sign,
    sign_answer,
    verify,
    verify_answer,
)
from agent.core.errors import AuthError, StaleRequestError

KEY = b"0123456789abcdef-cluster"
PATH = "/internal/routing?x=1"


def signed(now=1000.0, nonce="abcdef0123456789", body=b"{}", key=KEY, path=PATH, target="n2"):
    return sign(key, "POST", path, body, now=now, nonce=nonce, node_id="n1", target=target)


def check(headers, *, now=1001.0, guard=None, node_id="n2", any_target=False, path=PATH, body=b"{}"):
    return verify(KEY, "POST", path, body, headers, now=now, guard=guard or ReplayGuard(), node_id=node_id,
                  any_target=any_target)


def test_good_signature_names_the_sender():
    assert check(signed()) == "n1"


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(key=b"another-key-entirely"), "bad signature"),
        (dict(body=b'{"epoch": 9}'), "bad signature"),
        (dict(path="/internal/describe"), "bad signature"),
        (dict(path="/internal/routing?x=2"), "bad signature"),  # the query string is signed too
    ],
)
def test_requests_not_signed_with_the_key_prove_nothing(change, message):
    with pytest.raises(AuthError, match=message) as caught:
        check(signed(**change))
    assert not isinstance(caught.value, StaleRequestError)


def test_a_request_for_one_node_is_refused_by_another():
    with pytest.raises(StaleRequestError, match="addressed to node n2"):
        check(signed(target="n2"), node_id="n3")
    # Forging the target breaks the signature.
    headers = dict(signed(target="n2"), **{"X-Ncm-Target": "n3"})
    with pytest.raises(AuthError, match="bad signature"):
        check(headers, node_id="n3")


def test_any_node_is_accepted_only_where_the_caller_allows_it():
    with pytest.raises(StaleRequestError):
        check(signed(target=ANY_NODE))
    assert check(signed(target=ANY_NODE), any_target=True) == "n1"


def test_stale_requests_of_members_are_refused_as_stale():
    with pytest.raises(StaleRequestError, match="off"):
        check(signed(now=900.0), now=1000.0)


def test_replay_within_the_window_fails_and_nonces_are_forgotten_after_it():
    guard = ReplayGuard(window_s=30.0)
    headers = signed(now=1000.0)
    check(headers, now=1000.0, guard=guard)
    with pytest.raises(StaleRequestError, match="replayed"):
        check(headers, now=1010.0, guard=guard)
    # Outside the window the timestamp check refuses it anyway.
    with pytest.raises(StaleRequestError, match="off"):
        check(headers, now=1040.0, guard=guard)


def test_missing_headers_say_what_is_needed():
    with pytest.raises(AuthError, match="cluster key"):
        verify(KEY, "GET", "/internal/describe", b"", {}, now=0.0, guard=ReplayGuard(), node_id="n2")


def answer(nonce="abcdef0123456789", status=200, body=b"{}", key=KEY, responder="n2"):
    return sign_answer(key, responder=responder, nonce=nonce, status=status, body=body)


def test_a_signed_answer_names_the_node_that_gave_it():
    assert verify_answer(KEY, answer(), nonce="abcdef0123456789", status=200, body=b"{}", responder="n2") == "n2"
    assert verify_answer(KEY, answer(), nonce="abcdef0123456789", status=200, body=b"{}", responder=ANY_NODE) == "n2"
    streamed = answer(body=None, status=101)
    assert verify_answer(KEY, streamed, nonce="abcdef0123456789", status=101, body=None, responder="n2") == "n2"


@pytest.mark.parametrize(
    "headers, expected",
    [
        ({}, "unsigned answer"),
        ({HEADER_NODE: "n2", HEADER_SIGNATURE: "0" * 64}, "bad answer signature"),
        (answer(key=b"not-the-cluster-key-at-all"), "bad answer signature"),
        (answer(nonce="another0nonce000"), "bad answer signature"),  # an answer to another request
        (answer(status=500), "bad answer signature"),
        (answer(body=b'{"advert": "forged"}'), "bad answer signature"),
        (answer(body=None), "bad answer signature"),  # a streamed answer is no JSON answer
    ],
)
def test_answers_not_signed_for_this_very_request_prove_nothing(headers, expected):
    with pytest.raises(AuthError, match=expected) as caught:
        verify_answer(KEY, headers, nonce="abcdef0123456789", status=200, body=b"{}", responder="n2")
    assert not isinstance(caught.value, StaleRequestError)


def test_an_answer_of_another_member_than_the_one_asked_is_refused():
    with pytest.raises(StaleRequestError, match="n3 answered"):
        verify_answer(KEY, answer(responder="n3"), nonce="abcdef0123456789", status=200, body=b"{}",
                      responder="n2")


@given(st.integers(0, 10_000))
def test_guard_memory_is_bounded(count):
    guard = ReplayGuard(window_s=1e9, max_nonces=50)
    for index in range(min(count, 300)):
        guard.check_and_remember(f"nonce{index:08d}", 0.0, 0.0)
    assert len(guard._seen) <= 50
