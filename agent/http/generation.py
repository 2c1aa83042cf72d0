"""What the OpenAI and Ollama endpoints share to generate: the prompt a request makes through its
chat template (tools, reasoning), the grammar that holds its answer to a format or a call, the
sampling parameters, and the answer's tool calls and log-probabilities in the APIs' shapes."""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from agent.core.chat_request import ChatRequest
from agent.core.errors import (
    InvalidRequestError,
)
from agent.http.app_keys import (
    CONFIG,
    METRICS,
    ORCHESTRATOR,
)
from agent.orchestration.orchestrator import Completion, Deployment
from shards.errors import ShardsError
from shards.runtime.answer_reader import AnswerReader
from shards.runtime.call_stream import CallDelta
from shards.runtime.grammar import ThinkFirst, json_schema_grammar
from shards.runtime.reasoning import ReasoningSplitter, ReasoningSupport, prompt_opens_thinking, reasoning_support
from shards.runtime.sampling import MAX_TOKENS_LIMIT, SamplingParams, TokenLogprobs
from shards.runtime.tool_calls import PARALLEL_BY_DEFAULT, ToolCall, call_grammar, prompt_messages, tool_format
from shards.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def sampling_params(chat: ChatRequest, prompt_tokens: int, max_context: int, grammar: str | None = None, *,
                    default_max_tokens: int = 0) -> SamplingParams:
    """How ``chat`` samples: at most ``max_tokens``, else ``default_max_tokens`` (0: none),
    and never past the context."""
    room = max_context - prompt_tokens
    if room < 1:
        raise InvalidRequestError(
            f"the prompt has {prompt_tokens} tokens but the context holds {max_context}; shorten it",
            "messages" if chat.messages else "prompt", "context_length_exceeded")
    max_tokens = min(chat.max_tokens or default_max_tokens or room, room, MAX_TOKENS_LIMIT)
    try:
        return SamplingParams(max_tokens=max_tokens, grammar=grammar, **chat.sampling_fields())
    except ShardsError as error:
        raise InvalidRequestError(str(error)) from None


@dataclasses.dataclass(frozen=True)
class Generation:
    """A generation started: its events, and the reader of its text (reasoning, reply, calls)."""

    events: AsyncIterator[Completion]
    reader: AnswerReader


def _prompt(parsed: ChatRequest, deployment: Deployment, *, call_pieces: bool
            ) -> tuple[list[int], str | None, AnswerReader]:
    """The prompt's ids, the grammar of the answer and its reader (``call_pieces``: the calls'
    pieces are sent as they come; see
    :mod:`shards.runtime.tool_calls` and :mod:`shards.runtime.reasoning`)."""
    tokenizer = deployment.tokenizer
    if parsed.messages is None:
        assert parsed.prompt is not None
        if parsed.think or parsed.template_variables:
            field = parsed.think_field if parsed.think else "chat_template_kwargs"
            raise InvalidRequestError(f"'{field}' needs the chat template: send messages, without raw", field)
        return tokenizer.encode(parsed.prompt), _schema_grammar(parsed.json_schema), AnswerReader()
    tools = [{"name": t.name, "description": t.description, "parameters": t.parameters}
             for t in parsed.tools] if parsed.calls_tools else []
    template = tokenizer.spec.chat_template
    fmt = tool_format(template)
    support = reasoning_support(template)
    think, variables = _thinking(parsed, support, deployment.name)
    parallel = PARALLEL_BY_DEFAULT[fmt] if parsed.parallel_tool_calls is None else parsed.parallel_tool_calls
    messages, extra = prompt_messages(fmt, parsed.messages, tools, parallel=parallel)
    try:
        prompt_ids = tokenizer.encode_chat(messages, **variables, **extra)
    except ShardsError as error:
        raise InvalidRequestError(f"cannot apply the chat template: {error}", "messages") from None
    splitter = think_first = None
    if support is not None:
        inside = prompt_opens_thinking(tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:]))
        splitter = ReasoningSplitter(inside=inside)
        if think is not False or not support.switch:  # a constrained answer comes after the thinking
            think_first = ThinkFirst(opened=inside, tokens=tokenizer.added_token_texts)
    if not tools:
        grammar = _schema_grammar(parsed.json_schema, think_first)
    else:  # with a response_format, an answer that calls no tool follows its schema
        try:
            grammar = call_grammar(fmt, tools, parsed.tool_choice, parallel=parallel,
                                   tokens=tokenizer.added_token_texts, answer_schema=parsed.json_schema,
                                   think=think_first)
        except ShardsError as error:
            raise InvalidRequestError(f"the tools cannot be turned into a grammar: {error}",
                                      "tools" if parsed.json_schema is None else "response_format") from None
    return prompt_ids, grammar, AnswerReader(tool_format=fmt if tools else None, reasoning=splitter,
                                             show_reasoning=think is not False, stream_calls=grammar is not None,
                                             call_pieces=call_pieces)


PROMPT_TAIL_TOKENS = 8  # enough of a prompt's end to see whether its template opened a think block


def _thinking(parsed: ChatRequest, support: ReasoningSupport | None, model: str) -> tuple[bool | None, dict[str, Any]]:
    """Whether the answer thinks (None: as the template decides) and the template's variables
    that say so; a model that cannot think refuses to."""
    variables = dict(parsed.template_variables)
    think = parsed.think
    if support is None:
        if think:
            raise InvalidRequestError(f"\"{model}\" does not support thinking ('{parsed.think_field}' asks for it)",
                                      parsed.think_field)
        return think, variables
    if support.switch and think is not None:
        variables["enable_thinking"] = think
    if support.effort and parsed.reasoning_effort:
        variables["reasoning_effort"] = parsed.reasoning_effort
    return think, variables


def _schema_grammar(schema: dict[str, Any] | None, think: ThinkFirst | None = None) -> str | None:
    try:
        return None if schema is None else json_schema_grammar(schema, think)
    except ShardsError as error:
        raise InvalidRequestError(f"the JSON schema cannot be used: {error}", "response_format") from None


def start_generation(request: web.Request, parsed: ChatRequest, deployment: Deployment, *,
                     max_context: int | None = None, resume: tuple[int, ...] = (),
                     call_pieces: bool = False) -> Generation:
    """A generation of ``parsed`` (its messages through the chat template, with its tools,
    else its prompt as it is) on ``deployment``, timed and counted; ``max_context`` narrows
    the model's context; ``call_pieces``: the caller streams the calls' pieces (OpenAI)."""
    prompt_ids, grammar, reader = _prompt(parsed, deployment, call_pieces=call_pieces)
    params = sampling_params(parsed, len(prompt_ids), max_context or deployment.settings.max_context, grammar,
                             default_max_tokens=request.app[CONFIG].default_max_tokens)
    if resume:  # the reader reads on where the lost orchestrator's stopped (its text went out already)
        decoder = deployment.tokenizer.stream_decoder(skip_special_tokens=True)
        for token in resume:
            reader.push(decoder.push(token))
    events = request.app[METRICS].observe_generation(
        deployment.name, request.app[ORCHESTRATOR].complete(deployment, prompt_ids, params, resume,
                                                            cache_prompt=parsed.cache_prompt,
                                                            draft_tokens=parsed.draft_tokens,
                                                            draft_p_min=parsed.draft_p_min))
    return Generation(events, reader)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_entries(calls: list[ToolCall], *, arguments_as_text: bool) -> list[dict[str, Any]]:
    """Calls as the APIs answer them: OpenAI's (ids, arguments as JSON text) or Ollama's."""
    entries = []
    for call in calls:
        arguments: Any = json.dumps(call.arguments, ensure_ascii=False) if arguments_as_text else call.arguments
        entry: dict[str, Any] = {"function": {"name": call.name, "arguments": arguments}}
        if arguments_as_text:
            entry = {"id": _call_id(), "type": "function", **entry}
        entries.append(entry)
    return entries


def call_delta_entries(deltas: tuple[CallDelta, ...]) -> list[dict[str, Any]]:
    """Pieces of calls as OpenAI streams them: a call's first piece has its id, type and
    name; the next ones, more of its arguments' text."""
    entries: list[dict[str, Any]] = []
    for delta in deltas:
        if delta.name is None:
            entries.append({"index": delta.index, "function": {"arguments": delta.arguments}})
        else:
            entries.append({"index": delta.index, "id": _call_id(), "type": "function",
                            "function": {"name": delta.name, "arguments": delta.arguments}})
    return entries


def chat_logprobs(tokenizer: Tokenizer, entries: tuple[TokenLogprobs, ...]) -> dict[str, Any]:
    """OpenAI's ``choices[].logprobs`` of a chat answer: one entry per token."""
    def token(token_id: int, logprob: float) -> dict[str, Any]:
        piece = tokenizer.token_bytes(token_id)
        return {"token": piece.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(piece)}

    return {"content": [{**token(e.token, e.logprob), "top_logprobs": [token(i, lp) for i, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(tokenizer: Tokenizer, entries: tuple[TokenLogprobs, ...], offset: int) -> dict[str, Any]:
    """The legacy completions' ``choices[].logprobs``; ``offset``: where the text starts."""
    texts = [tokenizer.token_bytes(e.token).decode("utf-8", errors="replace") for e in entries]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": [e.logprob for e in entries], "text_offset": offsets,
            "top_logprobs": [{tokenizer.token_bytes(i).decode("utf-8", errors="replace"): lp for i, lp in e.top}
                             for e in entries]}


async def chain_events(first: Completion, rest: AsyncIterator[Completion]) -> AsyncIterator[Completion]:
    """``first`` and, unless it ended the generation, the events after it."""
    yield first
    if first.finish_reason is None:
        async for event in rest:
            yield event
