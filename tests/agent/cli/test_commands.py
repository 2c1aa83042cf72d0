"""`ncm join URL --config FILE` adds the peer to the configuration file through the one
config-file writer: the file keeps its private mode (it holds the cluster key), its header
and every other setting. Two in-process agents, the real `ncm` command."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from agent.local.compat import tomllib
from agent.local.config import CONFIG_FILE_HEADER, write_config_file
from tests.agent.agents import ADMIN, REPO
from tests.agent.inprocess import local_agents


def test_join_with_config_keeps_the_file_private_and_whole(tmp_path):
    config = tmp_path / "agent.toml"
    settings = {"cluster_name": "home", "cluster_key": "k" * 32, "port": 8080, "peers": ["http://192.168.1.9:8080"]}
    write_config_file(config, settings)
    assert oct(config.stat().st_mode & 0o777) == "0o600"

    async def scenario() -> subprocess.CompletedProcess:
        async with local_agents(tmp_path, 2) as agents:
            return await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "agent.cli", "join", agents[1].url, "--agent", agents[0].url,
                                 "--config", str(config), "--token", ADMIN["Authorization"].split()[1]],
                cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)

    result = asyncio.run(scenario())
    assert result.returncode == 0, result.stderr
    assert oct(config.stat().st_mode & 0o777) == "0o600"
    text = config.read_text()
    assert text.startswith(CONFIG_FILE_HEADER)
    written = tomllib.loads(text)
    joined = [peer for peer in written["peers"] if peer != "http://192.168.1.9:8080"]
    assert len(joined) == 1 and joined[0].startswith("http://127.0.0.1:")
    assert {k: v for k, v in written.items() if k != "peers"} == {k: v for k, v in settings.items() if k != "peers"}
