import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.chat_request import parse_request
from agent.core.errors import InvalidRequestError

MESSAGES = [{"role": "user", "content": "hi"}]


def test_defaults_follow_openai():
    request = parse_request({"messages": MESSAGES}, chat=True)
    assert request.temperature == 1.0 and request.top_p == 1.0 and request.max_tokens is None
    assert request.stream is False and request.stop == () and request.messages == (("user", "hi"),)


def test_text_parts_developer_role_and_stop_forms():
    request = parse_request({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                             "stop": "END", "stream": True, "stream_options": {"include_usage": True}}, chat=True)
    assert request.messages == (("system", "ab"),) and request.stop == ("END",) and request.include_usage


def test_completion_prompt():
    assert parse_request({"prompt": "Once upon"}, chat=False).prompt == "Once upon"
    with pytest.raises(InvalidRequestError, match="'prompt'"):
        parse_request({"prompt": ""}, chat=False)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": MESSAGES, "top_p": 0}, "top_p"),
        ({"messages": MESSAGES, "seed": -1}, "seed"),
        ({"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": MESSAGES, "stream": "yes"}, "stream"),
        ({"messages": MESSAGES, "max_tokens": True}, "max_tokens"),
        ({"messages": MESSAGES, "model": ""}, "model"),
    ],
)
def test_each_bad_field_is_named(body, param):
    with pytest.raises(InvalidRequestError) as caught:
        parse_request(body, chat=True)
    assert caught.value.param == param and caught.value.status == 400


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=4),
                    max_leaves=12))
def test_any_json_either_parses_or_is_a_typed_error(body):
    for chat in (True, False):
        try:
            parse_request(body, chat=chat)
        except InvalidRequestError:
            pass


@pytest.mark.parametrize("role", [["user"], {"name": "user"}, 7, None])
def test_a_role_that_is_not_a_string_is_a_typed_error(role):
    with pytest.raises(InvalidRequestError) as caught:
        parse_request({"messages": [{"role": role, "content": "hi"}]}, chat=True)
    assert caught.value.param == "messages[0].role"
