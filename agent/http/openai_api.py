"""OpenAI's completion endpoints: `/v1/chat/completions` and `/v1/completions`, streamed (SSE) and
not, through any agent (one that is not the orchestrator passes the request on to it)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from agent.core.chat_request import ChatRequest, parse_request
from agent.core.errors import (
    ClusterError,
    InvalidRequestError,
    without_addresses,
)
from agent.core.request_fields import OPENAI_CHAT, OPENAI_COMPLETION, check_fields
from agent.dataplane.links import StageError
from agent.http.app_keys import (
    ROUTER,
)
from agent.http.bodies import read_json
from agent.http.clients import client_of, from_member
from agent.http.generation import (
    call_delta_entries,
    chain_events,
    chat_logprobs,
    completion_logprobs,
    start_generation,
    tool_call_entries,
)
from agent.http.metrics_endpoint import REQUEST_MODEL
from agent.http.model_endpoints import autoload_of
from agent.http.proxy import RESUMABLE_HEADER, RESUME_FIELD, TOKENS_FIELD, pass_to_orchestrator
from agent.orchestration.orchestrator import Completion, Deployment
from agent.orchestration.public_errors import public_reason
from shards.runtime.answer_reader import AnswerPiece
from shards.runtime.sampling import TokenLogprobs

log = logging.getLogger(__name__)

routes = web.RouteTableDef()


async def _completion(request: web.Request, *, chat: bool) -> web.StreamResponse:
    body = await read_json(request)
    if isinstance(body, dict):
        check_fields(body, OPENAI_CHAT if chat else OPENAI_COMPLETION,
                     internal=(RESUME_FIELD,) if from_member(request) else ())
    parsed = parse_request(body, chat=chat)
    autoload = autoload_of(request)
    proxied = await pass_to_orchestrator(request)
    if proxied is not None:
        if proxied.status < 400:  # a name the orchestrator accepted: a bounded set, fit for a label
            request[REQUEST_MODEL] = parsed.model or ""
        return proxied
    router = request.app[ROUTER]
    arrived = time.perf_counter()
    name = request[REQUEST_MODEL] = router.resolve(parsed.model)
    async with router.use(name, client=client_of(request), autoload=autoload) as deployment:
        # Server-Timing: how long the router held the request (resolve, load or wake, admission).
        timing = {"Server-Timing": f"router;dur={1000 * (time.perf_counter() - arrived):.3f}"}
        return await _generate(request, parsed, deployment, chat=chat, headers=timing,
                               resume=_resume_tokens(request, body, deployment))


def _resume_tokens(request: web.Request, body: Any, deployment: Deployment) -> tuple[int, ...]:
    """The ids a lost orchestrator sampled for this request, when a member passes it on to go on
    after them (see :mod:`agent.http.proxy`); ignored from anyone else."""
    resume = body.get(RESUME_FIELD) if isinstance(body, dict) and from_member(request) else None
    if resume is None:
        return ()
    tokens = resume.get("tokens") if isinstance(resume, dict) else None
    vocab = deployment.tokenizer.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                               for t in tokens):
        raise InvalidRequestError(f"'{RESUME_FIELD}.tokens' must be a list of token ids", RESUME_FIELD)
    return tuple(tokens)


async def _generate(request: web.Request, parsed: ChatRequest, deployment: Deployment, *, chat: bool,
                    headers: dict[str, str], resume: tuple[int, ...] = ()) -> web.StreamResponse:
    generation = start_generation(request, parsed, deployment, resume=resume, call_pieces=parsed.stream)
    events, reader = generation.events, generation.reader
    created = int(time.time())
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    with_tokens = bool(request.headers.get(RESUMABLE_HEADER)) and from_member(request)

    def usage_of(last: Completion) -> dict[str, Any]:
        return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                "total_tokens": last.prompt_tokens + last.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": last.cached_tokens}}

    tokenizer = deployment.tokenizer
    if not parsed.stream:
        pieces, last, logprobs = [], Completion("", deployment.name), []
        async for event in events:
            pieces.append(reader.push(event.text))
            logprobs += event.logprobs
            last = event
        answer = AnswerPiece.joined([*pieces, reader.finish()])
        text_out, calls = answer.content, list(answer.calls)
        finish = "tool_calls" if calls else last.finish_reason
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if parsed.logprobs is not None:
            choice["logprobs"] = (chat_logprobs(tokenizer, tuple(logprobs)) if chat
                                  else completion_logprobs(tokenizer, tuple(logprobs), 0))
        if chat:
            choice["message"] = {"role": "assistant", "content": text_out or (None if calls else "")}
            if answer.reasoning:
                choice["message"]["reasoning_content"] = answer.reasoning
            if calls:
                choice["message"]["tool_calls"] = tool_call_entries(calls, arguments_as_text=True)
        else:
            choice["text"] = text_out
        return web.json_response({"id": ident, "object": "chat.completion" if chat else "text_completion",
                                  "created": created, "model": last.model, "choices": [choice],
                                  "usage": usage_of(last)}, headers=headers)

    # Streaming: the first step runs before the headers go out, so early failures are still 4xx/5xx.
    first = await anext(events)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
    await response.prepare(request)
    kind = "chat.completion.chunk" if chat else "text_completion"

    sent_chars = 0  # of the text, for the legacy completions' text offsets

    async def send(model: str, piece: AnswerPiece, finish: str | None, *, role: bool = False,
                   tokens: tuple[int, ...] = (), logprobs: tuple[TokenLogprobs, ...] = ()) -> None:
        nonlocal sent_chars
        text = piece.content
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if piece.reasoning:
                delta["reasoning_content"] = piece.reasoning
            if text:
                delta["content"] = text
            if piece.deltas:
                delta["tool_calls"] = call_delta_entries(piece.deltas)
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            if logprobs:
                choice["logprobs"] = chat_logprobs(tokenizer, logprobs)
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            if logprobs:
                choice["logprobs"] = completion_logprobs(tokenizer, logprobs, sent_chars)
            sent_chars += len(text or "")
        chunk = {"id": ident, "object": kind, "created": created, "model": model, "choices": [choice]}
        if with_tokens:
            chunk[TOKENS_FIELD] = list(tokens)
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

    try:
        if chat:
            await send(first.model, AnswerPiece(), None, role=True)
        last = first
        async for event in chain_events(first, events):
            last = event
            piece = reader.push(event.text)
            if event.finish_reason is None:
                await send(event.model, piece, None, tokens=event.tokens, logprobs=event.logprobs)
                continue
            piece = AnswerPiece.joined([piece, reader.finish()])
            if piece.calls:  # its last pieces, then the finish on its own, as OpenAI ends a call
                await send(event.model, piece, None, tokens=event.tokens, logprobs=event.logprobs)
                await send(event.model, AnswerPiece(), "tool_calls")
            else:
                await send(event.model, piece, event.finish_reason, tokens=event.tokens, logprobs=event.logprobs)
        if parsed.include_usage:
            chunk = {"id": ident, "object": kind, "created": created, "model": last.model, "choices": [],
                     "usage": usage_of(last)}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
    except (StageError, ClusterError) as error:
        # Headers are gone: report the failure inside the stream, in the OpenAI error shape.
        payload = {"error": {"message": without_addresses(str(error)), "type": "service_unavailable",
                             "param": None, "code": getattr(error, "code", "cluster_unavailable")}}
        await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
    except Exception as error:  # noqa: BLE001 - a bug ends the stream with an error event, never silently
        log.exception("completion %s failed", ident)
        payload = {"error": {"message": public_reason(error), "type": "server_error", "param": None,
                             "code": "internal_error"}}
        await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
    finally:
        await events.aclose()
    await response.write_eof()
    return response


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=True)


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=False)
