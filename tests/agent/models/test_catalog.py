"""The models the router serves (:mod:`agent.models.catalog`), from a real model store holding
the tiny model, the complete models other live nodes report, and a presets file on disk:

- every model some live node stores is listed, with its own context when this node holds its
  manifest, else the agent's;
- a presets file adds models and aliases; settings the agent was given explicitly win over it;
  the agent's main model loads on startup;
- a section whose weights no live node stores is left out (warned of once) until a node that
  stores them joins; a reload someone asked for (``strict``) refuses it instead;
- a bad or unreadable presets file raises and keeps the models there were; a reload that does
  not read the file again keeps the one read last;
- the first look up reads the sources; an unknown name gets one more look at the stores (a
  model imported since), not at the file.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core.errors import PresetError
from agent.core.presets import ModelPreset
from agent.local.config import AgentConfig
from agent.models.catalog import ModelCatalog
from shards.importers.importer import import_model
from shards.store.model_store import ModelStore
from tests.shards.fragment_helpers import write_tiny_checkpoint

TINY = "tiny"
TINY_CONTEXT = 256  # what the tiny checkpoint was trained for


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("catalog") / "checkpoint")


@pytest.fixture(scope="module")
def shared_store(checkpoint, tmp_path_factory) -> ModelStore:
    """A store holding the tiny model, for the tests that only read it."""
    store = ModelStore(tmp_path_factory.mktemp("catalog-store"))
    import_model(checkpoint, name=TINY, store=store, progress=False)
    return store


@pytest.fixture
def store(checkpoint, tmp_path) -> ModelStore:
    store = ModelStore(tmp_path / "home")
    import_model(checkpoint, name=TINY, store=store, progress=False)
    return store


class Sources:
    """What the orchestrator knows (the complete models of each live node) and what the router
    was told: every list of presets a reload built."""

    def __init__(self, holdings: dict[str, dict[str, int]] | None = None) -> None:
        self.holdings = holdings or {}
        self.reloads: list[Mapping[str, ModelPreset]] = []

    def catalog(self, store: ModelStore, **settings_: object) -> ModelCatalog:
        config = AgentConfig(model=TINY, **settings_)  # type: ignore[arg-type]
        return ModelCatalog(config, store, lambda: self.holdings, on_reload=self.reloads.append)


def test_every_model_a_live_node_stores_is_listed_with_its_own_context_where_known(shared_store):
    sources = Sources({"node-0": {TINY: 396016}, "node-1": {TINY: 1, "remote": 1000}})
    catalog = sources.catalog(shared_store, max_context=1024)
    assert catalog.stored() == {TINY: TINY_CONTEXT, "remote": 1024}  # this node's manifest wins for tiny

    presets = catalog.reload()
    assert sources.reloads == [presets] and catalog.presets == presets
    assert sorted(presets) == ["remote", TINY]
    tiny, remote = presets[TINY], presets["remote"]
    assert (tiny.store_model, tiny.source, tiny.aliases) == (TINY, "store", ())
    assert tiny.settings.max_context == TINY_CONTEXT  # capped to what the model was trained for
    assert remote.settings.max_context == 1024 and remote.store_model == "remote"
    assert tiny.settings.load_on_startup and not remote.settings.load_on_startup  # the agent's main model


NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=10).filter(
    lambda name: name[0] != "-")


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.sampled_from(["node-0", "node-1", "node-2"]),
                       st.dictionaries(NAMES | st.just(TINY), st.integers(0, 10**9), max_size=4), max_size=3),
       st.integers(16, 8192))
def test_the_stored_models_are_this_stores_and_every_one_a_peer_holds(shared_store, holdings, max_context):
    catalog = Sources(holdings).catalog(shared_store, max_context=max_context, prefill_chunk=16)
    stored = catalog.stored()
    held = {name for models in holdings.values() for name in models}
    assert set(stored) == held | {TINY}
    assert stored[TINY] == TINY_CONTEXT
    assert all(stored[name] == max_context for name in held - {TINY})
    assert set(catalog.reload()) == set(stored)


def test_a_presets_file_adds_models_and_aliases_and_explicit_agent_settings_win(store, tmp_path):
    presets = tmp_path / "models.ini"
    presets.write_text("[*]\ncontext = 128\n\n[chat]\nmodel = tiny\naliases = assistant, helper\ncontext = 64\n\n"
                       "[tiny]\nprefill-chunk = 32\nsleep-idle-seconds = 30\n")
    # prefill_chunk was set explicitly (file, environment or flag); max_context is only the default
    catalog = Sources().catalog(store, models_preset=presets, max_context=1024, prefill_chunk=16,
                                explicit=frozenset({"prefill_chunk"}))
    built = catalog.reload()
    assert sorted(built) == ["chat", TINY]
    chat, tiny = built["chat"], built[TINY]
    assert (chat.store_model, chat.source, chat.aliases) == (TINY, "preset", ("assistant", "helper"))
    assert tiny.source == "preset"  # a section named after a stored model patches it
    assert chat.settings.max_context == 64 and tiny.settings.max_context == 128  # the section, then [*]
    assert chat.settings.prefill_chunk == tiny.settings.prefill_chunk == 16  # the explicit setting wins
    assert tiny.settings.sleep_idle_s == 30.0 and chat.settings.sleep_idle_s == 0.0
    assert tiny.settings.load_on_startup and not chat.settings.load_on_startup
    assert [catalog.resolve(n) for n in ("helper", "assistant", "chat", TINY, "nope")] == [
        "chat", "chat", "chat", TINY, None]


def test_the_agents_default_placement_places_every_model_whose_preset_names_none(store, tmp_path):
    presets = tmp_path / "models.ini"
    presets.write_text("[chat]\nmodel = tiny\nplacement = replicas\n")
    assert Sources().catalog(store).reload()[TINY].settings.placement == "auto"  # design §11's default
    built = Sources().catalog(store, models_preset=presets, default_placement="split",
                              explicit=frozenset({"default_placement"})).reload()
    assert built[TINY].settings.placement == "split" and built["chat"].settings.placement == "replicas"


def test_a_section_without_weights_is_left_out_until_a_node_storing_them_joins(store, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="agent.models.catalog")
    presets = tmp_path / "models.ini"
    presets.write_text("[chat]\nmodel = tiny\n\n[later]\nmodel = remote\ncontext = 64\n")
    sources = Sources()
    catalog = sources.catalog(store, models_preset=presets)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "left out until a node" in r.getMessage()]

    assert sorted(catalog.reload()) == ["chat", TINY]
    assert len(warnings()) == 1 and "[later] (weights 'remote')" in warnings()[0]
    assert str(presets) in warnings()[0]
    catalog.reload()
    assert len(warnings()) == 1  # the same sections left out: not warned of again

    sources.holdings = {"node-1": {"remote": 1000}}  # a node that stores them joined
    built = catalog.reload(reread_file=False)
    assert sorted(built) == ["chat", "later", "remote", TINY]
    assert built["later"].store_model == "remote" and built["later"].settings.max_context == 64
    assert catalog.resolve("later") == "later"

    sources.holdings = {}  # it left again
    assert "later" not in catalog.reload()
    assert len(warnings()) == 2


def test_a_reload_someone_asked_for_refuses_a_section_without_weights_and_keeps_the_models(store, tmp_path):
    presets = tmp_path / "models.ini"
    presets.write_text("[chat]\nmodel = tiny\n")
    sources = Sources()
    catalog = sources.catalog(store, models_preset=presets)
    before = catalog.reload(strict=True)
    presets.write_text("[chat]\nmodel = tiny\n\n[other]\nmodel = ghost\n")
    with pytest.raises(PresetError) as refused:
        catalog.reload(strict=True)
    assert str(refused.value).startswith(f"{presets}: ")
    assert "[other] takes its weights from 'ghost', which no model store holds" in str(refused.value)
    assert catalog.presets == before and sources.reloads == [before]  # the router was told nothing


def test_a_bad_or_unreadable_presets_file_raises_and_keeps_the_models_there_were(store, tmp_path):
    presets = tmp_path / "models.ini"
    presets.write_text("[chat]\nmodel = tiny\ncontext = 64\n")
    sources = Sources()
    catalog = sources.catalog(store, models_preset=presets)
    good = catalog.reload()

    presets.write_text("[chat]\nmodel = tiny\ncontext = lots\n")
    with pytest.raises(PresetError, match=r"\[chat\] context: expected an integer >= 16, got 'lots'") as bad:
        catalog.reload()
    assert str(presets) in str(bad.value)
    presets.unlink()
    with pytest.raises(PresetError, match="cannot read the presets file") as unreadable:
        catalog.reload()
    assert str(presets) in str(unreadable.value)
    assert catalog.presets == good and sources.reloads == [good]

    # without reading the file again, the one read last (the good one) still applies
    assert catalog.reload(reread_file=False) == good
    assert catalog.presets["chat"].settings.max_context == 64


def test_a_reload_that_does_not_read_the_file_again_keeps_the_one_read_last(store, tmp_path):
    presets = tmp_path / "models.ini"
    presets.write_text("[chat]\nmodel = tiny\ncontext = 64\n")
    catalog = Sources().catalog(store, models_preset=presets)
    catalog.reload()
    presets.write_text("[chat]\nmodel = tiny\ncontext = 32\n\n[extra]\nmodel = tiny\n")
    assert catalog.reload(reread_file=False)["chat"].settings.max_context == 64
    assert catalog.resolve("extra") is None  # a look up reads the stores again, not the file
    assert catalog.reload()["chat"].settings.max_context == 32
    assert catalog.resolve("extra") == "extra"


def test_the_first_look_up_reads_the_sources_and_an_unknown_name_looks_at_the_stores_again(
        store, checkpoint, tmp_path):
    sources = Sources()
    catalog = sources.catalog(store)
    assert catalog.presets == {}
    preset = catalog.preset_of(TINY)
    assert preset is not None and preset.settings.max_context == TINY_CONTEXT
    assert len(sources.reloads) == 1
    assert catalog.preset_of("newer") is None and len(sources.reloads) == 1  # known presets: no reload

    import_model(checkpoint, name="newer", store=store, progress=False)  # imported since the last look
    assert catalog.resolve("newer") == "newer"
    assert "newer" in catalog.presets and len(sources.reloads) == 2
    assert catalog.resolve("never-stored") is None


def test_a_look_up_with_a_broken_presets_file_finds_nothing_instead_of_raising(store, tmp_path):
    presets = tmp_path / "models.ini"
    presets.write_text("[chat\nmodel = tiny\n")
    sources = Sources()
    catalog = sources.catalog(store, models_preset=presets)
    assert catalog.preset_of(TINY) is None
    assert catalog.presets == {} and sources.reloads == []
