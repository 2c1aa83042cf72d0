"""The `ncm` command line."""

from __future__ import annotations

import argparse
import logging
import sys

from agent import __version__
from agent.core.errors import NcmError
from shards.cli import commands as shards_cli
from shards.errors import ShardsError

EXIT_USAGE = 2
# Commands that run on this machine's model store alone: their parser is built without
# importing the agent's service (a quarter of a second before `ncm generate`'s first token).
STORE_COMMANDS = frozenset({"pull", "import", "generate"})


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``ncm`` parser; for one of :data:`STORE_COMMANDS` it may hold the model commands only."""
    parser = argparse.ArgumentParser(prog="ncm", description="Run language models across the devices you have at home.")
    parser.add_argument("--version", action="version", version=f"ncm {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    if command in STORE_COMMANDS:
        shards_cli.register(subparsers)
        return parser
    from agent.cli import commands, demo, firstboot, plan_command, status_map

    commands.add_parsers(subparsers)
    demo.add_parser(subparsers)
    shards_cli.register(subparsers)
    status_map.extend_models_parser(subparsers.choices["models"])
    plan_command.add_parser(subparsers)
    firstboot.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(next((a for a in argv if not a.startswith("-")), None))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except (NcmError, ShardsError) as error:
        print(f"ncm {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
