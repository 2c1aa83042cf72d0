"""Model presets: the models the registry serves and the settings of each.

Pure: parses the `.ini` presets file from a string and layers settings, lowest to highest:
model defaults (max_context capped to the stored context_length) < ``[*]`` < the model's
section < the agent's explicit configuration. A section only overrides the keys it writes.
Every section must name weights some store holds: its own name (it patches a stored model)
or ``model = <stored model>`` (a new name); a section that names none is refused.
"""

from __future__ import annotations

import configparser
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any

from agent.core.errors import PresetError

GLOBAL_SECTION = "*"
WEIGHT_FORMATS = ("f32", "f16", "q4", "mixed")  # shards.store.manifest's (the core imports no shards)
# The seed's layer split; a whole copy on every node; whole copies where they fit, else the split (design §11)
PLACEMENTS = ("split", "replicas", "auto")
MIN_CONTEXT = 16
SOURCES = ("store", "preset")

SETTING_KEYS: Mapping[str, str] = MappingProxyType({
    "context": "max_context",
    "prefill-chunk": "prefill_chunk",
    "head-ratio": "replicate_head_ratio",
    "replicas": "replica_count",
    "load-on-startup": "load_on_startup",
    "stop-timeout": "stop_timeout_s",
    "sleep-idle-seconds": "sleep_idle_s",
    "weights": "weights",
    "model-draft": "draft_model",
    "placement": "placement",
})
MODEL_KEYS = ("model", "aliases")  # per-model only, never in [*]
MODEL_ONLY_SETTINGS = ("draft_model",)  # settings a model's section may hold, never [*]

_MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_INT_RE = re.compile(r"^[+-]?[0-9]+$")
_BOOLS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
_NO_OVERRIDES: Mapping[str, Any] = MappingProxyType({})


def valid_model_name(name: object) -> bool:
    """Whether ``name`` may name a model or an alias."""
    return isinstance(name, str) and bool(_MODEL_NAME_RE.match(name)) and ".." not in name


# --- one value check per field: returns the normalised value or raises ValueError("expected ...")


def _int(value: Any, low: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(what)
    return value


def _float(value: Any, ok: Callable[[float], bool], what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ValueError(what)
    return float(value)


def _replicas(value: Any) -> int | None:
    return None if value is None else _int(value, 0, "an integer >= 0 or 'auto'")


def _bool(value: Any) -> bool:
    if value is True or value is False:
        return value
    raise ValueError("true/false, yes/no, on/off or 1/0")


def _draft_model(value: Any) -> str | None:
    if value is not None and not valid_model_name(value):
        raise ValueError("a stored model's name")
    return value


def _placement(value: Any) -> str:
    if value not in PLACEMENTS:
        raise ValueError(f"one of {', '.join(PLACEMENTS)}")
    return value


def _weights(value: Any) -> str | None:
    if value is not None and value not in WEIGHT_FORMATS:
        raise ValueError(f"one of {', '.join(WEIGHT_FORMATS)} or 'auto'")
    return value


_CHECKS: Mapping[str, Callable[[Any], Any]] = MappingProxyType({
    "max_context": lambda v: _int(v, MIN_CONTEXT, f"an integer >= {MIN_CONTEXT}"),
    "prefill_chunk": lambda v: _int(v, 1, "an integer >= 1 (and <= max_context)"),
    "replicate_head_ratio": lambda v: _float(v, lambda x: 0.0 <= x <= 1.0, "a number between 0 and 1"),
    "replica_count": _replicas,
    "load_on_startup": _bool,
    "stop_timeout_s": lambda v: _float(v, lambda x: x > 0.0, "a number of seconds > 0"),
    "sleep_idle_s": lambda v: _float(v, lambda x: x >= 0.0, "a number of seconds >= 0 (0 = never)"),
    "weights": _weights,
    "draft_model": _draft_model,
    "placement": _placement,
})


def _check_field(field: str, value: Any) -> Any:
    try:
        return _CHECKS[field](value)
    except ValueError as error:
        raise PresetError(f"{field} must be {error}, got {value!r}") from None


@dataclass(frozen=True)
class ModelSettings:
    max_context: int = 2048
    prefill_chunk: int = 256
    replicate_head_ratio: float = 0.25
    replica_count: int | None = None
    load_on_startup: bool = False
    stop_timeout_s: float = 10.0
    sleep_idle_s: float = 0.0
    weights: str | None = None
    draft_model: str | None = None  # a smaller model with the same vocabulary whose tokens are verified in one trip
    placement: str = "auto"  # or "split", "replicas" (design §11)

    def __post_init__(self) -> None:
        for field in _CHECKS:
            object.__setattr__(self, field, _check_field(field, getattr(self, field)))
        if self.prefill_chunk > self.max_context:
            raise PresetError(f"prefill_chunk {self.prefill_chunk} exceeds max_context {self.max_context}")


@dataclass(frozen=True)
class ModelPreset:
    name: str
    store_model: str
    aliases: tuple[str, ...]
    settings: ModelSettings
    source: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PresetError("a model needs a non-empty name")
        if not isinstance(self.store_model, str) or not self.store_model:
            raise PresetError(f"model {self.name!r} needs a stored model")
        if not isinstance(self.aliases, tuple) or not all(valid_model_name(a) for a in self.aliases):
            raise PresetError(f"model {self.name!r}: aliases must be a tuple of valid model names")
        if not isinstance(self.settings, ModelSettings):
            raise PresetError(f"model {self.name!r}: settings must be ModelSettings")
        if self.source not in SOURCES:
            raise PresetError(f"model {self.name!r}: source must be one of {', '.join(SOURCES)}")


def _check_layer(values: Mapping[str, Any], where: str, *, model_keys: bool) -> dict[str, Any]:
    checked: dict[str, Any] = {}
    for key, value in values.items():
        if key in MODEL_ONLY_SETTINGS and not model_keys:
            raise PresetError(f"{where}: {key} is set per model only")
        if key == "model" and model_keys:
            if not valid_model_name(value):
                raise PresetError(f"{where}: model must be a valid model name, got {value!r}")
            checked[key] = value
        elif key == "aliases" and model_keys:
            if not isinstance(value, tuple) or not all(valid_model_name(a) for a in value):
                raise PresetError(f"{where}: aliases must be a tuple of valid model names, got {value!r}")
            checked[key] = value
        elif key in _CHECKS:
            try:
                checked[key] = _check_field(key, value)
            except PresetError as error:
                raise PresetError(f"{where}: {error}") from None
        else:
            raise PresetError(f"{where}: unknown setting {key!r}")
    return checked


@dataclass(frozen=True)
class PresetFile:
    global_settings: Mapping[str, Any]
    sections: Mapping[str, Mapping[str, Any]]

    def __post_init__(self) -> None:
        global_settings = _check_layer(self.global_settings, "[*]", model_keys=False)
        sections = {}
        for name, values in self.sections.items():
            if not valid_model_name(name):
                raise PresetError(f"[{name}]: section name is not a valid model name")
            sections[name] = MappingProxyType(_check_layer(values, f"[{name}]", model_keys=True))
        object.__setattr__(self, "global_settings", MappingProxyType(global_settings))
        object.__setattr__(self, "sections", MappingProxyType(sections))

    def without(self, names: Iterable[str]) -> PresetFile:
        """The same file without the sections ``names``."""
        drop = set(names)
        return PresetFile(self.global_settings, {k: v for k, v in self.sections.items() if k not in drop})


def weights_of(section: str, values: Mapping[str, Any]) -> str:
    """The stored model whose weights a section runs: ``model =``, else its own name."""
    return values.get("model", section)


def sections_without_weights(store_models: Iterable[str], presets: PresetFile | None) -> dict[str, str]:
    """The sections whose weights no store holds: section -> the stored model it names."""
    stored = set(store_models)
    if presets is None:
        return {}
    return {name: weights_of(name, values) for name, values in sorted(presets.sections.items())
            if weights_of(name, values) not in stored}


# --- parsing


def _parse_value(field: str, text: str) -> Any:
    lowered = text.strip().lower()
    if field in ("max_context", "prefill_chunk", "replica_count"):
        if field == "replica_count" and lowered == "auto":
            return None
        return int(lowered) if _INT_RE.match(lowered) else text
    if field in ("replicate_head_ratio", "stop_timeout_s", "sleep_idle_s"):
        try:
            return float(lowered)
        except ValueError:
            return text
    if field == "load_on_startup":
        return _BOOLS.get(lowered, text)
    if field == "draft_model":
        return text.strip()
    if field == "placement":
        return lowered
    return None if lowered == "auto" else lowered  # weights


def _aliases(text: str, section: str, where: str) -> tuple[str, ...]:
    aliases: list[str] = []
    for alias in (part.strip() for part in text.split(",")):
        if not alias or alias == section or alias in aliases:
            continue
        if not valid_model_name(alias):
            raise PresetError(f"{where}: alias {alias!r} is not a valid model name")
        aliases.append(alias)
    return tuple(aliases)


def _parse_section(origin: str, section: str, items: Iterable[tuple[str, str]]) -> dict[str, Any]:
    is_global = section == GLOBAL_SECTION
    allowed = tuple(SETTING_KEYS) if is_global else tuple(SETTING_KEYS) + MODEL_KEYS
    values: dict[str, Any] = {}
    for key, text in items:
        where = f"{origin}: [{section}] {key}"
        if key in MODEL_KEYS and is_global:
            raise PresetError(f"{where}: {key!r} is not allowed in [*], only in a model's section")
        if key == "model":
            name = text.strip()
            if not valid_model_name(name):
                raise PresetError(f"{where}: expected a stored model name, got {text!r}")
            values["model"] = name
        elif key == "aliases":
            values["aliases"] = _aliases(text, section, where)
        elif key in SETTING_KEYS:
            field = SETTING_KEYS[key]
            if field in MODEL_ONLY_SETTINGS and is_global:
                raise PresetError(f"{where}: {key!r} is not allowed in [*], only in a model's section")
            try:
                values[field] = _CHECKS[field](_parse_value(field, text))
            except ValueError as error:
                raise PresetError(f"{where}: expected {error}, got {text!r}") from None
        else:
            raise PresetError(f"{origin}: [{section}] unknown key {key!r}; known keys: {', '.join(sorted(allowed))}")
    return values


def _normalise_key(key: str) -> str:
    return key.strip().lower().replace("_", "-")


def parse_presets(text: str, *, origin: str = "presets") -> PresetFile:
    """Parse a presets file; any problem raises PresetError naming origin, section and key."""
    if not isinstance(text, str):
        raise PresetError(f"{origin}: presets must be text")
    parser = configparser.ConfigParser(
        interpolation=None,
        strict=True,
        comment_prefixes=("#", ";"),
        inline_comment_prefixes=("#", ";"),
        default_section="\x00no-default",  # [DEFAULT] is an ordinary model name here
    )
    parser.optionxform = _normalise_key  # type: ignore[method-assign,assignment]
    try:
        parser.read_string(text, source=origin)
    except configparser.Error as error:
        raise PresetError(f"{origin}: {error}") from None
    global_settings: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for section in parser.sections():
        if section != GLOBAL_SECTION and not valid_model_name(section):
            raise PresetError(f"{origin}: [{section}] is not a valid model name (letters, digits, '.', '_', '-')")
        values = _parse_section(origin, section, parser.items(section, raw=True))
        if section == GLOBAL_SECTION:
            global_settings = values
        else:
            sections[section] = values
    return PresetFile(global_settings, sections)


# --- building the registry


def _model_defaults(defaults: ModelSettings, context_length: int | None) -> dict[str, Any]:
    values = {f.name: getattr(defaults, f.name) for f in fields(ModelSettings)}
    if context_length is not None:
        values["max_context"] = min(defaults.max_context, context_length)
    return values


def build_models(
    store_models: Mapping[str, int],
    presets: PresetFile | None,
    *,
    defaults: ModelSettings = ModelSettings(),
    overrides: Mapping[str, Any] = _NO_OVERRIDES,
    startup_models: Iterable[str] = (),
) -> dict[str, ModelPreset]:
    """Every stored model and every preset section, with layered settings, ordered by name."""
    for name, context_length in store_models.items():
        if isinstance(context_length, bool) or not isinstance(context_length, int) or context_length < MIN_CONTEXT:
            raise PresetError(f"stored model {name!r}: context_length must be an integer >= {MIN_CONTEXT}, got {context_length!r}")
    explicit_top = _check_layer(overrides, "agent configuration", model_keys=False)
    global_layer = dict(presets.global_settings) if presets else {}
    sections = presets.sections if presets else {}
    for name, store_model in sections_without_weights(store_models, presets).items():
        if "model" in sections[name]:
            raise PresetError(f"[{name}] takes its weights from {store_model!r}, which no model store holds; "
                              f"import {store_model!r} first, or name a stored model in 'model ='")
        raise PresetError(f"[{name}] names no weights: no model store holds a model called {name!r} and the "
                          f"section has no 'model =' line; add 'model = <stored model>', or import {name!r} first")

    models: dict[str, ModelPreset] = {}
    for name in sorted(set(store_models) | set(sections)):
        section = dict(sections.get(name, {}))
        store_model = section.pop("model", name)
        aliases = section.pop("aliases", ())
        if name in store_models and store_model != name:
            raise PresetError(f"[{name}] patches the stored model {name!r}; it cannot take its weights from {store_model!r}")
        explicit = {**global_layer, **section, **explicit_top}
        values = _model_defaults(defaults, store_models.get(store_model))
        if "prefill_chunk" not in explicit:
            values["prefill_chunk"] = min(values["prefill_chunk"], explicit.get("max_context", values["max_context"]))
        values.update(explicit)
        try:
            settings = ModelSettings(**values)
        except PresetError as error:
            raise PresetError(f"model {name!r}: {error}") from None
        if settings.draft_model in (name, store_model):
            raise PresetError(f"[{name}] model-draft names the model itself; name a smaller model with its vocabulary")
        models[name] = ModelPreset(name, store_model, tuple(aliases), settings, "preset" if name in sections else "store")

    owners: dict[str, str] = {}
    for name, model in models.items():
        for alias in model.aliases:
            if alias in models:
                raise PresetError(f"alias {alias!r} of model {name!r} is already the name of model {alias!r}")
            if alias in owners:
                raise PresetError(f"alias {alias!r} is claimed by both {owners[alias]!r} and {name!r}")
            owners[alias] = name

    for wanted in startup_models:
        canonical = resolve_name(models, wanted)
        if canonical is not None and not models[canonical].settings.load_on_startup:
            model = models[canonical]
            models[canonical] = replace(model, settings=replace(model.settings, load_on_startup=True))
    return models


def resolve_name(models: Mapping[str, ModelPreset], name: str) -> str | None:
    """The canonical name for a model name or alias; None when unknown."""
    if name in models:
        return name
    for canonical, model in models.items():
        if name in model.aliases:
            return canonical
    return None
