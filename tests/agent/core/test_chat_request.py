import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.chat_request import parse_request
from agent.core.errors import InvalidRequestError

MESSAGES = [{"role": "user", "content": "hi"}]


def test_defaults_follow_openai():
    request = parse_request({"messages": MESSAGES}, chat=True)
    assert request.temperature == 1.0 and request.top_p == 1.0 and request.max_tokens is None
    assert request.stream is False and request.stop == () and request.messages == ({"role": "user", "content": "hi"},)


def test_text_parts_developer_role_and_stop_forms():
    request = parse_request({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                             "stop": "END", "stream": True, "stream_options": {"include_usage": True}}, chat=True)
    assert request.messages == ({"role": "system", "content": "ab"},) and request.stop == ("END",) and request.include_usage


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


def test_integral_floats_count_as_integers():
    request = parse_request({"messages": MESSAGES, "max_tokens": 8192.0, "seed": 7.0, "top_k": 40.0}, chat=True)
    assert request.max_tokens == 8192 and request.seed == 7 and request.top_k == 40
    with pytest.raises(InvalidRequestError) as caught:
        parse_request({"messages": MESSAGES, "max_tokens": 10.5}, chat=True)
    assert caught.value.param == "max_tokens"


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_a_tool_loop_parses_in_both_apis_forms():
    openai_turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]}
    ollama_turn = {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    for turn in (openai_turn, ollama_turn):
        request = parse_request({"messages": [*MESSAGES, turn, {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}],
                                 "tools": [TOOL], "tool_choice": "required"}, chat=True)
        assistant, result = request.messages[1], request.messages[2]
        assert assistant["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
        assert result["role"] == "tool" and result["content"] == "12 C"
        assert request.tools[0].name == "get_weather" and request.tool_choice == "required" and request.calls_tools


@pytest.mark.parametrize("body, param", [
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "messages[0].images"),
    ({"messages": [{"role": "user", "content": "hi", "colour": "red"}]}, "messages[0].colour"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "x"}}]}]},
     "messages[0].tool_calls"),
])
def test_each_bad_tool_or_format_field_is_named(body, param):
    with pytest.raises(InvalidRequestError) as caught:
        parse_request({"messages": MESSAGES, **body}, chat=True)
    assert caught.value.param == param


def test_response_formats():
    assert parse_request({"messages": MESSAGES, "response_format": {"type": "json_object"}}, chat=True).json_schema \
        == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema,
                                                                                               "strict": True}}}
    assert parse_request(body, chat=True).json_schema == schema
    assert parse_request({"messages": MESSAGES, "response_format": {"type": "text"}}, chat=True).json_schema is None


@pytest.mark.parametrize("body, think, effort, field", [
    ({}, None, None, "think"),
    ({"think": True}, True, None, "think"),
    ({"think": "high"}, True, "high", "think"),
    ({"think": False}, False, None, "think"),
    ({"reasoning_effort": "none"}, False, None, "reasoning_effort"),
    ({"reasoning_effort": "low"}, True, "low", "reasoning_effort"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, False, None, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": "medium"}, True, "medium",
     "reasoning_effort"),
])
def test_thinking_is_said_one_of_three_ways(body, think, effort, field):
    request = parse_request({"messages": MESSAGES, **body}, chat=True)
    assert (request.think, request.reasoning_effort, request.think_field) == (think, effort, field)


def test_template_variables_pass_on_and_reasoning_goes_back_to_the_template():
    request = parse_request({"messages": [*MESSAGES, {"role": "assistant", "content": "b", "thinking": "a"}],
                             "chat_template_kwargs": {"custom_flag": 1, "enable_thinking": True}}, chat=True)
    assert request.template_variables == (("custom_flag", 1),)
    assert request.messages[1] == {"role": "assistant", "content": "b", "reasoning_content": "a"}


@pytest.mark.parametrize("body, param", [
    ({"think": "max"}, "think"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}, "reasoning_effort"),
    ({"think": False, "reasoning_effort": "low"}, "think"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x", "reasoning_content": "y"}]}, "messages[0].reasoning_content"),
])
def test_each_bad_thinking_field_is_named(body, param):
    with pytest.raises(InvalidRequestError) as caught:
        parse_request({"messages": MESSAGES, **body}, chat=True)
    assert caught.value.param == param
