"""The models the router serves, from their sources: the model stores of the live nodes and the
presets file (design §10). It reads and builds them with :mod:`agent.core.presets`; what the
registry does with a new list is the router's (``on_reload``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping

from agent.core.errors import PresetError
from agent.core.presets import (
    ModelPreset,
    ModelSettings,
    PresetFile,
    build_models,
    parse_presets,
    resolve_name,
    sections_without_weights,
)
from agent.local.config import AgentConfig
from shards.store.model_store import ModelStore

log = logging.getLogger(__name__)
# Agent settings that are also model settings: set explicitly, they win over the presets file.
MODEL_SETTINGS = ("max_context", "prefill_chunk", "replicate_head_ratio", "replica_count", "sleep_idle_s")


class ModelCatalog:
    """The presets of the models the sources list now, rebuilt by :meth:`reload`."""

    def __init__(self, config: AgentConfig, store: ModelStore, holdings: Callable[[], Mapping[str, Mapping[str, int]]],
                 on_reload: Callable[[Mapping[str, ModelPreset]], None]) -> None:
        """``holdings``: per live node, the complete models its store holds (the orchestrator's
        view); ``on_reload`` is called with every list of presets a reload builds."""
        self.config = config
        self.store = store
        self._holdings = holdings
        self._on_reload = on_reload
        self.presets: dict[str, ModelPreset] = {}
        self._preset_file: PresetFile | None = None
        self._unbacked: frozenset[str] = frozenset()  # preset sections left out: no store holds their weights

    def _read_preset_file(self) -> PresetFile | None:
        path = self.config.models_preset
        if path is None:
            return None
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise PresetError(f"cannot read the presets file {str(path)!r}: {error.strerror}") from None
        return parse_presets(text, origin=str(path))

    def stored(self) -> dict[str, int]:
        """Every model some live node stores (this node's store, the others' complete models),
        with its context length where known."""
        stored = {m.name: m.context_length for m in self.store.list()}
        for models in self._holdings().values():
            for name in models:
                stored.setdefault(name, max(self.config.max_context, 16))
        return stored

    def reload(self, *, reread_file: bool = True, strict: bool = False) -> dict[str, ModelPreset]:
        """Re-read the sources (stores of the live nodes, presets file); returns the presets built.
        A bad presets file raises PresetError and keeps what was there. A section whose weights
        no live node stores is refused when ``strict`` (a reload someone asked for); otherwise
        (start, members changing) it is left out, with a warning, until a node that stores its
        weights joins."""
        preset_file = self._read_preset_file() if reread_file else self._preset_file
        origin = str(self.config.models_preset) if self.config.models_preset else "presets"
        stored = self.stored()
        usable = preset_file
        unbacked = sections_without_weights(stored, preset_file)
        if unbacked and not strict and preset_file is not None:
            usable = preset_file.without(unbacked)
            if frozenset(unbacked) != self._unbacked:
                log.warning("%s: left out until a node that stores their weights joins: %s", origin,
                            ", ".join(f"[{name}] (weights {weights!r})" for name, weights in unbacked.items()))
        overrides = {k: getattr(self.config, k) for k in self.config.explicit if k in MODEL_SETTINGS}
        defaults = ModelSettings(max_context=self.config.max_context, prefill_chunk=self.config.prefill_chunk,
                                 replicate_head_ratio=self.config.replicate_head_ratio,
                                 replica_count=self.config.replica_count, sleep_idle_s=self.config.sleep_idle_s,
                                 placement=self.config.default_placement)
        try:
            presets = build_models(stored, usable, defaults=defaults, overrides=overrides,
                                   startup_models=[self.config.model])
        except PresetError as error:
            raise PresetError(f"{origin}: {error}") from None
        self._unbacked = frozenset(unbacked)
        self._preset_file, self.presets = preset_file, presets
        self._on_reload(presets)
        return presets

    def preset_of(self, name: str) -> ModelPreset | None:
        if not self.presets:
            with contextlib.suppress(PresetError):
                self.reload()
        return self.presets.get(name)

    def resolve(self, name: str) -> str | None:
        """The canonical name of model or alias ``name``; None when no source lists it (after
        one more look at the stores: a model imported since the last look)."""
        canonical = resolve_name(self.presets, name)
        if canonical is None:
            with contextlib.suppress(PresetError):
                self.reload(reread_file=False)
            canonical = resolve_name(self.presets, name)
        return canonical
