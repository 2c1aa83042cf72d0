"""`ncm chat` against a real in-process cluster serving the tiny model: run as a user would,
with its input piped, so it prints no prompt and ends at /exit."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from tests.agent.agents import free_ports
from tests.agent.inprocess import call
from tests.agent.tiny import TINY, tiny_cluster

REPO_ROOT = Path(__file__).resolve().parents[3]
CHAT_TIMEOUT_S = 60.0
FIRST = "w5 w6 w7"
SECOND = "w8"


async def run_chat(url: str, lines: list[str], *options: str) -> tuple[int, str, str]:
    """`ncm chat` as a subprocess with ``lines`` on its stdin; its status, stdout and stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent.cli", "chat", *options, "--remote", url,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    stdout, stderr = await asyncio.wait_for(process.communicate("".join(f"{line}\n" for line in lines).encode()),
                                            CHAT_TIMEOUT_S)
    return process.returncode, stdout.decode(), stderr.decode()


async def answer(url: str, messages: list[dict[str, str]]) -> str:
    """The non-streamed greedy answer of the cluster to ``messages``."""
    status, body = await call("POST", url + "/v1/chat/completions", {
        "model": TINY, "messages": messages, "temperature": 0, "max_tokens": 4}, timeout_s=30)
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def test_chat_streams_answers_keeps_the_conversation_and_reports_errors(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2) as (orchestrator, others):
            greedy = ("--temperature", "0", "--max-tokens", "4")
            status, out, err = await run_chat(others[0].url, [FIRST, SECOND, "/exit", "never sent"], TINY, *greedy)
            assert status == 0, err
            first = await answer(orchestrator.url, [{"role": "user", "content": FIRST}])
            second = await answer(orchestrator.url, [{"role": "user", "content": FIRST},
                                                     {"role": "assistant", "content": first},
                                                     {"role": "user", "content": SECOND}])
            assert first and out == f"{first}\n{second}\n", (out, first, second)  # the second turn saw the first
            assert "> " not in out and "error" not in err

            # /reset: the second turn is asked alone, so it answers as a first turn would.
            status, out, err = await run_chat(orchestrator.url, [SECOND, FIRST, "/reset", FIRST], TINY, *greedy)
            lines = out.splitlines()
            assert status == 0 and len(lines) == 3 and lines[2] == first, (out, err)

            # A refused request is reported, and the conversation goes on to the end of input.
            status, out, err = await run_chat(orchestrator.url, ["w5", FIRST], "no-such-model", *greedy)
            assert status == 0 and err.count("error: ") == 2 and "no-such-model" in err, err
            assert out == ""

    asyncio.run(scenario())


def test_an_unreachable_agent_exits_1() -> None:
    async def scenario() -> None:
        url = f"http://127.0.0.1:{free_ports(1)[0]}"
        status, out, err = await run_chat(url, ["hello"])
        assert status == 1 and out == ""
        assert "cannot reach" in err and url in err, err

    asyncio.run(scenario())
