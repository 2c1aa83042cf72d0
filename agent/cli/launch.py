"""The ``ncm`` command's entry point: it starts the command again in the process environment
the runtime runs best in (:mod:`agent.local.runtime_env`), then runs it."""

from __future__ import annotations

import os
import sys

from agent.local.runtime_env import read_thp_mode, runtime_env


def main() -> int:
    env = runtime_env(os.environ, read_thp_mode())
    if env.get("GLIBC_TUNABLES") != os.environ.get("GLIBC_TUNABLES"):
        script = sys.argv[0]
        argv = [script, *sys.argv[1:]] if os.path.isfile(script) else ["-m", "agent.cli", *sys.argv[1:]]
        try:
            os.execve(sys.executable, [sys.executable, *argv], env)
        except OSError:
            pass  # run as it is: slower, not wrong
    os.environ["OPENBLAS_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"]  # numpy is not imported yet
    from agent.cli.main import main as cli_main

    return cli_main()
