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

The parsing helpers are pure; :func:`run_firstboot` does the file I/O.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import secrets
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from agent.core.errors import InviteError, NcmError
from agent.core.invites import JOIN_PREFIX, JoinString
from agent.local import identity, settings
from agent.local.compat import tomllib
from agent.local.config import PENDING_JOIN_FILE, ConfigError, render_config_file
from agent.local.files import write_atomic
from shards.cli import commands as shards_cli

log = logging.getLogger(__name__)

SETUP_FILE_NAME = "ncm-setup.txt"
ERROR_FILE_NAME = "ncm-setup-error.txt"
DEFAULT_BOOT_DIRS = (Path("/boot/efi"), Path("/boot/firmware"), Path("/boot"))
DEFAULT_CONFIG_PATH = Path("/etc/ncm/agent.toml")
DEFAULT_STATE_DIR = Path("/var/lib/ncm")
PULL_REQUEST_FILE = "pull-model"
SERVICE_GROUP = "ncm"
MAX_SETUP_FILE_BYTES = 64 * 1024
SECRET_KEYS = frozenset({"cluster_key", "api_token"})

_MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")
_HOSTNAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_INTERFACE_RE = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")
_TRUE = {"1", "yes", "true", "on"}
_FALSE = {"0", "no", "false", "off"}


class FirstbootError(NcmError):
    """The boot-partition setup file or the provisioning of this node failed."""


class SetupFileError(FirstbootError, ValueError):
    """``ncm-setup.txt`` is malformed: the message names the line and the key."""


@dataclasses.dataclass(frozen=True)
class BootSetup:
    """What a person asked for in ``ncm-setup.txt``. ``None`` means "not given"."""

    cluster_name: str | None = None
    cluster_key: str | None = dataclasses.field(default=None, repr=False)
    peers: tuple[str, ...] = ()
    model: str | None = None
    pull: bool = False
    hostname: str | None = None
    api_token: str | None = dataclasses.field(default=None, repr=False)
    invite: str | None = dataclasses.field(default=None, repr=False)  # a join string from `ncm invite`
    orchestrator: bool | None = None
    port: int | None = None
    mdns: bool | None = None
    interfaces: tuple[str, ...] | None = None
    npu_tops: float | None = None


@dataclasses.dataclass(frozen=True)
class FirstbootResult:
    node_id: str
    hostname: str | None
    config_path: Path
    boot_file: Path | None
    generated_cluster_key: bool
    created_node_id: bool
    pull_model: str | None


# ---------------------------------------------------------------------------- pure helpers


def _strip_comment(value: str) -> str:
    """Drop a trailing ``# comment`` (a ``#`` after whitespace); quotes protect it."""
    value = value.strip()
    if value[:1] in ("'", '"'):
        quote = value[0]
        end = value.find(quote, 1)
        if end == -1:
            raise ValueError("unterminated quote")
        rest = value[end + 1 :].strip()
        if rest and not rest.startswith("#"):
            raise ValueError("text after the closing quote")
        return value[1:end]
    match = re.search(r"\s#", value)
    if match:
        value = value[: match.start()]
    return value.strip()


def _parse_bool(value: str) -> bool:
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError("expected yes or no")


def parse_join_string(join: str) -> tuple[str, str, str | None]:
    """``http://host:port[/?cluster=NAME]#KEY`` → ``(peer_url, cluster_key, cluster_name)``.

    The fragment (after ``#``) is the cluster key; an optional ``cluster=`` query names
    the cluster. The key is never part of an error message.
    """
    text = join.strip()
    if "#" not in text:
        raise ValueError("a join string is URL#clusterkey (the cluster key after '#' is missing)")
    base, key = text.split("#", 1)
    parts = urlsplit(base)
    cluster_name = None
    if parts.query:
        for item in parts.query.split("&"):
            name, _, value = item.partition("=")
            if name == "cluster" and value:
                cluster_name = settings.cluster_name(value)
            else:
                raise ValueError(f"unknown join-string parameter {name!r} (only cluster=NAME)")
    url = settings.peer_url(parts._replace(query="", fragment="").geturl())
    return url, settings.cluster_key(key.strip()), cluster_name


def validate_hostname(name: str) -> str:
    lowered = name.strip().lower()
    if not _HOSTNAME_RE.match(lowered):
        raise ValueError("a hostname is 1-63 letters, digits or '-', not starting or ending with '-'")
    return lowered


def _split_list(value: str) -> list[str]:
    return [item for item in re.split(r"[,\s]+", value) if item]


def _setup_value(key: str, raw: str) -> object:
    """Validate one ``key = value`` of the setup file; returns the typed value."""
    if key in ("cluster_name",):
        return settings.cluster_name(raw)
    if key == "cluster_key":
        return settings.cluster_key(raw.strip())
    if key == "api_token":
        if not raw or any(ch.isspace() for ch in raw) or len(raw) > 256:
            raise ValueError("the API token must be 1-256 characters without spaces")
        return raw
    if key == "peers":
        return tuple(settings.peer_url(item) for item in _split_list(raw))
    if key == "join":
        if raw.strip().startswith(JOIN_PREFIX):  # an invite from `ncm invite`: redeemed by the agent
            try:
                return JoinString.decode(raw)
            except InviteError as error:
                raise ValueError(str(error)) from None
        return parse_join_string(raw)
    if key == "model":
        if not _MODEL_RE.match(raw):
            raise ValueError("a model name is letters, digits and . _ : / @ + -")
        return raw
    if key in ("pull", "orchestrator", "mdns"):
        return _parse_bool(raw)
    if key == "hostname":
        return validate_hostname(raw)
    if key == "port":
        if not raw.isdigit() or not 1 <= int(raw) <= 65535:
            raise ValueError("the port is a number from 1 to 65535")
        return int(raw)
    if key == "interfaces":
        names = _split_list(raw)
        for name in names:
            if not _INTERFACE_RE.match(name):
                raise ValueError(f"bad interface name {name!r}")
        return tuple(names)
    if key == "npu_tops":
        try:
            tops = float(raw)
        except ValueError:
            raise ValueError("npu_tops is a number") from None
        if not 0 <= tops <= 10_000:
            raise ValueError("npu_tops must be between 0 and 10000")
        return tops
    raise KeyError(key)


SETUP_KEYS = (
    "cluster_name",
    "cluster_key",
    "join",
    "peers",
    "model",
    "pull",
    "hostname",
    "api_token",
    "orchestrator",
    "port",
    "mdns",
    "interfaces",
    "npu_tops",
)


def parse_setup_text(text: str, *, source: str = SETUP_FILE_NAME) -> BootSetup:
    """Parse ``ncm-setup.txt`` (``key = value`` lines, ``#`` comments, any line ending).

    Raises :class:`SetupFileError` naming the line and key; secret values never appear
    in the message.
    """
    if text.startswith("\ufeff"):
        text = text[1:]
    values: dict[str, object] = {}
    peers: list[str] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", ";")):
            continue
        if "=" not in stripped:
            raise SetupFileError(f"{source} line {number}: expected 'key = value'")
        key, _, raw = stripped.partition("=")
        key = key.strip().lower().replace("-", "_")
        if key == "peer":
            key = "peers"
        if key not in SETUP_KEYS:
            known = ", ".join(SETUP_KEYS)
            raise SetupFileError(f"{source} line {number}: unknown setting {key!r} (known: {known})")
        if key in seen and key != "peers":
            raise SetupFileError(f"{source} line {number}: {key} is already set on line {seen[key]}")
        seen[key] = number
        try:
            value = _setup_value(key, _strip_comment(raw))
        except ValueError as error:
            raise SetupFileError(f"{source} line {number}: {key}: {error}") from None
        if key == "peers":
            peers.extend(value)  # type: ignore[arg-type]
        else:
            values[key] = value
    join = values.pop("join", None)
    if isinstance(join, JoinString):
        values["invite"] = join.encode()
    elif join is not None:
        url, key, name = join  # type: ignore[misc]
        if "cluster_key" in values and values["cluster_key"] != key:
            raise SetupFileError(f"{source}: join and cluster_key give two different cluster keys")
        if name and "cluster_name" in values and values["cluster_name"] != name:
            raise SetupFileError(f"{source}: join and cluster_name give two different cluster names")
        values["cluster_key"] = key
        if name:
            values.setdefault("cluster_name", name)
        peers.insert(0, url)
    if values.get("pull") and "model" not in values:
        raise SetupFileError(f"{source}: pull = yes needs a model = NAME to pull")
    unique_peers = tuple(dict.fromkeys(peers))
    return BootSetup(peers=unique_peers, **values)  # type: ignore[arg-type]


def short_id(node_id: str) -> str:
    return node_id[:6]


def default_hostname(node_id: str) -> str:
    return f"ncm-{short_id(node_id)}"


def validate_node_id(text: str) -> str:
    try:
        return identity.node_id(text)
    except ValueError as error:
        raise FirstbootError(str(error)) from None


def merge_config(existing: Mapping[str, object], setup: BootSetup, *, state_dir: Path) -> tuple[dict[str, object], bool]:
    """The new ``agent.toml`` content and whether a cluster key had to be generated.

    Settings from the setup file win over the existing file; keys the setup file does
    not mention are kept. Static peers are added to the ones already configured.
    """
    config: dict[str, object] = dict(existing)
    for field in ("cluster_name", "cluster_key", "model", "api_token", "orchestrator", "port", "mdns", "npu_tops"):
        value = getattr(setup, field)
        if value is not None:
            config[field] = value
    if setup.interfaces is not None:
        config["interfaces"] = list(setup.interfaces)
    if setup.peers:
        old = config.get("peers", [])
        old_list = [str(item) for item in old] if isinstance(old, list) else []
        config["peers"] = list(dict.fromkeys([*old_list, *setup.peers]))
    config.setdefault("cluster_name", "home")
    config.setdefault("state_dir", str(state_dir))
    generated = False
    if not config.get("cluster_key"):
        config["cluster_key"] = secrets.token_hex(16)
        generated = True
    return config, generated


def render_config(config: Mapping[str, object]) -> str:
    """Flat TOML for ``agent.toml`` (pure; keys in a stable order)."""
    try:
        return render_config_file(config)
    except ConfigError as error:
        raise FirstbootError(str(error)) from None


def hosts_with_hostname(hosts_text: str, hostname: str) -> str:
    """``/etc/hosts`` with its ``127.0.1.1`` line naming ``hostname`` (pure)."""
    lines = hosts_text.splitlines()
    entry = f"127.0.1.1\t{hostname}"
    for index, line in enumerate(lines):
        if line.split()[:1] == ["127.0.1.1"]:
            lines[index] = entry
            break
    else:
        insert_at = next((i + 1 for i, line in enumerate(lines) if line.split()[:1] == ["127.0.0.1"]), 0)
        lines.insert(insert_at, entry)
    return "\n".join(lines) + "\n"


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
    if not _MODEL_RE.match(model):
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
