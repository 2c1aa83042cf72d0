"""`ncm serve`, `ncm join`, `ncm invite`, `ncm remove`, `ncm status`, `ncm chat` and `ncm admin-token`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import importlib
import json
import logging
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agent.core.errors import NcmError
from agent.core.invites import JOIN_PREFIX
from agent.local.config import ConfigError, load_config, read_config_file, write_config_file

log = logging.getLogger(__name__)
DEFAULT_AGENT_URL = "http://127.0.0.1:8080"
HTTP_TIMEOUT_S = 10.0
CHAT_TIMEOUT_S = 300.0  # the longest wait for the next piece of an answer (a model may load first)
MAP_MAX_COLUMNS = 64  # wider models share columns in the status layer map
ON_ROUTE, STANDBY, NOT_HELD = "█", "░", "·"


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="run the agent of this device", description="Run the ncm agent in the foreground.")
    serve.add_argument("--config", type=Path, help="TOML config file (default: /etc/ncm/agent.toml when it exists)")
    serve.add_argument("--port", type=int, help="API port (default 8080)")
    serve.add_argument("--host", help="API bind address (default 0.0.0.0)")
    serve.add_argument("--peer", action="append", dest="peers", metavar="URL", help="a peer agent's URL, for networks without mDNS (repeatable)")
    serve.add_argument("--state-dir", type=Path, help="where the node id and models live")
    serve.add_argument("--model", help="model the cluster serves")
    serve.add_argument("--cluster-name", help="name of the cluster to join")
    serve.add_argument("--no-mdns", dest="mdns", action="store_const", const=False, help="do not use mDNS")
    serve.add_argument("--orchestrator", action="store_const", const=True, help="claim the orchestrator role")
    serve.set_defaults(func=run_serve)

    join = subparsers.add_parser("join", help="join a cluster with a join string (`ncm invite`), or add a peer by URL")
    join.add_argument("url", metavar="JOIN_STRING_OR_URL",
                      help="a join string from `ncm invite` on a member, or the URL of an agent of this cluster")
    join.add_argument("--agent", default=DEFAULT_AGENT_URL, help="the local agent (default %(default)s)")
    join.add_argument("--config", type=Path, help="also save the peer in this config file")
    join.add_argument("--token", help="the cluster's admin token (default: this device's, when readable)")
    join.set_defaults(func=run_join)

    invite = subparsers.add_parser("invite", help="print a join string that lets a new device join this cluster")
    invite.add_argument("--ttl", default="1h", help="how long it can be used: 90s, 30m, 1h, 2d (default %(default)s)")
    invite.add_argument("--uses", type=int, default=1, help="how many devices may use it (default %(default)s)")
    invite.add_argument("--list", action="store_true", help="list the open invites instead")
    invite.add_argument("--revoke", metavar="ID", help="revoke an open invite instead")
    invite.add_argument("--agent", default=DEFAULT_AGENT_URL, help="the local agent (default %(default)s)")
    invite.add_argument("--token", help="the cluster's admin token (default: this device's, when readable)")
    invite.set_defaults(func=run_invite)

    remove = subparsers.add_parser("remove", help="remove a device: the cluster key changes on every other member")
    remove.add_argument("node", help="the node id (see ncm status)")
    remove.add_argument("--agent", default=DEFAULT_AGENT_URL, help="any agent of the cluster (default %(default)s)")
    remove.add_argument("--token", help="the cluster's admin token (default: this device's, when readable)")
    remove.set_defaults(func=run_remove)

    admin = subparsers.add_parser(
        "admin-token", help="print the cluster's admin token (loading, unloading, joining and reloading need it)")
    admin.add_argument("--config", type=Path, help="TOML config file (default: /etc/ncm/agent.toml when it exists)")
    admin.set_defaults(func=run_admin_token)

    status = subparsers.add_parser("status", help="show the cluster as an agent sees it")
    status.add_argument("--remote", default=DEFAULT_AGENT_URL, help="agent to ask (default %(default)s)")
    status.add_argument("--token", help="API token, if the agent needs one")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=run_status)

    chat = subparsers.add_parser("chat", help="talk to a model of a running cluster",
                                 description="Chat with a model of a running cluster: one line per turn; "
                                             "/reset clears the conversation, /exit or end of input ends.")
    chat.add_argument("model", nargs="?", metavar="MODEL", help="model to talk to (default: the cluster's main model)")
    chat.add_argument("--remote", default=DEFAULT_AGENT_URL, help="any agent of the cluster (default %(default)s)")
    chat.add_argument("--token", help="API key, if the cluster needs one")
    chat.add_argument("--system", metavar="TEXT", help="system message that opens the conversation")
    chat.add_argument("--max-tokens", type=int, metavar="N",
                      help="most tokens per answer (default: what the context has room for)")
    chat.add_argument("--temperature", type=float, metavar="T", help="0 = greedy (default: the server's)")
    chat.set_defaults(func=run_chat)


def local_admin_token(config_path: Path | None = None, *, create: bool = False) -> str | None:
    """The admin token of this device's cluster key; None when this user cannot read it."""
    from agent.core.auth import admin_token
    from agent.node.service import cluster_key, stored_cluster_key

    try:
        config = load_config(config_path)
        key = cluster_key(config) if create else stored_cluster_key(config)
    except (ConfigError, OSError) as error:
        if create:
            raise NcmError(f"cannot read this device's cluster key: {error}") from None
        return None
    return admin_token(key) if key else None


def run_admin_token(args: argparse.Namespace) -> int:
    print(local_admin_token(args.config, create=True))
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from agent.node.service import serve

    overrides = {name: getattr(args, name) for name in ("port", "host", "state_dir", "model", "cluster_name", "mdns", "orchestrator")}
    overrides["peers"] = tuple(args.peers) if args.peers else None
    config = load_config(args.config, overrides=overrides)
    asyncio.run(serve(config))
    return 0


def http_json(method: str, url: str, payload: Any = None, *, token: str | None = None,
              timeout_s: float = HTTP_TIMEOUT_S) -> Any:
    """A small blocking JSON call for the command line; errors become NcmError with the reason."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        try:
            message = json.loads(error.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = error.reason
        raise NcmError(f"{url}: HTTP {error.code}: {message}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise NcmError(f"cannot reach {url}: {reason}") from None


def save_peer(config_path: Path, url: str) -> None:
    values = read_config_file(config_path) if config_path.exists() else {}
    peers = list(values.get("peers", []))
    if url not in peers:
        peers.append(url)
    values["peers"] = peers
    write_config_file(config_path, values)


def parse_duration_s(text: str) -> float:
    """'90s', '30m', '1h', '2d' or a number of seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    try:
        return float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError:
        raise ConfigError(f"{text!r} is not a duration (90s, 30m, 1h, 2d)") from None


def run_invite(args: argparse.Namespace) -> int:
    base, token = args.agent.rstrip("/") + "/cluster/invites", args.token or local_admin_token()
    if args.revoke:
        http_json("DELETE", f"{base}/{args.revoke}", token=token)
        print(f"revoked invite {args.revoke}")
        return 0
    if args.list:
        invites = http_json("GET", base, token=token)["data"]
        for invite in invites:
            print(f"{invite['id']}  {invite['uses_left']} use(s) left, expires in {invite['expires_in_s']:.0f} s")
        if not invites:
            print("no open invites")
        return 0
    answer = http_json("POST", base, {"ttl_s": parse_duration_s(args.ttl), "uses": args.uses}, token=token)
    print(answer["join"])
    print(f"(invite {answer['id']}: {answer['uses_left']} use(s), expires in {answer['expires_in_s']:.0f} s; on the "
          f"new device: ncm join <this string>, or join = <this string> in ncm-setup.txt)", file=sys.stderr)
    return 0


def run_remove(args: argparse.Namespace) -> int:
    answer = http_json("POST", args.agent.rstrip("/") + "/cluster/remove", {"node": args.node},
                       token=args.token or local_admin_token(), timeout_s=60.0)
    print(f"removed {answer['removed']}; the new cluster key went to {', '.join(answer['rekeyed']) or 'no one'} "
          f"(they restart with it)")
    for node, reason in answer.get("unreachable", {}).items():
        print(f"  {node} did not get it ({reason}): pair it again with ncm invite / ncm join", file=sys.stderr)
    return 0


def run_join(args: argparse.Namespace) -> int:
    if args.url.strip().startswith(JOIN_PREFIX):
        answer = http_json("POST", args.agent.rstrip("/") + "/cluster/join", {"invite": args.url.strip()},
                           token=args.token or local_admin_token(args.config), timeout_s=60.0)
        print(answer.get("message", "joined"))
        return 0
    url = args.url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{args.url!r} is not an http(s):// URL")
    health = http_json("GET", url + "/health")
    answer = http_json("POST", args.agent.rstrip("/") + "/cluster/join", {"url": url},
                       token=args.token or local_admin_token(args.config))
    print(f"joined: the agent at {args.agent} now contacts {url} (node {health.get('node_id')}); {answer.get('message', '')}")
    if args.config:
        save_peer(args.config, url)
        print(f"saved the peer in {args.config}")
    return 0


def run_status(args: argparse.Namespace) -> int:
    base = args.remote.rstrip("/")
    nodes = http_json("GET", base + "/cluster/nodes", token=args.token)
    try:
        status = http_json("GET", base + "/cluster/status", token=args.token)
    except NcmError as error:
        status = {"state": "unknown", "message": str(error)}
    if args.json:
        json.dump({"status": status, "nodes": nodes}, sys.stdout, indent=2)
        print()
        return 0
    print(f"cluster {nodes['cluster']!r}: {status.get('state')} — {status.get('message', '')}")
    print(f"orchestrator: {nodes['orchestrator']} (epoch {nodes['epoch']})  model: {status.get('model')}")
    print(f"{'node':<34} {'url':<26} {'alive':<6} {'role':<13} {'score':>8}  layers")
    for node in nodes["nodes"]:
        worker = node.get("worker") or {}
        layers = ", ".join(f"{a}-{b}" for a, b in (f["layers"] for f in worker.get("fragments", []))) or "-"
        score = f"{node['score']:.2f}" if node.get("score") is not None else "-"
        print(f"{(node['id'] or '?') + (' *' if node.get('self') else ''):<34} {node['url']:<26} "
              f"{'yes' if node['alive'] else 'no':<6} {node.get('role') or '-':<13} {score:>8}  {layers}")
    for node_id, fault in sorted((status.get("faults") or {}).items()):
        print(f"left out of plans: {node_id}: {fault.get('cause')} ({fault.get('message')})")
    alive = set(status.get("nodes_alive") or ())
    for model_name, entry in sorted((status.get("models") or {}).items()):
        print()
        for line in render_layer_map(model_name, entry, alive):
            print(line)
    return 0


def format_route(route: list[dict[str, Any]]) -> str:
    """'node-0 [0-1] → node-1 [2]': a route of /cluster/status, layer ranges inclusive."""
    hops = []
    for hop in route:
        first, last = hop["layers"]
        hops.append(f"{hop['node']} [{first}]" if first == last else f"{hop['node']} [{first}-{last}]")
    return " → ".join(hops) or "-"


def render_layer_map(model_name: str, entry: dict[str, Any], alive: set[str] | frozenset[str]) -> list[str]:
    """The text lines `ncm status` prints for one loaded model of /cluster/status's "models".

    A title with the route (and what a degraded model serves instead); then, when the agent
    reports "total_layers" and "layers" (older ones do not), a header of layer numbers, one
    row per node and a legend. A row has one character per layer: ON_ROUTE where the node
    runs the layer on the route in use, STANDBY where it holds it without running it (replica
    or standby range), NOT_HELD elsewhere; nodes not in ``alive`` are marked " (dead)".
    Models of more than MAP_MAX_COLUMNS layers share columns evenly; a column shows the
    strongest mark of its layers.
    """
    route = entry.get("route") or []
    title = f"model {model_name}"
    if entry.get("plan_version") is not None:
        title += f" (plan {entry['plan_version']})"
    lines = [f"{title}: {format_route(route)}"]
    if entry.get("degraded"):
        lines.append(f"degraded: serving {entry.get('serving')}")
    total = entry.get("total_layers")
    if not isinstance(total, int) or total < 1 or "layers" not in entry:
        return lines

    running: dict[str, set[int]] = {}
    for hop in route:
        first, last = hop["layers"]
        running.setdefault(hop["node"], set()).update(range(first, last + 1))
    held: dict[str, set[int]] = {}
    for layer in entry.get("layers") or []:
        for node in layer.get("holders") or []:
            held.setdefault(node, set()).add(layer["layer"])
    for node, (first, last) in entry.get("replicas") or []:
        held.setdefault(node, set()).update(range(first, last + 1))
    nodes = list(dict.fromkeys([hop["node"] for hop in route] + sorted(held)))

    per_column = -(-total // MAP_MAX_COLUMNS)  # layers per column, ceiling
    columns = [range(start, min(start + per_column, total)) for start in range(0, total, per_column)]
    width = max(len(node) for node in nodes) if nodes else 0
    step = 4 if len(columns) <= 32 else 8
    header = ""
    for index in range(0, len(columns), step):
        header = header.ljust(index) + str(columns[index].start)
    lines.append(" " * (width + 2) + header)
    for node in nodes:
        on_route, holds = running.get(node, set()), held.get(node, set())
        cells = []
        for column in columns:
            if any(layer in on_route for layer in column):
                cells.append(ON_ROUTE)
            elif any(layer in holds for layer in column):
                cells.append(STANDBY)
            else:
                cells.append(NOT_HELD)
        lines.append(f"{node:<{width}}  {''.join(cells)}{'' if node in alive else ' (dead)'}")
    note = f"{ON_ROUTE} on the route  {STANDBY} replica/standby  {NOT_HELD} not held"
    if per_column > 1:
        note += f"  (one column: {per_column} layers)"
    lines.append(" " * (width + 2) + note)
    return lines


def run_models_remote(args: argparse.Namespace) -> int:
    """`ncm models --remote URL`: the cluster's models as its router sees them."""
    token = args.token or (local_admin_token() if args.reload else None)
    answer = http_json("GET", args.remote.rstrip("/") + "/models" + ("?reload=1" if args.reload else ""), token=token)
    if args.json:
        json.dump(answer, sys.stdout, indent=2)
        print()
        return 0
    print(f"{'model':<28} {'state':<10} {'busy':>4} {'waiting':>7}  {'memory':>10}  aliases / reason")
    for model in answer["data"]:
        memory = model.get("memory") or {}
        held = sum((memory.get("effective_bytes") or memory.get("min_bytes") or {}).values())
        note = model.get("reason") or ", ".join(model.get("aliases") or []) or ""
        if model.get("degraded"):
            note = f"degraded: serving {model.get('serving')}"
        print(f"{model['id']:<28} {model['state']:<10} {model['active_requests']:>4} {model['waiters']:>7}  "
              f"{held / 2**20:>7.0f} MiB  {note}")
    return 0


def extend_models_parser(parser: argparse.ArgumentParser) -> None:
    """`ncm models` lists the local store; with --remote it asks a running cluster."""
    local = parser.get_default("func")
    parser.add_argument("--remote", metavar="URL", help="show the models of the cluster at URL (any agent)")
    parser.add_argument("--reload", action="store_true", help="with --remote: re-read the cluster's model sources")
    parser.add_argument("--token", help="API key of the cluster, or its admin token for --reload (with --remote)")
    parser.add_argument("--json", action="store_true", help="with --remote: print the JSON answer")
    parser.set_defaults(func=lambda args: run_models_remote(args) if args.remote else local(args))


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
                timeout_s: float = CHAT_TIMEOUT_S) -> Iterator[str]:
    """POST ``payload`` (with "stream": true) to a /v1/chat/completions ``url``; yields the
    content pieces of the server-sent events as they arrive.

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
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        yield content
    except urllib.error.HTTPError as error:
        raise ChatError(_api_error_message(error.read(), f"HTTP {error.code} {error.reason}")) from None
    except (urllib.error.URLError, http.client.HTTPException, TimeoutError, OSError) as error:
        reason = getattr(error, "reason", None) or error
        raise ChatConnectionError(f"cannot reach {url}: {reason}") from None


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
        try:
            for piece in stream_chat(url, {**settings, "messages": [*opening, *history, turn]}, token=args.token):
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
