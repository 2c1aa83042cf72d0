"""The manifest of a stored model (shards.store.manifest): model names, weight file entries,
every check a manifest makes on construction (each refusal with its reason), what it
normalises, its sizes and the files a fragment needs, and its JSON: random manifests read
back equal, features left at their defaults are not written (so a manifest from before a
feature still reads, and its bytes do not change), and malformed JSON is refused."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shards.errors import ModelFormatError
from shards.store.manifest import (
    _OPTIONAL_DEFAULTS,
    ARCHITECTURES,
    MANIFEST_VERSION,
    WEIGHT_FORMATS,
    Manifest,
    WeightFile,
    layer_key,
    valid_model_name,
)
from tests.examples import examples

SHA = "0123456789abcdef" * 4


def files_for(n_layers: int, *, first_bytes: int = 100) -> dict[str, WeightFile]:
    keys = ["embed", "head"] + [layer_key(i) for i in range(n_layers)]
    return {key: WeightFile(f"weights/{key}.safetensors", first_bytes + i, SHA) for i, key in enumerate(keys)}


def manifest(**over) -> Manifest:
    """A valid small llama manifest, with ``over`` changed (the file table follows n_layers)."""
    n_layers = over.get("n_layers", 4)
    fields = dict(name="tiny", architecture="llama", n_layers=n_layers, hidden_size=64, intermediate_size=128,
                  n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=96, rope_theta=10000.0, rms_norm_eps=1e-5,
                  context_length=256, tied_embeddings=True, attention_bias=False, weight_format="f32",
                  files=files_for(n_layers if isinstance(n_layers, int) and n_layers > 0 else 1),
                  source_digest=SHA)
    return Manifest(**(fields | over))


# --- names and weight files ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["smollm2-135m", "Qwen3-0.6B", "a", "x_y.z-1", "9" * 128])
def test_usable_model_names(name: str) -> None:
    assert valid_model_name(name)


@pytest.mark.parametrize("name", ["", "-lead", ".hidden", "a/b", "a\\b", "a b", "a..b", "9" * 129, "é", None, 3,
                                  "name\n\n", "\nname"])
def test_names_that_are_no_model_names(name) -> None:
    assert not valid_model_name(name)


@settings(max_examples=examples(100), deadline=None)
@given(name=st.text(st.characters(codec="ascii", exclude_characters="\n"), max_size=140)
       | st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,130}", fullmatch=True))
def test_a_valid_name_is_one_plain_directory_name(name: str) -> None:
    """(Without newlines: a name ending in one is the bug below.)"""
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
    expected = 1 <= len(name) <= 128 and set(name) <= allowed and name[0] not in "._-" and ".." not in name
    assert valid_model_name(name) is expected
    if expected:
        assert Path(name).name == name


def test_a_name_ending_in_a_newline_is_no_model_name() -> None:
    assert not valid_model_name("name\n")


def test_layer_keys_name_the_layers_files() -> None:
    assert [layer_key(i) for i in range(3)] == ["layer.0", "layer.1", "layer.2"]
    m = manifest(n_layers=3)
    assert m.layer_file(2) is m.files["layer.2"] and m.layer_file(2).path == "weights/layer.2.safetensors"


@pytest.mark.parametrize(("path", "size", "sha", "message"), [
    ("", 1, SHA, "bad weight file path"),
    ("/etc/passwd", 1, SHA, "bad weight file path"),
    ("weights/../../x", 1, SHA, "bad weight file path"),
    ("weights\\x", 1, SHA, "bad weight file path"),
    (7, 1, SHA, "bad weight file path"),
    ("w", 0, SHA, "bad byte count 0 for w"),
    ("w", -5, SHA, "bad byte count"),
    ("w", "10", SHA, "bad byte count"),
    ("w", 1.5, SHA, "bad byte count"),
    ("w", 1, SHA.upper(), "bad sha256 for w"),
    ("w", 1, SHA[:-1], "bad sha256"),
    ("w", 1, None, "bad sha256"),
])
def test_a_weight_file_entry_is_refused_with_the_reason(path, size, sha, message: str) -> None:
    with pytest.raises(ModelFormatError, match=message):
        WeightFile(path, size, sha)


@pytest.mark.parametrize("memory", [-1, 1.5, True, "9"])
def test_a_weight_files_loaded_size_is_a_count_of_bytes(memory) -> None:
    with pytest.raises(ModelFormatError, match="bad loaded byte count"):
        WeightFile("w", 1, SHA, memory)


def test_a_weight_files_loaded_size_is_its_size_unless_set_and_written_only_when_set() -> None:
    assert (WeightFile("w", 10, SHA).loaded_bytes, WeightFile("w", 10, SHA, 14).loaded_bytes) == (10, 14)
    files = files_for(4)
    assert all("memory_bytes" not in f for f in manifest().to_dict()["files"].values())  # other stores' as before
    grown = manifest(files=files | {"layer.0": WeightFile(files["layer.0"].path, 100, SHA, 133)})
    assert Manifest.from_dict(json.loads(grown.to_json())).files["layer.0"].loaded_bytes == 133


def test_a_weight_file_entry_may_lie_in_a_subfolder_with_dots_in_its_name() -> None:
    entry = WeightFile("weights/layer.0.v2..safetensors", 1, SHA)
    assert entry.path == "weights/layer.0.v2..safetensors"


# --- construction -----------------------------------------------------------------------------

@pytest.mark.parametrize(("change", "message"), [
    ({"name": "../up"}, "bad model name"),
    ({"architecture": "gpt2"}, "unknown architecture 'gpt2'"),
    ({"weight_format": "q8"}, "unknown weight format 'q8'"),
    ({"n_layers": True}, "n_layers must be a positive integer"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    ({"context_length": 2048.0}, "context_length must be a positive integer"),
    ({"version": MANIFEST_VERSION + 1}, "unsupported manifest version"),
    ({"rope_theta": math.inf}, "rope_theta must be a positive number"),
    ({"rms_norm_eps": 0}, "rms_norm_eps must be a positive number"),
    ({"rms_norm_eps": True}, "rms_norm_eps must be a positive number"),
    ({"n_heads": 6, "n_kv_heads": 4}, "multiple of n_kv_heads"),
    ({"head_dim": 15}, "head_dim must be even"),
    ({"weight_format": "q4", "hidden_size": 48}, "q4 needs matrix input sizes that are multiples of 32"),
    ({"weight_format": "mixed", "intermediate_size": 100}, "mixed needs matrix input sizes"),
    ({"weight_format": "q4", "head_dim": 10}, "multiples of 32"),  # n_heads * head_dim = 40
    ({"layers_without_rope": (2, 1)}, "layers_without_rope must be increasing layer indices"),
    ({"layers_without_rope": (1, 1)}, "layers_without_rope must be increasing"),
    ({"layers_without_rope": (4,)}, "layers_without_rope must be increasing"),  # past the last layer
    ({"layers_without_rope": (True,)}, "layers_without_rope must be increasing"),
    ({"layers_without_rope": {1, 2}}, "layers_without_rope must be increasing"),
    ({"sliding_layers": (0, 2)}, "sliding_window must be a positive integer exactly when"),
    ({"sliding_window": 64}, "sliding_window must be a positive integer exactly when"),
    ({"sliding_window": -1, "sliding_layers": (0,)}, "sliding_window must be"),
    ({"activation": "relu"}, "unknown activation 'relu'"),
    ({"embedding_scale": 0.0}, "embedding_scale must be a positive number"),
    ({"residual_scale": math.nan}, "residual_scale must be a positive number"),
    ({"logit_scale": -1.0}, "logit_scale must be a positive number"),
    ({"attention_scale": 0.0}, "attention_scale must be a positive number"),
    ({"sliding_rope_theta": -1.0}, "sliding_rope_theta must be a positive number"),
    ({"attention_softcap": -1.0}, "attention_softcap must be 0 \\(none\\) or a positive number"),
    ({"logit_softcap": math.inf}, "logit_softcap must be 0"),
    ({"logit_softcap": True}, "logit_softcap must be 0"),
    ({"n_experts": -1}, "n_experts must be a non-negative integer"),
    ({"experts_per_token": 1.0}, "experts_per_token must be a non-negative integer"),
    ({"n_experts": 4, "experts_per_token": 5, "expert_intermediate_size": 32}, "a mixture of experts needs"),
    ({"n_experts": 4, "experts_per_token": 2}, "a mixture of experts needs"),  # no expert width
    ({"shared_expert_intermediate_size": 64}, "a shared expert needs a mixture of experts"),
    ({"attention_bias": 1}, "must be booleans"),
    ({"qk_norm": "yes"}, "must be booleans"),
    ({"shared_table": True, "tied_embeddings": False}, "only a tied table can be shared"),
    ({"source_digest": SHA[:-1] + "G"}, "source_digest must be a sha256 hex digest"),
    ({"rotary_dim": 6.0}, "rotary_dim must be 0"),
    ({"rotary_dim": 16}, "rotary_dim must be 0"),  # the whole head is written 0
    ({"rope_freq_factors": (1.0,) * 7}, "rope_freq_factors must be rotary_width/2 positive numbers"),
    ({"rope_freq_factors": (1.0,) * 7 + (0.0,)}, "rope_freq_factors must be"),
    ({"rotary_dim": 8, "rope_freq_factors": (1.0,) * 8}, "rope_freq_factors must be"),
    ({"files": files_for(3)}, r"file table mismatch \(missing \['layer.3'\], unexpected \[\]\)"),
    ({"files": files_for(4) | {"lm_head": files_for(1)["head"]}}, r"unexpected \['lm_head'\]"),
    ({"files": files_for(4) | {"embed": {"path": "e", "bytes": 1, "sha256": SHA}}}, "must be WeightFile entries"),
])
def test_a_manifest_is_refused_with_the_reason(change: dict, message: str) -> None:
    with pytest.raises(ModelFormatError, match=message):
        manifest(**change)


def test_a_manifest_keeps_tuples_floats_and_a_read_only_file_table() -> None:
    table = files_for(4)
    m = manifest(layers_without_rope=[3], sliding_window=32, sliding_layers=[0, 2], rope_freq_factors=[1, 2, 4, 8] * 2,
                 attention_softcap=50, logit_softcap=0, files=table)
    assert m.layers_without_rope == (3,) and m.sliding_layers == (0, 2)
    assert m.rope_freq_factors == (1.0, 2.0, 4.0, 8.0) * 2 and all(type(f) is float for f in m.rope_freq_factors)
    assert type(m.attention_softcap) is float and type(m.logit_softcap) is float
    del table["head"]  # the caller's dict is copied
    assert "head" in m.files
    with pytest.raises(TypeError):
        m.files["head"] = m.files["embed"]  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.rope_theta = 1.0  # type: ignore[misc]


def test_every_known_architecture_and_weight_format_is_accepted() -> None:
    for architecture in ARCHITECTURES:
        assert manifest(architecture=architecture).architecture == architecture
    for weight_format in WEIGHT_FORMATS:
        assert manifest(weight_format=weight_format).weight_format == weight_format


# --- sizes and fragments ----------------------------------------------------------------------

def test_sizes_come_from_the_shape_and_the_file_table() -> None:
    m = manifest(n_layers=3, n_heads=8, n_kv_heads=2)
    assert m.group_size == 4 and m.rotary_width == 16 and manifest(rotary_dim=8).rotary_width == 8
    assert (m.embed_bytes, m.head_bytes, [m.layer_bytes(i) for i in range(3)]) == (100, 101, [102, 103, 104])
    assert m.kv_bytes_per_token() == 2 * 2 * 16 * 4 and m.kv_bytes_per_token(3) == 3 * m.kv_bytes_per_token()
    for bad in (-1, 3):
        with pytest.raises(ModelFormatError, match=f"layer {bad} out of range 0..2"):
            m.layer_file(bad)


@pytest.mark.parametrize(("first", "last"), [(-1, 0), (2, 1), (0, 4)])
def test_a_fragment_outside_the_layers_is_refused(first: int, last: int) -> None:
    with pytest.raises(ModelFormatError, match=f"bad layer range {first}..{last}"):
        manifest().fragment_files(first, last)


@settings(max_examples=examples(100), deadline=None)
@given(n_layers=st.integers(1, 12), data=st.data(), shared_table=st.booleans())
def test_the_fragments_of_a_cut_need_every_file_once_and_the_table_where_it_is_read(
        n_layers: int, data: st.DataObject, shared_table: bool) -> None:
    """However the layers are cut, the layer files are split among the fragments, the head file
    goes to the tail alone, and the embedding to the head (and to the tail too when the output
    layer reads the embedding's own table)."""
    m = manifest(n_layers=n_layers, shared_table=shared_table)
    cuts = sorted(data.draw(st.sets(st.integers(1, n_layers - 1), max_size=n_layers - 1)) if n_layers > 1 else [])
    ranges = list(zip([0, *cuts], [c - 1 for c in cuts] + [n_layers - 1]))
    needed = [m.fragment_files(first, last) for first, last in ranges]
    layers = [key for keys in needed for key in keys if key.startswith("layer.")]
    assert layers == [layer_key(i) for i in range(n_layers)]
    assert [keys.count("head") for keys in needed] == [0] * (len(ranges) - 1) + [1]
    expected_embed = [1] + [0] * (len(ranges) - 1)
    if shared_table:
        expected_embed[-1] = 1
    assert [keys.count("embed") for keys in needed] == expected_embed
    assert set().union(*needed) == set(m.files)


# --- JSON -------------------------------------------------------------------------------------

@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    """Random valid manifests: any architecture and weight format, any mix of the optional
    features (partial rotary, sliding layers, experts, soft-caps, scales...), each either
    drawn or left at its default."""
    n_layers = draw(st.integers(1, 6))
    n_kv_heads = draw(st.sampled_from([1, 2, 4]))
    n_heads = n_kv_heads * draw(st.integers(1, 4))
    weight_format = draw(st.sampled_from(WEIGHT_FORMATS))
    head_dim = draw(st.sampled_from([8, 16, 32, 64]))
    if weight_format in ("q4", "mixed") and (n_heads * head_dim) % 32:
        head_dim = 32
    positive = st.floats(1e-3, 1e6, allow_nan=False)
    layers = st.lists(st.integers(0, n_layers - 1), unique=True).map(sorted).map(tuple)
    optional: dict = {}

    def maybe(**fields) -> None:  # a feature (some fields that go together), or its defaults
        if draw(st.booleans()):
            optional.update(fields)

    maybe(rotary_dim=draw(st.sampled_from(range(2, head_dim, 2))), rotary_scale=draw(positive))
    rotary_width = optional.get("rotary_dim") or head_dim
    maybe(rope_freq_factors=draw(st.tuples(*[positive] * (rotary_width // 2))))
    maybe(layers_without_rope=draw(layers))
    sliding = draw(layers.filter(bool))
    maybe(sliding_layers=sliding, sliding_window=draw(st.integers(1, 4096)), sliding_rope_theta=draw(positive))
    n_experts = draw(st.integers(1, 8))
    maybe(n_experts=n_experts, experts_per_token=draw(st.integers(1, n_experts)),
          expert_intermediate_size=32 * draw(st.integers(1, 4)), renormalize_experts=draw(st.booleans()),
          shared_expert_intermediate_size=draw(st.sampled_from([0, 64])))
    maybe(attention_softcap=draw(st.sampled_from([0.0, 30.0, 50.5])), logit_softcap=draw(st.sampled_from([0, 30])))
    maybe(attention_scale=draw(positive), embedding_scale=draw(positive), residual_scale=draw(positive),
          logit_scale=draw(positive))
    maybe(activation=draw(st.sampled_from(["silu", "gelu_tanh"])))
    for flag in ("attention_output_bias", "mlp_bias", "qk_norm", "post_sublayer_norms", "pre_sublayer_norms",
                 "qk_norm_whole"):
        maybe(**{flag: draw(st.booleans())})
    tied = draw(st.booleans())
    return manifest(
        name=draw(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True).filter(lambda s: ".." not in s)),
        architecture=draw(st.sampled_from(ARCHITECTURES)), n_layers=n_layers, hidden_size=32 * draw(st.integers(1, 8)),
        intermediate_size=32 * draw(st.integers(1, 16)), n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        vocab_size=draw(st.integers(1, 300_000)), rope_theta=draw(positive), rms_norm_eps=draw(positive),
        context_length=draw(st.integers(1, 1 << 20)), tied_embeddings=tied, attention_bias=draw(st.booleans()),
        weight_format=weight_format, files=files_for(n_layers, first_bytes=draw(st.integers(1, 1 << 40))),
        source_digest=draw(st.text("0123456789abcdef", min_size=64, max_size=64)), source=draw(st.text(max_size=30)),
        shared_table=tied and draw(st.booleans()), **optional)


@settings(max_examples=examples(100), deadline=None)
@given(m=manifests())
def test_any_manifest_reads_back_equal_and_writes_the_same_json_again(m: Manifest) -> None:
    text = m.to_json()
    back = Manifest.from_json(text)
    assert back == m
    assert back.to_json() == text
    assert Manifest.from_dict(json.loads(text)) == m


@settings(max_examples=examples(50), deadline=None)
@given(m=manifests())
def test_features_left_at_their_defaults_are_not_written(m: Manifest) -> None:
    written = m.to_dict()
    for key, default in _OPTIONAL_DEFAULTS.items():
        assert (key in written) is (getattr(m, key) != default)


def test_a_manifest_from_before_the_optional_features_reads_as_it_did() -> None:
    plain = manifest()
    older = {key: value for key, value in plain.to_dict().items() if key not in _OPTIONAL_DEFAULTS}
    assert set(older) == set(plain.to_dict())  # nothing optional is written for a plain model
    read = Manifest.from_dict(older)
    assert read == plain
    assert all(getattr(read, key) == default for key, default in _OPTIONAL_DEFAULTS.items())


def test_the_json_is_sorted_with_files_and_factors_as_plain_lists() -> None:
    m = manifest(rope_freq_factors=(1.0, 2.0) * 4, layers_without_rope=(1,))
    data = json.loads(m.to_json())
    assert list(data) == sorted(data)
    assert data["files"]["embed"] == {"path": "weights/embed.safetensors", "bytes": 100, "sha256": SHA}
    assert data["rope_freq_factors"] == [1.0, 2.0] * 4 and data["layers_without_rope"] == [1]
    assert json.loads(manifest().to_json())["rope_freq_factors"] is None


def test_the_extra_section_of_early_builds_is_ignored() -> None:
    data = manifest().to_dict() | {"extra": {"anything": 1}}
    assert Manifest.from_dict(data) == manifest()


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "manifest: not valid JSON"),
    ("[1, 2]", "manifest: JSON is not an object"),
    ('"text"', "manifest: JSON is not an object"),
])
def test_text_that_is_no_json_object_is_refused(text: str, message: str) -> None:
    with pytest.raises(ModelFormatError, match=message):
        Manifest.from_json(text)


def _without(key: str) -> dict:
    data = manifest().to_dict()
    del data[key]
    return data


@pytest.mark.parametrize("data", [
    _without("files"), _without("hidden_size"), manifest().to_dict() | {"colour": "blue"},
    manifest().to_dict() | {"files": [1, 2]}, manifest().to_dict() | {"files": {"embed": "weights/embed"}},
    manifest().to_dict() | {"files": {"embed": {"path": "e", "bytes": 1}}},
    manifest().to_dict() | {"rope_freq_factors": ["x"] * 8}, manifest().to_dict() | {"rope_freq_factors": 8},
], ids=["no-files", "no-hidden-size", "unknown-key", "files-list", "file-as-text", "file-without-sha",
        "factors-text", "factors-number"])
def test_a_malformed_manifest_is_refused_as_such(data: dict) -> None:
    with pytest.raises(ModelFormatError, match="manifest: malformed"):
        Manifest.from_dict(data)


def test_a_manifest_with_a_number_too_large_for_a_float_is_refused_as_a_format_error() -> None:
    text = manifest().to_json().replace('"rope_theta": 10000.0', '"rope_theta": 1' + "0" * 400)
    assert '"rope_theta": 1000' in text
    with pytest.raises(ModelFormatError):
        Manifest.from_json(text)


def test_the_manifest_an_import_stores_reads_back_equal_and_matches_its_files(tmp_path: Path) -> None:
    from shards.importers.importer import import_model
    from shards.store.model_store import MANIFEST_FILE, ModelStore
    from tests.shards.fragment_helpers import write_tiny_checkpoint

    store = ModelStore(tmp_path / "home")
    imported = import_model(write_tiny_checkpoint(tmp_path / "checkpoint", layers=2), name="tiny", store=store,
                            progress=False)
    model_dir = store.model_dir("tiny")
    assert Manifest.from_json((model_dir / MANIFEST_FILE).read_text(encoding="utf-8")) == imported
    for entry in imported.files.values():
        assert (model_dir / entry.path).stat().st_size == entry.bytes
