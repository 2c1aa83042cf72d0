import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core.errors import NcmError, PresetError
from agent.core.presets import (
    SETTING_KEYS,
    ModelPreset,
    ModelSettings,
    PresetFile,
    build_models,
    parse_presets,
    resolve_name,
    sections_without_weights,
)
from tests.examples import examples

STORE = {"llama": 8192, "tiny": 512}


def test_preset_error_is_an_ncm_error():
    assert issubclass(PresetError, NcmError)


def test_setting_keys_map_to_every_field():
    assert set(SETTING_KEYS.values()) == set(ModelSettings.__dataclass_fields__)
    assert SETTING_KEYS["context"] == "max_context" and SETTING_KEYS["sleep-idle-seconds"] == "sleep_idle_s"


def test_parse_types_values_and_normalises_keys():
    presets = parse_presets(
        """
        # a comment
        [*]
        Stop_Timeout = 5
        head-ratio = 0.5  ; inline comment
        [llama]
        context = 4096
        prefill_chunk = 128
        replicas = 2
        LOAD-ON-STARTUP = yes
        sleep-idle-seconds = 300
        weights = Q4
        aliases = big, llama-3 ,, big
        """
    )
    assert dict(presets.global_settings) == {"stop_timeout_s": 5.0, "replicate_head_ratio": 0.5}
    assert dict(presets.sections["llama"]) == {
        "max_context": 4096, "prefill_chunk": 128, "replica_count": 2, "load_on_startup": True,
        "sleep_idle_s": 300.0, "weights": "q4", "aliases": ("big", "llama-3"),
    }


def test_empty_file_and_none_presets():
    assert parse_presets("") == PresetFile({}, {})
    models = build_models(STORE, None)
    assert list(models) == ["llama", "tiny"] and all(m.source == "store" for m in models.values())


@pytest.mark.parametrize(
    "layer_values, expected",
    [
        # defaults, [*], section, overrides -> winner (None: layer does not set it)
        ((6.0, None, None, None), 6.0),
        ((6.0, 7.0, None, None), 7.0),
        ((6.0, 7.0, 8.0, None), 8.0),
        ((6.0, 7.0, 8.0, 9.0), 9.0),
        ((6.0, None, 8.0, None), 8.0),
        ((6.0, 7.0, None, 9.0), 9.0),
        ((6.0, None, None, 9.0), 9.0),
    ],
)
def test_precedence_defaults_global_section_overrides(layer_values, expected):
    default, glob, section, override = layer_values
    text = "[*]\n" + (f"stop-timeout = {glob}\n" if glob is not None else "")
    text += "[llama]\n" + (f"stop-timeout = {section}\n" if section is not None else "")
    overrides = {"stop_timeout_s": override} if override is not None else {}
    models = build_models(STORE, parse_presets(text), defaults=ModelSettings(stop_timeout_s=default), overrides=overrides)
    assert models["llama"].settings.stop_timeout_s == expected
    # [*] reaches every model, a section only its own
    assert models["tiny"].settings.stop_timeout_s == (override if override is not None else glob if glob is not None else default)


def test_section_merges_only_the_keys_it_writes():
    presets = parse_presets("[*]\nreplicas = 3\nweights = f16\n[llama]\nweights = q4\n")
    models = build_models(STORE, presets, defaults=ModelSettings(sleep_idle_s=60.0))
    llama = models["llama"].settings
    assert llama.weights == "q4" and llama.replica_count == 3 and llama.sleep_idle_s == 60.0
    assert models["llama"].source == "preset" and models["tiny"].source == "store"
    assert models["tiny"].settings.weights == "f16"


def test_auto_restores_the_default_below():
    presets = parse_presets("[*]\nreplicas = 3\nweights = f16\n[llama]\nreplicas = auto\nweights = AUTO\n")
    llama = build_models(STORE, presets)["llama"].settings
    assert llama.replica_count is None and llama.weights is None


def test_new_name_section_takes_weights_from_a_stored_model():
    presets = parse_presets("[chat]\nmodel = llama\ncontext = 1024\n")
    models = build_models(STORE, presets)
    assert list(models) == ["chat", "llama", "tiny"]
    assert models["chat"].store_model == "llama" and models["chat"].source == "preset"
    assert models["chat"].settings.max_context == 1024
    assert models["llama"].settings.max_context == 2048  # the stored model itself is untouched


def test_a_section_that_names_no_weights_is_refused_naming_it():
    """A new name without `model =` used to be listed and then fail every load (503, retry)."""
    with pytest.raises(PresetError, match=r"\[orphan\] names no weights.*'model ="):
        build_models(STORE, parse_presets("[chat]\nmodel = llama\n[orphan]\nweights = q4\n"))
    with pytest.raises(PresetError, match=r"\[chat\] takes its weights from 'ghost', which no model store holds"):
        build_models(STORE, parse_presets("[chat]\nmodel = ghost\n"))


def test_sections_without_weights_can_be_left_out():
    presets = parse_presets("[*]\ncontext = 64\n[chat]\nmodel = llama\n[orphan]\n[ghostly]\nmodel = ghost\n")
    missing = sections_without_weights(STORE, presets)
    assert missing == {"ghostly": "ghost", "orphan": "orphan"}
    models = build_models(STORE, presets.without(missing))
    assert list(models) == ["chat", "llama", "tiny"] and models["chat"].settings.max_context == 64
    assert sections_without_weights({**STORE, "orphan": 512}, presets) == {"ghostly": "ghost"}
    assert sections_without_weights(STORE, None) == {}


def test_a_section_of_a_stored_model_cannot_take_other_weights():
    with pytest.raises(PresetError, match="tiny"):
        build_models(STORE, parse_presets("[llama]\nmodel = tiny\n"))
    assert build_models(STORE, parse_presets("[llama]\nmodel = llama\n"))["llama"].store_model == "llama"


def test_aliases_resolve_to_their_model():
    models = build_models(STORE, parse_presets("[chat]\nmodel = llama\naliases = gpt-4, default\n[tiny]\naliases = small\n"))
    assert resolve_name(models, "gpt-4") == "chat" and resolve_name(models, "default") == "chat"
    assert resolve_name(models, "small") == "tiny" and resolve_name(models, "llama") == "llama"
    assert resolve_name(models, "unknown") is None
    assert models["chat"].aliases == ("gpt-4", "default")


def test_alias_equal_to_another_models_name_is_refused():
    with pytest.raises(PresetError, match="'tiny'.*'llama'|'llama'.*'tiny'"):
        build_models(STORE, parse_presets("[llama]\naliases = tiny\n"))


def test_alias_claimed_by_two_models_is_refused():
    with pytest.raises(PresetError, match="claimed by both 'a' and 'b'"):
        build_models(STORE, parse_presets("[a]\nmodel = llama\naliases = x\n[b]\nmodel = tiny\naliases = y, x\n"))


def test_unknown_key_names_origin_section_and_known_keys():
    with pytest.raises(PresetError) as error:
        parse_presets("[llama]\ncontxt = 10\n", origin="/etc/ncm/presets.ini")
    message = str(error.value)
    assert "/etc/ncm/presets.ini" in message and "[llama]" in message and "contxt" in message
    for key in (*SETTING_KEYS, "model", "aliases"):
        assert key in message


@pytest.mark.parametrize(
    "line, expected",
    [
        ("load-on-startup = maybe", "true/false"),
        ("context = 4k", "integer >= 16"),
        ("context = 8", "integer >= 16"),
        ("context = 1.5", "integer"),
        ("prefill-chunk = 0", "integer >= 1"),
        ("replicas = -1", "integer >= 0"),
        ("head-ratio = 1.5", "between 0 and 1"),
        ("head-ratio = nan", "between 0 and 1"),
        ("stop-timeout = 0", "> 0"),
        ("stop-timeout = soon", "> 0"),
        ("sleep-idle-seconds = -5", ">= 0"),
        ("sleep-idle-seconds = inf", ">= 0"),
        ("weights = q8", "f32, f16, q4"),
        ("context =", "integer"),
    ],
)
def test_bad_values_name_section_key_and_expectation(line, expected):
    key = line.split("=")[0].strip()
    with pytest.raises(PresetError) as error:
        parse_presets(f"[llama]\n{line}\n")
    assert expected in str(error.value) and "[llama]" in str(error.value) and key in str(error.value)


@pytest.mark.parametrize("key", ["model = llama", "aliases = x", "model-draft = tiny"])
def test_global_section_refuses_model_and_aliases(key):
    with pytest.raises(PresetError, match=r"not allowed in \[\*\]"):
        parse_presets(f"[*]\n{key}\n")


@pytest.mark.parametrize(
    "text",
    [
        "context = 10\n",  # no section header
        "[llama]\ncontext = 1024\n[llama]\nweights = q4\n",  # duplicate section
        "[llama]\nstop_timeout = 1\nstop-timeout = 2\n",  # duplicate key after normalisation
        "[llama]\njust-a-word\n",
        "[bad name]\n",
        "[../etc]\n",
        "[a..b]\n",
        "[llama]\naliases = ok, not/ok\n",
        "[chat]\nmodel = ../llama\n",
    ],
)
def test_malformed_files_raise_preset_error(text):
    with pytest.raises(PresetError):
        parse_presets(text)


def test_default_section_is_an_ordinary_model():
    presets = parse_presets("[DEFAULT]\nmodel = tiny\n[llama]\ncontext = 4096\n")
    assert set(presets.sections) == {"DEFAULT", "llama"} and "model" not in presets.sections["llama"]


def test_context_is_capped_to_the_manifest_and_prefill_follows():
    store = {"small": 128, "large": 100_000}
    models = build_models(store, None, defaults=ModelSettings(max_context=4096, prefill_chunk=512))
    assert (models["small"].settings.max_context, models["small"].settings.prefill_chunk) == (128, 128)
    assert (models["large"].settings.max_context, models["large"].settings.prefill_chunk) == (4096, 512)
    # an explicit value is the operator's call and is not capped
    models = build_models(store, parse_presets("[small]\ncontext = 256\n"))
    assert models["small"].settings.max_context == 256
    # a new-name section is capped by the stored model that holds its weights
    models = build_models(store, parse_presets("[s2]\nmodel = small\n"))
    assert models["s2"].settings.max_context == 128


def test_explicit_prefill_above_context_is_an_error():
    with pytest.raises(PresetError, match="'small'.*prefill_chunk 512 exceeds max_context 128"):
        build_models({"small": 128}, parse_presets("[*]\nprefill-chunk = 512\n"))
    with pytest.raises(PresetError, match="prefill_chunk"):
        build_models(STORE, parse_presets("[llama]\ncontext = 64\nprefill-chunk = 128\n"))


def test_default_prefill_follows_an_explicit_smaller_context():
    assert build_models(STORE, parse_presets("[*]\ncontext = 64\n"))["llama"].settings.prefill_chunk == 64


def test_startup_models_load_on_startup():
    presets = parse_presets("[chat]\nmodel = llama\naliases = main\nload-on-startup = off\n")
    models = build_models(STORE, presets, startup_models=["main", "missing"])
    assert models["chat"].settings.load_on_startup is True
    assert models["llama"].settings.load_on_startup is False and models["tiny"].settings.load_on_startup is False


def test_bad_overrides_and_store_entries():
    with pytest.raises(PresetError, match="unknown setting 'context'"):
        build_models(STORE, None, overrides={"context": 4096})
    with pytest.raises(PresetError, match="stop_timeout_s"):
        build_models(STORE, None, overrides={"stop_timeout_s": -1})
    with pytest.raises(PresetError, match="context_length"):
        build_models({"broken": 0}, None)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_context": 15}, "max_context"),
        ({"max_context": True}, "max_context"),
        ({"prefill_chunk": 4096}, "prefill_chunk"),
        ({"replicate_head_ratio": -0.1}, "replicate_head_ratio"),
        ({"replica_count": -1}, "replica_count"),
        ({"load_on_startup": 1}, "load_on_startup"),
        ({"stop_timeout_s": float("inf")}, "stop_timeout_s"),
        ({"sleep_idle_s": -1.0}, "sleep_idle_s"),
        ({"weights": "int8"}, "weights"),
        ({"draft_model": "../x"}, "draft_model"),
    ],
)
def test_model_settings_validate_each_field(kwargs, field):
    with pytest.raises(PresetError, match=field):
        ModelSettings(**kwargs)


def test_model_settings_and_preset_are_frozen():
    settings = ModelSettings(stop_timeout_s=5)
    assert settings.stop_timeout_s == 5.0 and isinstance(settings.stop_timeout_s, float)
    with pytest.raises(AttributeError):
        settings.max_context = 4  # type: ignore[misc]
    with pytest.raises(PresetError):
        ModelPreset("x", "x", (), settings, "elsewhere")


# --- property: the highest layer that sets a value wins

FIELD_VALUES = {
    "stop_timeout_s": ("stop-timeout", st.floats(0.001, 1e6)),
    "sleep_idle_s": ("sleep-idle-seconds", st.floats(0, 1e6)),
    "replicate_head_ratio": ("head-ratio", st.floats(0, 1)),
    "replica_count": ("replicas", st.integers(0, 64)),
    "weights": ("weights", st.sampled_from(["f32", "f16", "q4"])),
    "load_on_startup": ("load-on-startup", st.booleans()),
}


def _ini(value):
    if isinstance(value, bool):
        return "yes" if value else "no"
    return repr(value) if isinstance(value, float) else str(value)


@st.composite
def layers(draw):
    chosen = {}
    for field, (_key, values) in FIELD_VALUES.items():
        chosen[field] = [draw(st.one_of(st.none(), values)) for _ in range(3)]  # [*], section, overrides
    return chosen


@settings(max_examples=examples(60), deadline=None)
@given(layers())
def test_highest_layer_that_sets_a_value_wins(chosen):
    glob = "".join(f"{FIELD_VALUES[f][0]} = {_ini(v[0])}\n" for f, v in chosen.items() if v[0] is not None)
    section = "".join(f"{FIELD_VALUES[f][0]} = {_ini(v[1])}\n" for f, v in chosen.items() if v[1] is not None)
    overrides = {f: v[2] for f, v in chosen.items() if v[2] is not None}
    models = build_models(STORE, parse_presets(f"[*]\n{glob}[llama]\n{section}"), overrides=overrides)
    defaults = ModelSettings()
    for field, values in chosen.items():
        set_layers = [v for v in values if v is not None]
        expected = set_layers[-1] if set_layers else getattr(defaults, field)
        assert getattr(models["llama"].settings, field) == expected
        tiny_layers = [v for v in (values[0], values[2]) if v is not None]
        assert getattr(models["tiny"].settings, field) == (tiny_layers[-1] if tiny_layers else getattr(defaults, field))


def test_a_draft_model_is_named_per_model_as_it_is_written_and_never_the_model_itself():
    presets = parse_presets("[llama]\nmodel-draft = Tiny-Q4\n[big]\nmodel = llama\nmodel-draft = big\n")
    assert presets.sections["llama"]["draft_model"] == "Tiny-Q4"  # model names keep their case
    with pytest.raises(PresetError, match=r"\[big\] model-draft names the model itself"):
        build_models(STORE, presets)
    with pytest.raises(PresetError, match=r"\[llama\] model-draft names the model itself"):
        build_models(STORE, parse_presets("[llama]\nmodel-draft = llama\n"))
    models = build_models(STORE, parse_presets("[llama]\nmodel-draft = tiny\n"))
    assert models["llama"].settings.draft_model == "tiny" and models["tiny"].settings.draft_model is None


def test_a_placement_is_auto_unless_the_agent_a_model_or_every_model_names_another():
    models = build_models(STORE, parse_presets("[*]\nplacement = Replicas\n[tiny]\nplacement = split\n"))
    assert models["llama"].settings.placement == "replicas" and models["tiny"].settings.placement == "split"
    assert build_models(STORE, parse_presets("")).get("llama").settings.placement == "auto"
    agent_default = ModelSettings(placement="split")  # the agent's default_placement: the presets still win
    assert build_models(STORE, None, defaults=agent_default)["llama"].settings.placement == "split"
    models = build_models(STORE, parse_presets("[llama]\nplacement = auto\n"), defaults=agent_default)
    assert models["llama"].settings.placement == "auto" and models["tiny"].settings.placement == "split"
    assert build_models(STORE, parse_presets("[llama]\nplacement = AUTO\n"))["llama"].settings.placement == "auto"
    with pytest.raises(PresetError, match=r"\[llama\] placement: expected one of split, replicas, auto"):
        build_models(STORE, parse_presets("[llama]\nplacement = pipeline\n"))
