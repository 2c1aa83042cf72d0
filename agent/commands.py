"""`ncm serve`, `ncm join`, `ncm invite`, `ncm status` and `ncm admin-token`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from agent.config import ConfigError, load_config, read_config_file
from agent.core.errors import NcmError
from agent.core.invites import JOIN_PREFIX

log = logging.getLogger(__name__)
DEFAULT_AGENT_URL = "http://127.0.0.1:8080"
HTTP_TIMEOUT_S = 10.0


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


def local_admin_token(config_path: Path | None = None, *, create: bool = False) -> str | None:
    """The admin token of this device's cluster key; None when this user cannot read it."""
    from agent.core.auth import admin_token
    from agent.service import cluster_key, stored_cluster_key

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
    from agent.service import serve

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


def format_toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def save_peer(config_path: Path, url: str) -> None:
    values = read_config_file(config_path) if config_path.exists() else {}
    peers = list(values.get("peers", []))
    if url not in peers:
        peers.append(url)
    values["peers"] = peers
    text = "".join(f"{key} = {format_toml_value(value)}\n" for key, value in values.items())
    config_path.parent.mkdir(parents=True, exist_ok=True)
    temporary = config_path.with_suffix(".tmp")
    temporary.write_text(text, encoding="utf-8")
    temporary.replace(config_path)


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
    return 0


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
