import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.errors import InvalidRequestError, InviteError
from agent.core.invites import MAX_INVITES, Invite, InviteBook, JoinString, fingerprint, pairing_proof

SECRET = bytes(range(24))
KEY = fingerprint(b"cluster-key-0123456789")


def join(**change):
    fields = dict(cluster="home", url="http://192.168.1.20:8080", invite_id="0123abcd0123abcd", secret=SECRET,
                  fingerprint=fingerprint(b"cluster-key-0123456789"))
    return JoinString(**{**fields, **change})


@given(st.from_regex(r"[a-z][a-z0-9_-]{0,20}", fullmatch=True), st.binary(min_size=16, max_size=48),
       st.from_regex(r"[0-9a-f]{8,32}", fullmatch=True), st.integers(1, 65535))
def test_a_join_string_carries_what_a_new_device_needs(cluster, secret, invite_id, port):
    original = join(cluster=cluster, secret=secret, invite_id=invite_id, url=f"http://10.0.0.7:{port}")
    text = original.encode()
    assert text.startswith("ncm1.") and " " not in text
    assert JoinString.decode(f"  {text}\n") == original


@pytest.mark.parametrize("text, message", [
    ("http://192.168.1.20:8080#key", "starts with 'ncm1.'"),
    ("ncm1.!!!!", "damaged"),
    ("ncm1.eyJjIjoiaG9tZSJ9", "damaged"),  # {"c":"home"}: fields missing
])
def test_a_damaged_join_string_says_so(text, message):
    with pytest.raises(InviteError, match=message):
        JoinString.decode(text)


def test_a_truncated_join_string_is_refused():
    text = join().encode()
    with pytest.raises(InviteError):
        JoinString.decode(text[:-10])


def test_the_fingerprint_tells_keys_apart_and_reveals_nothing_of_the_key():
    key = b"cluster-key-0123456789"
    assert fingerprint(key) == fingerprint(key) != fingerprint(b"cluster-key-0123456788")
    assert key.hex() not in fingerprint(key) and len(fingerprint(key)) == 32


def redeem(book, invite, now, secret=SECRET, nonce="nonce0001"):
    return book.redeem(invite.invite_id, nonce, pairing_proof(secret, invite.invite_id, nonce), now=now,
                       key_fingerprint=KEY)


def test_a_single_use_invite_works_once():
    book = InviteBook()
    invite = book.create("0123abcd0123abcd", SECRET, now=0.0, key_fingerprint=KEY, ttl_s=3600, uses=1)
    assert redeem(book, invite, 10.0) == invite
    with pytest.raises(InviteError, match="does not exist"):
        redeem(book, invite, 11.0)
    assert book.active(12.0) == []


def test_an_invite_for_three_devices_counts_down():
    book = InviteBook()
    invite = book.create("0123abcd0123abcd", SECRET, now=0.0, key_fingerprint=KEY, uses=3)
    for left in (2, 1):
        redeem(book, invite, 1.0)
        assert book.active(1.0)[0].uses_left == left
    redeem(book, invite, 1.0)
    assert book.active(1.0) == []


def test_expired_revoked_and_wrong_secrets_are_refused_with_the_reason():
    book = InviteBook()
    invite = book.create("0123abcd0123abcd", SECRET, now=0.0, key_fingerprint=KEY, ttl_s=60)
    with pytest.raises(InviteError, match="wrong invite secret"):
        redeem(book, invite, 1.0, secret=b"x" * 24)
    assert book.active(1.0) == [invite]  # a wrong guess does not use it up
    with pytest.raises(InviteError, match="expired"):
        redeem(book, invite, 61.0)
    other = book.create("fedc4321fedc4321", SECRET, now=100.0, key_fingerprint=KEY)
    book.revoke(other.invite_id)
    with pytest.raises(InviteError, match="does not exist"):
        redeem(book, other, 101.0)
    with pytest.raises(InviteError, match="no open invite"):
        book.revoke("fedc4321fedc4321")


def test_invites_are_bounded_and_validated():
    book = InviteBook()
    for index in range(MAX_INVITES):
        book.create(f"{index:016x}", SECRET, now=0.0, key_fingerprint=KEY)
    with pytest.raises(InvalidRequestError, match="revoke some"):
        book.create("ffffffffffffffff", SECRET, now=0.0, key_fingerprint=KEY)
    with pytest.raises(InvalidRequestError, match="30 days"):
        InviteBook().create("0123abcd0123abcd", SECRET, now=0.0, key_fingerprint=KEY, ttl_s=0)
    with pytest.raises(InvalidRequestError, match="1 to 100"):
        InviteBook().create("0123abcd0123abcd", SECRET, now=0.0, key_fingerprint=KEY, uses=0)


def test_the_stored_form_keeps_the_secret_and_the_listing_does_not():
    invite = InviteBook().create("0123abcd0123abcd", SECRET, now=5.0, key_fingerprint=KEY, ttl_s=60, uses=2)
    assert InviteBook([invite]).to_json()[0]["secret"] == SECRET.hex()
    assert "secret" not in invite.public(now=10.0) and invite.public(now=10.0)["expires_in_s"] == 55.0


def test_an_invite_is_void_once_the_cluster_key_changed():
    """A removal changes the key: an invite issued before it hands out nothing, not even once."""
    book = InviteBook()
    invite = book.create("0123abcd0123abcd", SECRET, now=0.0, key_fingerprint=KEY, uses=3)
    nonce = "nonce0001"
    with pytest.raises(InviteError, match="before the cluster key changed"):
        book.redeem(invite.invite_id, nonce, pairing_proof(SECRET, invite.invite_id, nonce), now=1.0,
                    key_fingerprint=fingerprint(b"the-new-key-after-a-removal"))
    with pytest.raises(InviteError, match="does not exist"):
        redeem(book, invite, 2.0)


def test_an_invite_stored_without_its_key_is_void():
    stored = {"id": "0123abcd0123abcd", "secret": SECRET.hex(), "created_at": 0.0, "expires_at": 60.0, "uses_left": 2}
    book = InviteBook([Invite.from_json(stored)])
    with pytest.raises(InviteError, match="before the cluster key changed"):
        redeem(book, book.active(1.0)[0], 1.0)


def test_revoking_all_leaves_no_invite():
    book = InviteBook()
    for index in range(3):
        book.create(f"{index:016x}", SECRET, now=0.0, key_fingerprint=KEY)
    book.revoke_all()
    assert book.active(1.0) == []


def test_an_altered_fingerprint_is_refused_without_using_the_invite():
    book = InviteBook()
    invite = book.create("0123abcd0123abcd", SECRET, now=0.0, key_fingerprint=KEY, uses=1)
    nonce = "nonce0001"
    proof = pairing_proof(SECRET, invite.invite_id, nonce)
    with pytest.raises(InviteError, match="altered"):
        book.redeem(invite.invite_id, nonce, proof, now=1.0, key_fingerprint=KEY,
                    claimed_fingerprint=fingerprint(b"a-key-of-another-cluster"))
    assert book.redeem(invite.invite_id, nonce, proof, now=2.0, key_fingerprint=KEY, claimed_fingerprint=KEY) == invite
