"""The agent's commands: their parsers, and `ncm serve`, `ncm join`, `ncm invite`, `ncm remove` and
`ncm admin-token` (`ncm status` and `ncm models --remote`: :mod:`agent.cli.status_map`; `ncm chat`:
:mod:`agent.cli.chat`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from agent.cli.chat import run_chat
from agent.cli.http_client import http_json, local_admin_token
from agent.cli.status_map import run_status
from agent.core.invites import JOIN_PREFIX
from agent.local.config import ConfigError, load_config, read_config_file, write_config_file

log = logging.getLogger(__name__)
DEFAULT_AGENT_URL = "http://127.0.0.1:8080"


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


