"""`ncm chat`: talk to a model of a cluster in the terminal, its answers streamed."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import importlib
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from agent.cli.http_client import HTTP_TIMEOUT_S
from agent.core.errors import NcmError

CHAT_TIMEOUT_S = 300.0  # the longest wait for the next piece of an answer (a model may load first)


class ChatError(NcmError):
    """An answer the API refused or broke off (its message is the API's), in `ncm chat`."""


class ChatConnectionError(NcmError):
    """`ncm chat` could not reach the agent, or lost it during an answer."""


def _api_error_message(body: bytes, fallback: str) -> str:
    """The message of an OpenAI-shaped error body ({"error": {"message": ...}}), else ``fallback``."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return fallback
    return str(message)


def stream_chat(url: str, payload: dict[str, Any], *, token: str | None = None,
                timeout_s: float = CHAT_TIMEOUT_S, on_reasoning: Callable[[str], None] | None = None) -> Iterator[str]:
    """POST ``payload`` (with "stream": true) to a /v1/chat/completions ``url``; yields the
    content pieces of the server-sent events as they arrive (a reasoning model's reasoning
    pieces go to ``on_reasoning``, when given).

    Raises ChatError for an error answer (HTTP status or an error object in the stream) and
    ChatConnectionError when the agent cannot be reached or the connection breaks.
    """
    request = urllib.request.Request(url, data=json.dumps({**payload, "stream": True}).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            for raw in response:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue  # blank separators, comments, "event:" lines
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                try:
                    chunk = json.loads(data)
                except ValueError:
                    raise ChatError(f"the agent sent an event that is not JSON: {data[:80]!r}") from None
                if not isinstance(chunk, dict):
                    continue
                if chunk.get("error") is not None:
                    error = chunk["error"]
                    raise ChatError(str(error.get("message") if isinstance(error, dict) else error))
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("reasoning_content") and on_reasoning is not None:
                        on_reasoning(delta["reasoning_content"])
                    if delta.get("content"):
                        yield delta["content"]
    except urllib.error.HTTPError as error:
        raise ChatError(_api_error_message(error.read(), f"HTTP {error.code} {error.reason}")) from None
    except (urllib.error.URLError, http.client.HTTPException, TimeoutError, OSError) as error:
        reason = getattr(error, "reason", None) or error
        raise ChatConnectionError(f"cannot reach {url}: {reason}") from None


def _show_reasoning(text: str) -> None:
    """A reasoning model's reasoning, on standard error (dimmed on a terminal) before its reply."""
    dim = sys.stderr.isatty()
    sys.stderr.write(f"\x1b[2m{text}\x1b[0m" if dim else text)
    sys.stderr.flush()


def _unreachable(url: str, token: str | None) -> str | None:
    """Why no agent answers at ``url``; None when one does (with any HTTP status)."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S):
            return None
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, http.client.HTTPException, TimeoutError, OSError) as error:
        return str(getattr(error, "reason", None) or error)


def _read_turn(interactive: bool) -> str | None:
    """The next line of input (the "> " prompt only on a terminal); None at end of input."""
    if interactive:
        try:
            return input("> ")
        except EOFError:
            print()
            return None
    line = sys.stdin.readline()
    return line if line else None


def run_chat(args: argparse.Namespace) -> int:
    """`ncm chat`: a conversation with a model of a running cluster, one line per turn.

    Every turn sends the whole conversation so far; an answer the API refuses is reported
    as "error: ..." on stderr and the conversation goes on without that turn. Losing the
    agent ends the command with status 1.
    """
    base = args.remote.rstrip("/")
    url = base + "/v1/chat/completions"
    if (reason := _unreachable(base + "/health", args.token)) is not None:
        print(f"ncm chat: error: cannot reach an agent at {base}: {reason} (is `ncm serve` running there?)",
              file=sys.stderr)
        return 1
    interactive = sys.stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):
            importlib.import_module("readline")  # line editing and history for input()
    opening = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = []
    settings: dict[str, Any] = {}
    if args.model:
        settings["model"] = args.model
    if args.max_tokens is not None:
        settings["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        settings["temperature"] = args.temperature
    if interactive:
        print(f"chatting with {args.model or 'the main model'} at {args.remote}; /reset forgets the conversation, "
              f"/exit or Ctrl-D ends", file=sys.stderr)
    while (line := _read_turn(interactive)) is not None:
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            break
        if text == "/reset":
            history.clear()
            if interactive:
                print("(conversation cleared)", file=sys.stderr)
            continue
        turn = {"role": "user", "content": text}
        pieces: list[str] = []
        reasoned: list[str] = []  # shown as it comes, on standard error, before the reply

        def reason(text: str) -> None:
            reasoned.append(text)
            _show_reasoning(text)

        try:
            for piece in stream_chat(url, {**settings, "messages": [*opening, *history, turn]}, token=args.token,
                                     on_reasoning=reason):
                if reasoned and not pieces:
                    _show_reasoning("\n\n")
                pieces.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except ChatError as error:
            if pieces:
                print()
            print(f"error: {error}", file=sys.stderr)
            continue
        except ChatConnectionError as error:
            if pieces:
                print()
            print(f"ncm chat: error: {error}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            if not interactive:
                raise
            print("\n(interrupted; the answer is left out of the conversation)", file=sys.stderr)
            continue
        print()
        history += [turn, {"role": "assistant", "content": "".join(pieces)}]
    return 0
