"""A stranger on the home network: an HTTP server that holds no cluster key but claims to be
the orchestrator of a newer epoch, with a huge capacity, and answers every prompt itself.

It is what took a cluster over before answers were authenticated. It announces a peer port
where it serves the same over TLS with a certificate of a CA of its own making, as an
attacker who read the code would. It records every request it gets (`GET
/impostor/seen` lists them) so a test can tell whether the agents followed, contacted or
forwarded prompts to it. With ``--mdns ADDRESS`` it also announces itself as an agent of the
cluster over mDNS.

    python -m tests.agent.impostor --port 9000 --peer-port 9001 --cluster test [--mdns 10.0.0.9]
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import ssl
import tempfile
from pathlib import Path
from typing import Any

from aiohttp import web

from agent import __version__
from agent.cluster.tls import issue_node_files
from agent.core.advert import SERVICE_TYPE, NodeAdvert, encode_txt
from agent.core.auth import HEADER_NODE, HEADER_SIGNATURE
from agent.core.capacity import NodeCapacity
from agent.core.election import Election

NODE_ID = "impostor-0000000000000001"
ANSWER = "The impostor chose this answer."
SEEN_PATH = "/impostor/seen"


def impostor_advert(cluster: str, port: int) -> NodeAdvert:
    return NodeAdvert(
        node_id=NODE_ID, cluster=cluster, api_port=port, version=__version__, role="orchestrator",
        capacity=NodeCapacity(NODE_ID, vram_gib=512.0, ram_gib=1024.0, npu_tops=1000.0),
        election=Election(NODE_ID, 1000),
    )


def impostor_tls() -> ssl.SSLContext:
    """A TLS server context with a certificate from a CA derived from a key it made up."""
    with tempfile.TemporaryDirectory() as directory:
        files = issue_node_files(secrets.token_bytes(32), NODE_ID, Path(directory))
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(files.certificate), str(files.key))
    return context


async def start_impostor(cluster: str, host: str, port: int, peer_port: int) -> web.AppRunner:
    """The impostor on ``port`` (plain HTTP) and ``peer_port`` (TLS, its own CA)."""
    runner = web.AppRunner(impostor_app(cluster, port, peer_port), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    await web.TCPSite(runner, host, peer_port, ssl_context=impostor_tls()).start()
    return runner


def impostor_app(cluster: str, port: int, peer_port: int) -> web.Application:
    seen: list[dict[str, Any]] = []
    advert = impostor_advert(cluster, port)

    async def anything(request: web.Request) -> web.StreamResponse:
        if request.path == SEEN_PATH:
            return web.json_response(seen)
        seen.append({"method": request.method, "path": request.path, "signed": HEADER_SIGNATURE in request.headers,
                     "from": request.remote})
        # Headers that look like a signed answer, made without the key.
        forged = {HEADER_NODE: NODE_ID, HEADER_SIGNATURE: secrets.token_hex(32)}
        if request.path == "/health":
            return web.json_response({"status": "ok", "node_id": NODE_ID, "role": "orchestrator",
                                      "orchestrator": NODE_ID, "peer_port": peer_port})
        if request.path == "/internal/describe":
            return web.json_response({"advert": advert.to_json(), "peers": [], "you": request.remote}, headers=forged)
        if request.path.startswith("/v1/"):
            return web.json_response({
                "id": "chatcmpl-impostor", "object": "chat.completion", "created": 0, "model": "smollm2-135m",
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": ANSWER}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }, headers=forged)
        return web.json_response({"ok": True}, headers=forged)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    return app


async def announce(address: str, advert: NodeAdvert) -> Any:
    """Register the impostor as an agent of the cluster over mDNS (returns the zeroconf)."""
    from zeroconf import IPVersion
    from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

    aiozc = AsyncZeroconf(interfaces=[address], ip_version=IPVersion.V4Only)
    info = AsyncServiceInfo(SERVICE_TYPE, f"ncm-impostor.{SERVICE_TYPE}", port=advert.api_port,
                            properties=encode_txt(advert), server="ncm-impostor.local.", parsed_addresses=[address])
    await aiozc.async_register_service(info, allow_name_change=True)
    return aiozc


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--peer-port", type=int, required=True)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--mdns", metavar="ADDRESS", help="announce over mDNS on this interface address")
    args = parser.parse_args(argv)
    runner = await start_impostor(args.cluster, args.host, args.port, args.peer_port)
    aiozc = await announce(args.mdns, impostor_advert(args.cluster, args.port)) if args.mdns else None
    try:
        await asyncio.Event().wait()
    finally:
        if aiozc is not None:
            await aiozc.async_close()
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
