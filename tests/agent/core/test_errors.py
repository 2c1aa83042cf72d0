"""Errors carry their public answer (agent/core/errors.py): one table, read off the classes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.errors import (
    AuthError,
    CapacityError,
    ClusterError,
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
    RouterError,
    TooManyRequestsError,
    UnknownModelError,
    WireError,
    without_addresses,
)

ANSWERS = [  # error, status, code, param, retry_after_s
    (UnknownModelError("gpt-9", ["smollm2-135m"]), 404, "model_not_found", "model", None),
    (ModelNotLoadedError("m is not loaded"), 400, "model_not_loaded", "model", None),
    (ModelBusyError("m is serving"), 409, "model_busy", "model", None),
    (TooManyRequestsError("full", 7), 429, "rate_limit_exceeded", None, 7),
    (CapacityError("does not fit now", 30.0), 503, "model_capacity", None, 30.0),
    (CapacityError("does not fit at all", None), 503, "model_capacity", None, None),
    (ModelLoadError("failed"), 503, "model_load_failed", None, 5.0),
    (ModelLoadError("failed", None), 503, "model_load_failed", None, None),
    (RouterError("the router stopped"), 503, "model_unavailable", None, 5.0),
    (PresetError("line 3"), 400, "invalid_presets", None, None),
    (ClusterError("no survivor"), 503, "cluster_unavailable", None, 5.0),
    (InvalidRequestError("bad", "temperature"), 400, "invalid_request", "temperature", None),
    (InvalidRequestError("gone", "model", "model_not_found", status=404), 404, "model_not_found", "model", None),
    (InviteError("wrong invite secret"), 403, "invite_refused", None, None),
    (InviteNotFoundError("no open invite"), 404, "invite_not_found", None, None),
    (KeyChangeRefusedError("NCM_CLUSTER_KEY set"), 409, "key_change_refused", None, None),
    (MemberUnreachable("no answer"), 503, "member_unreachable", None, 10.0),
    (WireError("bad frame"), 400, "malformed_message", None, None),
    (AuthError("not signed"), 401, "bad_cluster_key", None, None),
    (NcmError("anything else"), 500, "internal_error", None, None),
]


@pytest.mark.parametrize(("error", "status", "code", "param", "retry_after_s"), ANSWERS,
                         ids=lambda v: type(v).__name__ if isinstance(v, Exception) else None)
def test_each_error_knows_its_answer(error, status, code, param, retry_after_s):
    answer = error.answer()
    assert (answer.status, answer.code, answer.param, answer.retry_after_s) == (status, code, param, retry_after_s)
    assert str(error) in answer.message


def test_the_message_says_what_to_do_where_retrying_helps():
    assert ModelLoadError("m failed").answer().message == "m failed; retry the request to load it again"
    assert ModelLoadError("m failed", None).answer().message == "m failed"
    assert PresetError("line 3: bad").answer().message == "the model presets are invalid: line 3: bad"


def test_public_text_shows_no_node_address():
    text = "cannot reach https://192.168.1.20:41000/internal/state (10.0.0.7:8080, [fd00::1]:41000)"
    assert "192.168" not in without_addresses(text) and "10.0.0.7" not in without_addresses(text)
    assert "fd00" not in without_addresses(text)


@given(st.builds(PublicAnswer, st.sampled_from([400, 404, 409, 429, 503]), st.text(min_size=1), st.text(),
                 st.none() | st.text(), st.none() | st.floats(0, 1e6)))
def test_an_internal_refusal_reads_back_as_it_was_written(answer):
    assert PublicAnswer.from_json(answer.status, json.loads(json.dumps(answer.to_json()))) == answer


@pytest.mark.parametrize("body", [None, [], "refused", {"error": "no"}, {"code": "x"}, {"error": 1, "code": "x"}])
def test_a_body_that_is_no_refusal_reads_as_none(body):
    assert PublicAnswer.from_json(400, body) is None
