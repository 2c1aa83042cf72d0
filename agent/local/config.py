"""Agent configuration: TOML file < NCM_* environment < command-line flags.

Everything is typed and validated at start; an error names the field and where it came from.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping

import tomli_w

from agent.core.errors import NcmError
from agent.core.presets import PLACEMENTS
from agent.core.threads import SPIN_CHOICES
from agent.core.wire import MAX_DRAFT_TOKENS
from agent.local import settings
from agent.local.compat import tomllib
from agent.local.files import write_atomic
from shards.graph.fragment import ACTIVATION_BITS, DEFAULT_ACTIVATION_BITS
from shards.store.model_store import ncm_home

INSTALLED_CONFIG_PATH = Path("/etc/ncm/agent.toml")
CLUSTER_KEY_FILE = "cluster-key"  # in state_dir: the key generated when none is configured
JOINED_FILE = "joined.toml"  # in state_dir: the cluster key, name and peers a join by invite brought (0600)
PENDING_JOIN_FILE = "pending-join"  # in state_dir: a join string from the setup file, until it is redeemed
ENV_PREFIX = "NCM_"


class ConfigError(NcmError, ValueError):
    """A configuration value is missing, unknown or of the wrong type."""


def _check(name: str, rule: Callable[[str], str], value: str) -> None:
    try:
        rule(value)
    except ValueError as error:
        raise ConfigError(f"{name}: {error}") from None


def default_state_dir() -> Path:
    """$NCM_HOME/agent, else $XDG_DATA_HOME/ncm/agent, else ~/.local/share/ncm/agent."""
    home = os.environ.get("NCM_HOME")
    if home:
        return Path(home) / "agent"
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "ncm" / "agent"


@dataclass(frozen=True)
class AgentConfig:
    """Validated configuration of one agent."""

    cluster_name: str = "home"
    cluster_key: str = ""
    host: str = "0.0.0.0"
    port: int = 8080
    peer_port: int = 0  # TLS port of the internal endpoints; 0: any free port (peers learn it)
    advertise_host: str = ""
    advertise_peer_port: int = 0  # the peer port peers should use (a forwarded one); 0: peer_port's
    peers: tuple[str, ...] = ()
    state_dir: Path = field(default_factory=default_state_dir)
    model: str = "smollm2-135m"
    orchestrator: bool = False
    api_token: str = ""
    api_keys: tuple[str, ...] = ()
    mdns: bool = True
    interfaces: tuple[str, ...] = ()
    npu_tops: float | None = None
    vram_gib: float | None = None
    ram_gib: float | None = None
    providers: tuple[str, ...] = ()
    threads: int = 0
    spin: str = "auto"  # compute threads spin between runs: auto (only when alone on the host), on, off
    activation_bits: int = DEFAULT_ACTIVATION_BITS  # int8 activations taken once (8, as llama.cpp) or twice (16)
    health_interval_s: float = 1.0
    failure_threshold: int = 3
    peer_timeout_s: float = 2.0
    discovery_grace_s: float = 2.0
    replicate_head_ratio: float = 0.25
    replica_count: int | None = None
    min_layers_per_node: int = 1
    max_context: int = 2048
    prefill_chunk: int = 256
    prefill_share: float = 2.0  # beside decoding streams a prompt is read in slices of about this many decode batches; 0 = whole
    fallback_model: str = "ncm-tiny"
    allow_fallback: bool = True
    session_idle_timeout_s: float = 300.0  # a stage frees a session unused this long (its request is gone)
    # per model (per whole copy): finished requests whose KV the stages keep for the next; 0 = off
    prompt_cache_entries: int = 2
    prompt_cache_idle_s: float = 1800.0  # a kept KV cache unused this long is freed
    draft_tokens: int = 8  # speculative decoding: most tokens drafted per step from the context itself; 0 = off
    fallback_copies: int = 0  # nodes asked to hold the fallback model whole; 0 = every node with room
    replan_min_interval_s: float = 10.0
    models_preset: Path | None = None
    models_max: int = 0
    models_memory_margin_mib: int = 256
    models_autoload: bool = True
    models_load_timeout_s: float = 600.0
    sleep_idle_s: float = 0.0
    max_requests_in_flight: int = 0  # per model, on the orchestrator; 0: as many as its KV memory holds, up to 8
    max_queued_requests: int = 32  # per model: more waiting requests get 429
    scrub_interval_s: float = 86400.0  # every stored file is hashed again this often; 0 = never
    scrub_rate_mib_s: float = 16.0  # at most this fast, on a thread of the lowest priority
    max_requests_in_flight_per_client: int = 0  # per model and client; 0: all slots but one
    max_queued_requests_per_client: int = 0  # per model and client; 0: half the queue
    default_max_tokens: int = 2048  # a request that names no max_tokens stops here; 0: at the end of the context
    default_placement: str = "auto"  # a model whose preset names no placement (design §11)
    # Settings given explicitly (file, environment or flags): they win over model presets.
    explicit: frozenset[str] = field(default=frozenset(), compare=False)

    def __post_init__(self) -> None:
        for name, rule in (("cluster_name", settings.cluster_name), ("cluster_key", settings.cluster_key)):
            if name == "cluster_name" or getattr(self, name):  # an empty key: one is generated at start
                _check(name, rule, getattr(self, name))
        if not all(0 <= p <= 65535 for p in (self.port, self.peer_port, self.advertise_peer_port)):
            raise ConfigError(f"port, peer_port and advertise_peer_port must be in 0-65535, got {self.port}, "
                              f"{self.peer_port} and {self.advertise_peer_port}")
        for peer in self.peers:
            _check("peers", settings.peer_url, peer)
        if not self.model:
            raise ConfigError("model must not be empty")
        if any(len(k) < 8 or len(k) > 256 or any(c.isspace() for c in k) for k in self.api_keys):
            raise ConfigError("api_keys must be 8-256 characters each, without spaces")
        for name in ("npu_tops", "vram_gib", "ram_gib"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ConfigError(f"{name} must be >= 0, got {value}")
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0 (0 = let the runtime choose), got {self.threads}")
        if self.spin not in SPIN_CHOICES:
            raise ConfigError(f"spin must be one of {', '.join(SPIN_CHOICES)}, got {self.spin!r}")
        for name in ("health_interval_s", "peer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.discovery_grace_s < 0:
            raise ConfigError(f"discovery_grace_s must be >= 0, got {self.discovery_grace_s}")
        if self.failure_threshold < 1:
            raise ConfigError(f"failure_threshold must be >= 1, got {self.failure_threshold}")
        if not 0.0 <= self.replicate_head_ratio <= 1.0:
            raise ConfigError(f"replicate_head_ratio must be in [0, 1], got {self.replicate_head_ratio}")
        if self.replica_count is not None and self.replica_count < 0:
            raise ConfigError(f"replica_count must be >= 0, got {self.replica_count}")
        if self.min_layers_per_node < 0:
            raise ConfigError(f"min_layers_per_node must be >= 0, got {self.min_layers_per_node}")
        if self.replan_min_interval_s < 0:
            raise ConfigError(f"replan_min_interval_s must be >= 0, got {self.replan_min_interval_s}")
        if not self.fallback_model:
            raise ConfigError("fallback_model must not be empty (set allow_fallback = false to disable it)")
        if not self.session_idle_timeout_s > 0:
            raise ConfigError(f"session_idle_timeout_s must be > 0, got {self.session_idle_timeout_s}")
        if self.prompt_cache_entries < 0 or not self.prompt_cache_idle_s > 0:
            raise ConfigError(f"prompt_cache_entries must be >= 0 (0 = off) and prompt_cache_idle_s > 0, got "
                              f"{self.prompt_cache_entries} and {self.prompt_cache_idle_s}")
        if self.fallback_copies < 0 or self.fallback_copies == 1:
            raise ConfigError(f"fallback_copies must be 0 (every node with room) or >= 2 (a single copy dies with "
                              f"its node), got {self.fallback_copies}")
        if self.models_max < 0 or self.models_memory_margin_mib < 0:
            raise ConfigError("models_max and models_memory_margin_mib must be >= 0 (models_max 0 = no limit)")
        if not self.models_load_timeout_s > 0 or self.sleep_idle_s < 0:
            raise ConfigError("models_load_timeout_s must be > 0 and sleep_idle_s >= 0 (0 = never sleep)")
        if self.scrub_interval_s < 0 or not self.scrub_rate_mib_s > 0:
            raise ConfigError("scrub_interval_s must be >= 0 (0 = never) and scrub_rate_mib_s > 0")
        if self.max_requests_in_flight_per_client < 0 or self.max_queued_requests_per_client < 0:
            raise ConfigError("max_requests_in_flight_per_client and max_queued_requests_per_client must be >= 0 "
                              "(0 = all slots but one, half the queue)")
        if self.default_max_tokens < 0:
            raise ConfigError(f"default_max_tokens must be >= 0 (0 = up to the end of the context), "
                              f"got {self.default_max_tokens}")
        if self.max_requests_in_flight < 0 or self.max_queued_requests < 0:
            raise ConfigError(f"max_requests_in_flight must be >= 0 (0 = from the KV memory) and max_queued_requests "
                              f">= 0 (0 = no queue), "
                              f"got {self.max_requests_in_flight} and {self.max_queued_requests}")
        if not 0 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ConfigError(f"draft_tokens must be 0 (off) to {MAX_DRAFT_TOKENS}, got {self.draft_tokens}")
        if self.activation_bits not in ACTIVATION_BITS:
            raise ConfigError(f"activation_bits must be {' or '.join(map(str, ACTIVATION_BITS))}, "
                              f"got {self.activation_bits}")
        if not 0 <= self.prefill_share <= 1000:
            raise ConfigError(f"prefill_share must be 0 (prompts read whole) to 1000, got {self.prefill_share}")
        if self.default_placement not in PLACEMENTS:
            raise ConfigError(f"default_placement must be one of {', '.join(PLACEMENTS)}, "
                              f"got {self.default_placement!r}")
        if self.max_context < 16 or self.prefill_chunk < 1 or self.prefill_chunk > self.max_context:
            raise ConfigError("max_context must be >= 16 and prefill_chunk in 1..max_context")

    @property
    def accepted_api_keys(self) -> tuple[str, ...]:
        """Keys that may call the inference API (none: it is open)."""
        return self.api_keys + ((self.api_token,) if self.api_token else ())

    @property
    def models_home(self) -> Path:
        """Where the model store lives ($NCM_HOME, else the user's data directory)."""
        return ncm_home()


_FIELD_TYPES: dict[str, str] = {
    "cluster_name": "str", "cluster_key": "str", "host": "str", "port": "int", "peer_port": "int",
    "advertise_host": "str", "advertise_peer_port": "int",
    "peers": "list", "state_dir": "path", "model": "str", "orchestrator": "bool", "api_token": "str",
    "api_keys": "list",
    "mdns": "bool", "interfaces": "list", "npu_tops": "float?", "vram_gib": "float?", "ram_gib": "float?", "providers": "list", "threads": "int", "spin": "str",
    "activation_bits": "int",
    "health_interval_s": "float", "failure_threshold": "int", "peer_timeout_s": "float",
    "discovery_grace_s": "float", "replicate_head_ratio": "float", "replica_count": "int?",
    "min_layers_per_node": "int", "max_context": "int", "prefill_chunk": "int", "prefill_share": "float",
    "fallback_model": "str", "allow_fallback": "bool", "fallback_copies": "int", "session_idle_timeout_s": "float", "replan_min_interval_s": "float",
    "prompt_cache_entries": "int", "prompt_cache_idle_s": "float", "draft_tokens": "int",
    "models_preset": "path?", "models_max": "int", "models_memory_margin_mib": "int", "models_autoload": "bool",
    "models_load_timeout_s": "float", "sleep_idle_s": "float",
    "max_requests_in_flight": "int", "max_queued_requests": "int", "max_requests_in_flight_per_client": "int",
    "max_queued_requests_per_client": "int", "scrub_interval_s": "float", "scrub_rate_mib_s": "float",
    "default_max_tokens": "int", "default_placement": "str",
}
assert set(_FIELD_TYPES) == {f.name for f in fields(AgentConfig)} - {"explicit"}


def _coerce(name: str, value: Any, source: str) -> Any:
    """Convert a TOML value, or an environment string, to the field's type."""
    kind = _FIELD_TYPES[name]
    from_text = isinstance(value, str) and source.startswith("environment")
    where = f"{name} (from {source})"
    if kind.endswith("?"):
        if value is None or (from_text and value.strip() == ""):
            return None
        kind = kind[:-1]
    try:
        if kind == "str":
            if not isinstance(value, str):
                raise TypeError
            return value
        if kind == "path":
            if not isinstance(value, (str, Path)) or not str(value):
                raise TypeError
            return Path(value).expanduser()
        if kind == "bool":
            if from_text:
                lowered = value.strip().lower()
                if lowered in ("1", "true", "yes", "on"):
                    return True
                if lowered in ("0", "false", "no", "off"):
                    return False
                raise TypeError
            if not isinstance(value, bool):
                raise TypeError
            return value
        if kind == "int":
            if from_text:
                return int(value.strip())
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError
            return value
        if kind == "float":
            if from_text:
                return float(value.strip())
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError
            return float(value)
        if kind == "list":
            if from_text:
                return tuple(item.strip() for item in value.split(",") if item.strip())
            if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
                raise TypeError
            return tuple(value)
    except (TypeError, ValueError):
        expected = {"str": "a string", "path": "a path", "bool": "true or false", "int": "an integer",
                    "float": "a number", "list": "a list of strings"}[kind]
        raise ConfigError(f"{where} must be {expected}, got {value!r}") from None
    raise AssertionError(kind)  # pragma: no cover


def _apply(values: dict[str, Any], updates: Mapping[str, Any], source: str) -> None:
    for name, value in updates.items():
        if name not in _FIELD_TYPES:
            raise ConfigError(f"unknown setting {name!r} (from {source}); known settings: {', '.join(sorted(_FIELD_TYPES))}")
        values[name] = _coerce(name, value, source)


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except OSError as error:
        raise ConfigError(f"cannot read config file {str(path)!r}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {error}") from None
    # Accept either flat keys or everything under an [agent] table.
    if set(data) == {"agent"} and isinstance(data["agent"], dict):
        data = data["agent"]
    return data


CONFIG_FILE_HEADER = (
    "# ncm agent configuration, written by ncm (`ncm firstboot`, `ncm join`, a join by invite).\n"
    "# Edit freely, then `systemctl restart ncm-agent`. Keep this file private: it holds the cluster key.\n"
)
# The first keys of a written file, in this order; the others follow sorted.
_FILE_KEY_ORDER = ("cluster_name", "cluster_key", "host", "port", "peers", "state_dir", "model", "orchestrator",
                   "api_token", "mdns", "interfaces", "npu_tops")


def render_config_file(values: Mapping[str, Any]) -> str:
    """The TOML text of a flat configuration file (strings, numbers, booleans, lists of them),
    under :data:`CONFIG_FILE_HEADER`; ConfigError for anything else."""
    order = [k for k in _FILE_KEY_ORDER if k in values] + sorted(k for k in values if k not in _FILE_KEY_ORDER)
    for key in order:
        value = values[key]
        items = value if isinstance(value, (list, tuple)) else [value]
        if not all(isinstance(item, (str, int, float, bool)) for item in items):
            raise ConfigError(f"cannot write config key {key!r}: only flat strings, numbers, booleans and lists")
    return CONFIG_FILE_HEADER + tomli_w.dumps({key: values[key] for key in order})


def write_config_file(path: Path, values: Mapping[str, Any], *, mode: int | None = None,
                      group: str | None = None) -> None:
    """The one writer of configuration files (``agent.toml``, ``joined.toml``): whole, atomic,
    with ``mode`` (default: the mode of the file it replaces, else 0600, since these files
    hold the cluster key) and ``group`` (see :func:`~agent.local.files.write_atomic`)."""
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o777
        except FileNotFoundError:
            mode = 0o600
    write_atomic(path, render_config_file(values), mode=mode, group=group)


def environment_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """NCM_<FIELD> variables that name a setting (NCM_HOME and others are left alone)."""
    return {
        key[len(ENV_PREFIX):].lower(): value
        for key, value in environ.items()
        if key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX):].lower() in _FIELD_TYPES
    }


def load_config(
    path: Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> AgentConfig:
    """Build the configuration: ``path`` (or /etc/ncm/agent.toml when it exists), then what a
    join by invite left in ``state_dir/joined.toml``, then the environment, then
    ``overrides`` (command-line flags; None values are ignored)."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    if path is None and INSTALLED_CONFIG_PATH.exists():
        path = INSTALLED_CONFIG_PATH
    if path is not None:
        _apply(values, read_config_file(path), f"config file {path}")
    environment = environment_settings(environ)
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}
    _apply(values, environment, "environment NCM_*")
    _apply(values, flags, "command line")
    explicit = frozenset(values)
    joined = Path(values.get("state_dir") or default_state_dir()) / JOINED_FILE
    if joined.exists():  # what a join by invite brought: above the file, below environment and flags
        _apply(values, {k: v for k, v in read_config_file(joined).items() if k not in environment and k not in flags},
               f"{joined}")
    try:
        return AgentConfig(**values, explicit=explicit)
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:  # pragma: no cover - guarded by _coerce
        raise ConfigError(str(error)) from None
