"""The setup file of an ncm appliance (``ncm-setup.txt`` on the boot partition): what it may say,
read and validated line by line, and what first boot makes of it (the merged ``agent.toml``,
the hostname). Pure: :mod:`agent.cli.firstboot` reads and writes the files."""

from __future__ import annotations

import dataclasses
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from agent.core.errors import InviteError, NcmError
from agent.core.invites import JOIN_PREFIX, JoinString
from agent.local import identity, settings
from agent.local.config import ConfigError, render_config_file

SETUP_FILE_NAME = "ncm-setup.txt"
MAX_SETUP_FILE_BYTES = 64 * 1024
SECRET_KEYS = frozenset({"cluster_key", "api_token"})
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")
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
    match = re.search(r"(^|\s)#", value)  # a value that is only a comment is empty
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
        if not MODEL_NAME.match(raw):
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
