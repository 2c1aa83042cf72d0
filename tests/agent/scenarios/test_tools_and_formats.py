"""Tool calls, structured output and the fields apps send, through the official `openai` and
`ollama` clients against a real agent serving the default model (SmolLM2, whose template knows
no tools: the generic format, constrained by a grammar, as llama.cpp's server does), and the
requests Home Assistant's Ollama integration and Open WebUI send, replayed."""

from __future__ import annotations

import json

import jsonschema
import ollama
import openai
import pytest

from tests.agent.agents import cluster_ready, make_agents, shut_down, wait_for
from tests.conftest import SMOLLM2_MODEL_NAME

pytestmark = pytest.mark.slow
MODEL = SMOLLM2_MODEL_NAME
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                         "parameters": {"type": "object", "properties": {},
                                                        "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def agent(smollm2_store, tmp_path_factory):
    agents = make_agents(tmp_path_factory.mktemp("tools"), smollm2_store.root, 1,
                         extra_env={"NCM_MAX_CONTEXT": "1024", "NCM_ALLOW_FALLBACK": "false"})
    try:
        wait_for(lambda: cluster_ready(agents[0], 1), timeout_s=300, what="the agent to serve")
        yield agents[0]
    finally:
        shut_down(agents, keep_store=smollm2_store.root)


@pytest.fixture(scope="module")
def client(agent):
    return openai.OpenAI(base_url=agent.url + "/v1", api_key="none", timeout=120, max_retries=0)


def test_a_forced_tool_call_streamed_and_not(client):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                                temperature=0, max_tokens=60)
        call = answer.choices[0].message.tool_calls[0]
        assert answer.choices[0].finish_reason == "tool_calls" and call.id.startswith("call_")
        tool = WEATHER if call.function.name == "get_weather" else TIME
        assert choice == "required" or tool is WEATHER
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        # the SDK reassembles the streamed deltas into the same call
        with client.chat.completions.stream(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                            temperature=0, max_tokens=60) as stream:
            final = stream.get_final_completion()
        streamed = final.choices[0].message.tool_calls[0]
        assert (streamed.function.name, json.loads(streamed.function.arguments)) == \
            (call.function.name, json.loads(call.function.arguments))
        # in pieces as it is written: the id, type and name first, then the arguments' text
        chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                                     tool_choice=choice, temperature=0, max_tokens=60, stream=True))
        pieces = [piece for chunk in chunks for c in chunk.choices for piece in c.delta.tool_calls or []]
        assert pieces[0].id.startswith("call_") and pieces[0].function.name == call.function.name
        assert len(pieces) > 2 and all(p.id is None and p.function.name is None for p in pieces[1:])
        assert json.loads("".join(p.function.arguments for p in pieces)) == json.loads(call.function.arguments)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_loop_goes_on_after_the_tool_answers(client):
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                            temperature=0, max_tokens=60)
    call = answer.choices[0].message.tool_calls[0]
    followed = client.chat.completions.create(model=MODEL, tools=[WEATHER], temperature=0, max_tokens=40, messages=[
        *ASK, answer.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}])
    message = followed.choices[0].message
    assert message.content or message.tool_calls  # auto: a reply or another call, either well formed


def test_structured_output_validates(client):
    schemas = [
        {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
         "required": ["name", "age"], "additionalProperties": False},
        {"type": "object", "properties": {"colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                      "minItems": 1, "maxItems": 3}},
         "required": ["colours"], "additionalProperties": False},
    ]
    for schema in schemas:
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], temperature=0, max_tokens=80,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
        jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    answer = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0.7, seed=1, max_tokens=200,
                                            response_format={"type": "json_object"}, frequency_penalty=0.5)
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_tools_and_a_response_format_give_a_call_or_json_of_the_schema(client):
    """An agent with tools and a typed output (the OpenAI Agents SDK sends both)."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "summary": {"type": "string", "maxLength": 40}},
              "required": ["city", "summary"], "additionalProperties": False}
    for messages in (ASK, [{"role": "user", "content": "Summarise Paris in a few words."}]):
        answer = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=120, parallel_tool_calls=False,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        message = answer.choices[0].message
        if message.tool_calls:
            jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])
        else:
            jsonschema.validate(json.loads(message.content), schema)


def test_fields_ncm_does_not_implement_are_refused_by_name(client):
    for field, value in (("n", 2), ("reasoning_effort", "low"), ("modalities", ["audio"]), ("colour", "red")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body={field: value})
        assert field in caught.value.message


def test_the_ollama_client_calls_tools_and_follows_a_format(agent):
    client = ollama.Client(host=agent.url, timeout=120)
    answer = client.chat(model=MODEL + ":latest", messages=ASK, tools=[WEATHER], options={"temperature": 0})
    for call in answer.message.tool_calls or []:  # auto: a call or a reply; a call is well formed
        assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
    assert answer.message.tool_calls or answer.message.content
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 15}}, "required": ["city"],
              "additionalProperties": False}
    chunks = list(client.chat(model=MODEL, messages=ASK, format=schema, stream=True,
                              options={"temperature": 0, "num_predict": 60}))
    jsonschema.validate(json.loads("".join(c.message.content for c in chunks)), schema)
    generated = client.generate(model=MODEL, prompt="A city:", format="json",
                                options={"temperature": 0, "num_predict": 60})
    assert isinstance(json.loads(generated.response), dict)


# What Home Assistant's Ollama integration sends once its options were saved, with "Control
# Home Assistant" on (homeassistant/components/ollama/entity.py): floats from its number
# selectors, keep_alive as "-1s", its tools in the OpenAI form, think unset.
HA_TOOLS = [{"type": "function", "function": {"name": name, "description": description, "parameters": {
    "type": "object", "properties": {"name": {"type": "string"}, "area": {"type": "string"},
                                     "domain": {"type": "array", "items": {"type": "string"}}}, "required": []}}}
    for name, description in (("HassTurnOn", "Turns on/opens a device or entity"),
                              ("HassTurnOff", "Turns off/closes a device or entity"),
                              ("HassLightSet", "Sets the brightness or color of a light"))] + [
    {"type": "function", "function": {"name": "GetLiveContext", "description": "Provides real-time information",
                                      "parameters": {"type": "object", "properties": {}}}}]


def test_home_assistant_and_open_webui_requests_are_answered_as_ollama_would(agent):
    home_assistant = {
        "model": MODEL, "stream": True, "keep_alive": "-1s", "options": {"num_ctx": 8192.0},
        "tools": HA_TOOLS, "messages": [
            {"role": "system", "content": "You are a voice assistant for Home Assistant."},
            {"role": "user", "content": "Turn on the kitchen light"}]}
    status, lines = agent.post("/api/chat", home_assistant)  # NDJSON: the text of its lines
    assert status == 200, lines
    chunks = [lines] if isinstance(lines, dict) else [json.loads(line) for line in lines.splitlines() if line.strip()]
    assert chunks[-1]["done"] and not any("error" in c for c in chunks)
    calls = [call for c in chunks for call in c["message"].get("tool_calls", [])]
    for call in calls:  # what HA executes: a name among its tools, arguments as an object
        assert call["function"]["name"] in {t["function"]["name"] for t in HA_TOOLS}
        assert isinstance(call["function"]["arguments"], dict)
    assert calls or "".join(c["message"]["content"] for c in chunks), json.dumps(chunks)
    # Open WebUI's chat controls over its Ollama connection
    open_webui = {"model": MODEL + ":latest", "stream": False, "messages": ASK, "options": {
        "repeat_penalty": 1.1, "repeat_last_n": 64, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "temperature": 0.8,
        "seed": 42, "num_predict": 16.0}}
    status, answer = agent.post("/api/chat", open_webui)
    assert status == 200 and answer["done"] and answer["eval_count"] <= 16, answer


def test_logprobs_of_chat_and_completions(client):
    answer = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=8, logprobs=True,
                                            top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == answer.choices[0].message.content
    for entry in content:  # greedy: the chosen token is the likeliest one
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert bytes(entry.bytes).decode() == entry.token
    streamed = [entry for chunk in client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3, stream=True)
        if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    completion = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                           max_tokens=5, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text and len(logprobs.top_logprobs[0]) == 2
    assert logprobs.text_offset[0] == 0 and all(lp <= 0 for lp in logprobs.token_logprobs)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, top_logprobs=2)


def test_a_langchain_tool_agent_calls_its_tool_over_both_apis(agent):
    """LangChain's tool loop, as an agent framework runs it: the model asks for the tool, the
    tool's answer goes back as a tool message, the model answers from it. Over `ChatOpenAI`
    the call is forced (`tool_choice`), over `ChatOllama` (whose API has no tool_choice) the
    model chooses it itself, greedily, in the generic format."""
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_ollama import ChatOllama
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather now in a city."""
        return f"Sunny and 21 degrees in {city}."

    over_openai = ChatOpenAI(base_url=agent.url + "/v1", api_key="none", model=MODEL, temperature=0, max_tokens=80,
                             max_retries=0, timeout=120)
    over_ollama = ChatOllama(base_url=agent.url, model=MODEL, temperature=0, num_predict=80)
    for llm, first in ((over_openai, over_openai.bind_tools([get_weather], tool_choice="get_weather")),
                       (over_ollama, over_ollama.bind_tools([get_weather]))):
        messages = [HumanMessage("What is the weather in Paris?")]
        asked = first.invoke(messages)
        assert [call["name"] for call in asked.tool_calls] == ["get_weather"], asked
        assert isinstance(asked.tool_calls[0]["args"].get("city"), str)
        messages += [asked, get_weather.invoke(asked.tool_calls[0])]  # the tool's answer, as a ToolMessage
        answered = llm.bind_tools([get_weather]).invoke(messages)
        assert answered.content or answered.tool_calls, answered
