"""The control plane's messages (agent/core/protocol.py): what a sender builds is what the
handler reads, and a body that is not the message is a WireError, never another exception."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.errors import WireError
from agent.core.protocol import (
    CopyOrder,
    Description,
    Embeddings,
    EmbedOrder,
    Introduction,
    ModelListing,
    OrderStep,
    PairAnswer,
    PairRequest,
    RekeyOrder,
    UnloadOrder,
)

MESSAGES = [
    OrderStep("smollm2-135m", 3, 2),
    UnloadOrder("smollm2-135m", 2),
    CopyOrder("ncm-tiny", (("a1b2c3d4e5f6", "https://192.168.1.20:41000"), ("f6e5d4c3b2a1", "https://[fd00::1]:41000"))),
    RekeyOrder("home", "k" * 64, ("https://192.168.1.20:8080", "http://192.168.1.21:8080")),
    PairRequest("0123abcd0123abcd", "nonce0001", "ab" * 32, "home", "f" * 32),
    PairRequest("0123abcd0123abcd", "nonce0001", "ab" * 32),
    EmbedOrder("all-minilm-l6-v2", ("the kitchen light", "é"), True, (("a1b2c3d4e5f6", "https://10.0.0.2:41000"),)),
    EmbedOrder("all-minilm-l6-v2", ("x",), False, (), keep_alive_s=0.0, close=True),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_message_reads_back_as_it_was_sent(message):
    assert type(message).from_json(message.to_json()) == message


@pytest.mark.parametrize(("kind", "body", "why"), [
    (OrderStep, {"name": "m", "plan_version": "3", "epoch": 1}, "'plan_version'"),
    (OrderStep, {"name": "m", "plan_version": True, "epoch": 1}, "'plan_version'"),
    (UnloadOrder, {"name": "m"}, "'epoch'"),
    (UnloadOrder, ["m", 1], "a JSON object"),
    (CopyOrder, {"model": "m", "sources": [["node"]]}, "pairs"),
    (RekeyOrder, {"cluster": "home", "key": "short", "peers": []}, "16-256"),
    (RekeyOrder, {"cluster": "home", "key": "k" * 32, "peers": ["ftp://x"]}, "http"),
    (PairRequest, {"invite": "i", "nonce": "n", "proof": "p" * 200}, "at most 128"),
    (PairRequest, {"invite": "i", "nonce": "n", "proof": "p", "cluster": "home"}, "both"),
    (EmbedOrder, {"model": "m", "texts": [], "truncate": True, "sources": [], "close": False}, "1 to 2048"),
    (EmbedOrder, {"model": "m", "texts": [1], "truncate": True, "sources": [], "close": False}, "strings"),
    (EmbedOrder, {"model": "m", "texts": ["x"], "truncate": True, "sources": [], "close": False,
                  "keep_alive_s": "5m"}, "keep_alive_s"),
    (Embeddings, {"vectors": "AAAA", "shape": [2, 1], "prompt_tokens": 1, "load_s": 0, "embed_s": 0}, "shape"),
    (Embeddings, {"vectors": "!!", "shape": [1, 1], "prompt_tokens": 1, "load_s": 0, "embed_s": 0}, "vectors"),
    (Embeddings, {"vectors": "AAAA", "shape": [1, 1], "prompt_tokens": 1, "load_s": -1, "embed_s": 0}, "seconds"),
])
def test_a_body_that_is_not_the_message_is_refused_by_name(kind, body, why):
    with pytest.raises(WireError, match=why):
        kind.from_json(body)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)


@given(st.sampled_from([OrderStep, UnloadOrder, CopyOrder, RekeyOrder, PairRequest, EmbedOrder, Embeddings]), JSON)
def test_any_json_is_a_message_or_a_wire_error(kind, body):
    try:
        kind.from_json(body)
    except WireError:
        pass


def test_a_rekey_order_names_at_most_sixteen_peers():
    order = RekeyOrder.from_json({"cluster": "home", "key": "k" * 32, "peers": [f"http://10.0.0.{i}:8080" for i in range(40)]})
    assert len(order.peers) == 16


def test_embeddings_read_back_exactly():
    vectors = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    read = Embeddings.from_json(Embeddings(vectors, 7, 0.5, 0.25).to_json())
    assert np.array_equal(read.vectors, vectors) and (read.prompt_tokens, read.load_s, read.embed_s) == (7, 0.5, 0.25)


# --- answers: pairing, describe, model listings -------------------------------------------------
def test_a_pairing_answer_reads_back_and_keeps_only_urls_among_its_peers():
    answer = PairAnswer("home", ("http://10.0.0.2:8080", "https://b.local:8080"), "ab" * 12, "cd" * 40)
    assert PairAnswer.from_json(json.loads(json.dumps(answer.to_json()))) == answer
    assert PairAnswer.from_json({**answer.to_json(), "peers": ["ftp://x", 3, "http://ok:1"]}).peers == ("http://ok:1",)
    with pytest.raises(WireError, match="pairing answer"):
        PairAnswer.from_json({"cluster": "home", "iv": "00"})


@given(st.one_of(st.none(), st.integers(), st.text(max_size=5), st.booleans()),
       st.one_of(st.none(), st.integers(), st.text(max_size=20)))
def test_an_introduction_reads_a_bad_field_as_absent(port, url):
    introduction = Introduction.from_json({"api_port": port, "url": url})
    assert introduction.api_port is None or (isinstance(introduction.api_port, int) and 0 < introduction.api_port < 65536)
    assert introduction.url is None or introduction.url.startswith(("http://", "https://"))


def test_an_introduction_names_where_the_caller_is_reached():
    assert Introduction(8080, "http://me.local:8080").address("10.0.0.9") == "http://me.local:8080"
    assert Introduction(8080).address("10.0.0.9") == "http://10.0.0.9:8080"
    assert Introduction(8080).address("fe80::1") == "http://[fe80::1]:8080"
    assert Introduction().address("10.0.0.9") is None and Introduction(8080).address(None) is None
    assert Introduction.from_json(Introduction(8081, None).to_json()) == Introduction(8081)


def test_a_description_reads_back_with_its_report_beside_its_advert():
    description = Description({"node_id": "n1"}, ("http://a:1",), "10.0.0.3", {"models": {"m": 3}, "worker": {}})
    again = Description.from_json(json.loads(json.dumps(description.to_json())))
    assert again == description
    assert Description.from_json({"advert": {}, "peers": "x", "you": "y" * 80}) == Description({})
    with pytest.raises(WireError, match="advert"):
        Description.from_json({"peers": []})


def test_a_model_listing_reads_back_and_refuses_a_file_without_its_digest():
    listing = ModelListing("encoder", {"name": "minilm"}, {"tokenizer.json": (12, "ab" * 32)})
    assert ModelListing.from_json(json.loads(json.dumps(listing.to_json())), "encoder") == listing
    with pytest.raises(WireError, match="holds its manifest"):  # an embedding model's listing is no chat model's
        ModelListing.from_json(listing.to_json(), "manifest")
    with pytest.raises(WireError, match="tokenizer.json"):
        ModelListing.from_json({"encoder": {}, "meta_files": {"tokenizer.json": {"bytes": 12}}}, "encoder")
