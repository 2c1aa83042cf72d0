"""agent.cli.main: the ``ncm`` parser (every command; the model-store commands without the
agent's modules), and how a run ends — help and exit 2 without a command, one line on stderr and
exit 2 for an ncm or model-store error, 130 for Ctrl-C."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agent import __version__
from agent.cli.main import EXIT_USAGE, STORE_COMMANDS, build_parser, main
from agent.core.auth import admin_token

REPO = Path(__file__).resolve().parents[3]
TIMEOUT_S = 60.0
AGENT_COMMANDS = {"serve", "join", "invite", "remove", "admin-token", "status", "chat", "demo", "plan", "firstboot"}


def commands_of(parser) -> set[str]:
    return set(parser._subparsers._group_actions[0].choices)


def python(code: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs)


def test_version_is_printed_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["--version"])
    assert caught.value.code == 0
    assert capsys.readouterr().out == f"ncm {__version__}\n"


@pytest.mark.parametrize("argv", [[], ["-v"], ["--verbose"]])
def test_without_a_command_the_help_goes_to_stderr_and_the_exit_is_2(argv: list[str],
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == EXIT_USAGE == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("usage: ncm ") and "Run language models across the devices you have at home." in err
    assert all(command in err for command in AGENT_COMMANDS | STORE_COMMANDS)


def test_an_unknown_command_is_a_usage_error_listing_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["pul", "smollm2-135m"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "argument COMMAND: invalid choice: 'pul'" in err and "'pull'" in err and "'serve'" in err


def test_the_full_parser_has_every_command_and_a_store_command_only_the_model_commands() -> None:
    assert commands_of(build_parser()) == AGENT_COMMANDS | STORE_COMMANDS | {"models"}
    assert commands_of(build_parser("serve")) == AGENT_COMMANDS | STORE_COMMANDS | {"models"}
    for command in STORE_COMMANDS:
        assert commands_of(build_parser(command)) == STORE_COMMANDS | {"models"}
    args = build_parser("generate").parse_args(["generate", "smollm2-135m", "hello", "--max-tokens", "5",
                                                "--stop", "\n"])
    assert (args.command, args.model, args.prompt, args.max_tokens, args.stop) == (
        "generate", "smollm2-135m", "hello", 5, ["\n"])
    # `ncm models` is the full parser's: it also lists the models of a running cluster.
    assert build_parser("models").parse_args(["models", "--remote", "http://h:1"]).remote == "http://h:1"


def test_a_store_command_is_parsed_without_importing_the_agent() -> None:
    result = python(
        "import json, sys\n"
        "from agent.cli.main import build_parser\n"
        "agent = lambda: sorted(m for m in sys.modules if m.startswith(('agent.cli.', 'agent.local', 'agent.node')))\n"
        "build_parser('generate').parse_args(['generate', 'm', 'p'])\n"
        "store = agent()\n"
        "build_parser('status')\n"
        "print(json.dumps([store, agent()]))\n")
    assert result.returncode == 0, result.stderr
    store, full = json.loads(result.stdout)
    assert store == ["agent.cli.main"]
    assert {"agent.cli.commands", "agent.cli.firstboot", "agent.local.config"} <= set(full)


def test_verbose_logs_debug_messages() -> None:
    result = python("import logging\nfrom agent.cli.main import main\n"
                    "levels = []\n"
                    "for argv in ([], ['-v']):\n"
                    "    logging.root.handlers.clear()  # as in a process of its own\n"
                    "    main(argv)\n"
                    "    levels.append(logging.getLogger().level)\n"
                    "print(levels)\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [str([logging.INFO, logging.DEBUG])]


@pytest.mark.parametrize(("argv", "message"), [
    (["admin-token", "--config", "{tmp}/broken.toml"],
     "ncm admin-token: error: cannot read this device's cluster key: "
     "config file '{tmp}/broken.toml' is not valid TOML"),
    (["join", "ftp://nas.local"], "ncm join: error: 'ftp://nas.local' is not an http(s):// URL"),
    (["generate", "no-such-model", "hello", "--home", "{tmp}/home"],  # a ShardsError
     "ncm generate: error: model 'no-such-model' is not in the store (known models: none)"),
])
def test_an_error_of_a_command_is_one_line_on_stderr_and_exit_2(tmp_path: Path, argv: list[str], message: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "broken.toml").write_text("cluster_key = [unclosed\n")
    assert main([arg.format(tmp=tmp_path) for arg in argv]) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith(message.format(tmp=tmp_path))


def test_a_command_that_succeeds_returns_0_and_prints_its_answer(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(f'cluster_key = "test-cluster-key-0123456789"\nstate_dir = "{tmp_path / "state"}"\n')
    assert main(["admin-token", "--config", str(config)]) == 0
    assert capsys.readouterr().out == admin_token(b"test-cluster-key-0123456789") + "\n"


def test_ctrl_c_while_a_command_waits_exits_130_without_a_traceback() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(TIMEOUT_S)
        command = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "status", "--remote", f"http://127.0.0.1:{silent.getsockname()[1]}"],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        try:
            connection, _ = silent.accept()  # the command is waiting for the agent's answer
            with connection:
                command.send_signal(signal.SIGINT)
                out, err = command.communicate(timeout=TIMEOUT_S)
        finally:
            if command.poll() is None:
                command.kill()
                command.communicate(timeout=TIMEOUT_S)
    assert command.returncode == 130, err
    assert out == "" and "Traceback" not in err


def test_the_global_verbose_flag_holds_for_every_command() -> None:
    assert build_parser("generate").parse_args(["-v", "generate", "m", "p"]).verbose is True
