"""First-boot provisioning of an ncm appliance (``ncm firstboot``).

A person configures a card from any computer before its first boot by editing
``ncm-setup.txt`` on the boot partition (FAT, readable everywhere). On first boot
``ncm-firstboot.service`` runs ``ncm firstboot``, which:

1. reads and validates that file (every problem is reported with its line number, and
   nothing is written when the file is wrong; the error is also left next to the file
   as ``ncm-setup-error.txt`` so that it can be read from the same computer),
2. merges its settings into ``/etc/ncm/agent.toml`` (keys of the agent contract; other
   keys already there are kept), generating a cluster key when none was given,
3. sets the hostname to ``ncm-<short id>`` (or the ``hostname`` the file asks for),
4. writes the node id (``<state_dir>/node-id``, 32 lowercase hex chars) last: its presence
   marks provisioning as done, so a failed run is retried on the next boot,
5. records a model to pull once the network is up (``pull = yes``), done by
   ``ncm-pull.service`` through ``ncm firstboot --pull-pending``.

Running it again is harmless: the node id is kept, and the same file gives the same
config. Secrets (cluster key, API token) are never logged.

Reading and validating the file is :mod:`agent.cli.setup_file` (pure); this module does the
file I/O and the command.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import socket
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from agent.cli.setup_file import (
    MAX_SETUP_FILE_BYTES,
    MODEL_NAME,
    SETUP_FILE_NAME,
    BootSetup,
    FirstbootError,
    SetupFileError,
    default_hostname,
    hosts_with_hostname,
    merge_config,
    parse_setup_text,
    render_config,
    validate_node_id,
)
from agent.local import identity
from agent.local.compat import tomllib
from agent.local.config import PENDING_JOIN_FILE
from agent.local.files import write_atomic
from shards.cli import commands as shards_cli

log = logging.getLogger(__name__)

ERROR_FILE_NAME = "ncm-setup-error.txt"
DEFAULT_BOOT_DIRS = (Path("/boot/efi"), Path("/boot/firmware"), Path("/boot"))
DEFAULT_CONFIG_PATH = Path("/etc/ncm/agent.toml")
DEFAULT_STATE_DIR = Path("/var/lib/ncm")
PULL_REQUEST_FILE = "pull-model"
SERVICE_GROUP = "ncm"


@dataclasses.dataclass(frozen=True)
class FirstbootResult:
    node_id: str
    hostname: str | None
    config_path: Path
    boot_file: Path | None
    generated_cluster_key: bool
    created_node_id: bool
    pull_model: str | None


def find_boot_file(candidates: Iterable[Path]) -> Path | None:
    """The first existing setup file among ``candidates`` (files or boot directories)."""
    for candidate in candidates:
        path = candidate / SETUP_FILE_NAME if candidate.is_dir() else candidate
        if path.is_file():
            return path
    return None


# --------------------------------------------------------------------------------- file I/O


def read_setup_file(path: Path) -> BootSetup:
    try:
        size = path.stat().st_size
        if size > MAX_SETUP_FILE_BYTES:
            raise SetupFileError(f"{path.name} is larger than {MAX_SETUP_FILE_BYTES // 1024} KiB")
        raw = path.read_bytes()
    except OSError as error:
        raise FirstbootError(f"cannot read {path}: {error.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    return parse_setup_text(text, source=path.name)


def _read_existing_config(path: Path) -> dict[str, object]:
    if not path.exists():
        return {}
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as error:
        raise FirstbootError(f"{path} is not valid TOML ({error}); fix or remove it, then run ncm firstboot again") from None
    except OSError as error:
        raise FirstbootError(f"cannot read {path}: {error.strerror}") from None


def _report_error_on_boot_partition(boot_file: Path, message: str) -> None:
    try:
        (boot_file.parent / ERROR_FILE_NAME).write_text(
            "ncm could not apply ncm-setup.txt on first boot:\r\n\r\n"
            f"{message}\r\n\r\nFix the file and start the device again.\r\n",
            encoding="utf-8",
        )
    except OSError as error:
        log.warning("cannot write %s next to %s: %s", ERROR_FILE_NAME, boot_file, error.strerror)


def _clear_error_on_boot_partition(boot_file: Path) -> None:
    try:
        (boot_file.parent / ERROR_FILE_NAME).unlink(missing_ok=True)
    except OSError:
        pass


def _apply_hostname(hostname: str, etc_dir: Path, *, live: bool) -> None:
    write_atomic(etc_dir / "hostname", hostname + "\n", mode=0o644)
    hosts = etc_dir / "hosts"
    current = hosts.read_text(encoding="utf-8") if hosts.exists() else "127.0.0.1\tlocalhost\n"
    write_atomic(hosts, hosts_with_hostname(current, hostname), mode=0o644)
    if live:
        try:
            socket.sethostname(hostname)
        except OSError as error:
            log.warning("cannot set the running hostname to %s: %s (it applies from the next boot)", hostname, error.strerror)


def run_firstboot(
    boot_file: Path | None,
    config_path: Path,
    state_dir: Path,
    *,
    set_hostname: bool,
    etc_dir: Path = Path("/etc"),
    group: str | None = SERVICE_GROUP,
) -> FirstbootResult:
    """Provision this node (see the module docstring). Idempotent.

    ``boot_file`` is the setup file (``None``: no file, defaults only). ``etc_dir`` is
    where ``hostname`` and ``hosts`` live; the running hostname is only changed when it
    is the real ``/etc``.
    """
    try:
        setup = read_setup_file(boot_file) if boot_file is not None else BootSetup()
        existing = _read_existing_config(config_path)
        config, generated = merge_config(existing, setup, state_dir=state_dir)
        text = render_config(config)
    except FirstbootError as error:
        if boot_file is not None:
            _report_error_on_boot_partition(boot_file, str(error))
        raise
    if boot_file is not None:
        _clear_error_on_boot_partition(boot_file)

    node_id_path = state_dir / identity.NODE_ID_FILE
    node_id: str | None = None
    if node_id_path.exists():
        node_id = validate_node_id(node_id_path.read_text(encoding="utf-8"))
    created = node_id is None
    if node_id is None:
        node_id = identity.new_node_id()

    write_atomic(config_path, text, mode=0o640, group=group)
    log.info("wrote %s (cluster %s, %d static peer(s)%s)", config_path, config["cluster_name"],
             len(config.get("peers", []) or []), ", generated a new cluster key" if generated else "")

    hostname = None
    if set_hostname:
        hostname = setup.hostname or default_hostname(node_id)
        _apply_hostname(hostname, etc_dir, live=etc_dir.resolve() == Path("/etc"))
        log.info("hostname is %s", hostname)

    pull_model = setup.model if setup.pull else None
    state_dir.mkdir(parents=True, exist_ok=True)
    if pull_model:
        write_atomic(state_dir / PULL_REQUEST_FILE, pull_model + "\n", mode=0o644)
        log.info("model %s will be pulled once the network is up", pull_model)

    if setup.invite:  # the agent redeems it once the member it names answers
        write_atomic(state_dir / PENDING_JOIN_FILE, setup.invite + "\n", mode=0o640, group=group)
        log.info("the agent will join the cluster of the join string once its member answers")

    if created:
        # Written last: its presence tells ncm-firstboot.service that provisioning is done.
        write_atomic(node_id_path, node_id + "\n", mode=0o644)
        log.info("created node id %s", node_id)
    else:
        log.info("kept node id %s", node_id)
    return FirstbootResult(
        node_id=node_id,
        hostname=hostname,
        config_path=config_path,
        boot_file=boot_file,
        generated_cluster_key=generated,
        created_node_id=created,
        pull_model=pull_model,
    )


def pull_pending(state_dir: Path, pull: Callable[[str], int] | None = None) -> int:
    """Pull the model that first boot asked for; the request is dropped once it succeeds."""
    request = state_dir / PULL_REQUEST_FILE
    if not request.exists():
        log.info("no model pull pending")
        return 0
    model = request.read_text(encoding="utf-8").strip()
    if not MODEL_NAME.match(model):
        raise FirstbootError(f"{request} does not name a model")
    if pull is None:
        def pull(name: str) -> int:
            return shards_cli.main(["pull", name])

    log.info("pulling model %s", model)
    code = pull(model)
    if code == 0:
        request.unlink(missing_ok=True)
    return code



# ---------------------------------------------------------------------------------- command


def _command(args: argparse.Namespace) -> int:
    state_dir = Path(args.state_dir)
    if args.pull_pending:
        return pull_pending(state_dir)
    if args.no_boot_file:
        boot_file = None
    elif args.boot_file:
        boot_file = Path(args.boot_file)
        if not boot_file.is_file():
            raise FirstbootError(f"{boot_file} does not exist")
    else:
        dirs: Sequence[Path] = [Path(d) for d in args.boot_dir] or list(DEFAULT_BOOT_DIRS)
        boot_file = find_boot_file(dirs)
        if boot_file is None:
            log.info("no %s found in %s; using defaults", SETUP_FILE_NAME, ", ".join(map(str, dirs)))
    result = run_firstboot(boot_file, Path(args.config), state_dir, set_hostname=not args.no_hostname)
    log.info("node %s provisioned%s", result.node_id, f" from {result.boot_file}" if result.boot_file else "")
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add ``ncm firstboot`` to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "firstboot",
        help="provision this device from ncm-setup.txt (run once by ncm-firstboot.service)",
        description="Create the node id, write the agent config from the boot partition's "
        f"{SETUP_FILE_NAME}, and set the hostname. Safe to run again.",
    )
    parser.add_argument("--boot-file", help=f"the setup file (default: {SETUP_FILE_NAME} in the first boot directory that has one)")
    parser.add_argument("--boot-dir", action="append", default=[], metavar="DIR",
                        help="a directory to look for the setup file in (repeatable; default: "
                        + ", ".join(map(str, DEFAULT_BOOT_DIRS)) + ")")
    parser.add_argument("--no-boot-file", action="store_true", help="ignore any setup file: defaults only")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG_PATH), help="agent config to write (default: %(default)s)")
    parser.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR), help="state directory holding node-id (default: %(default)s)")
    parser.add_argument("--no-hostname", action="store_true", help="do not change the hostname")
    parser.add_argument("--pull-pending", action="store_true", help="pull the model first boot asked for, then stop")
    parser.set_defaults(func=_command)
    return parser
