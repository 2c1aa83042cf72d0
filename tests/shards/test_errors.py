"""The model layer's errors (shards.errors): one base, ShardsError, and a subclass per kind of
problem, arranged so that catching a kind catches its refinements (a corrupt weight file is a
model format error, a bad grammar a sampling error, RKNN's failures runner errors); what the
two errors with extra data carry; and each kind raised, as itself, by the code that owns it."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shards import errors
from shards.errors import (
    CorruptWeightsError,
    FragmentError,
    GrammarError,
    ModelFormatError,
    ModelNotFoundError,
    RknnConversionError,
    RknnUnavailableError,
    RunnerError,
    SamplingError,
    ShardsError,
    TokenizerError,
    UnmappedTensorError,
    UnsupportedArchitectureError,
)
from tests.examples import examples
from tests.shards.fragment_helpers import add_tensors, write_tiny_checkpoint

PARENTS = {
    ShardsError: Exception,
    ModelNotFoundError: ShardsError,
    ModelFormatError: ShardsError,
    UnsupportedArchitectureError: ModelFormatError,
    UnmappedTensorError: ModelFormatError,
    CorruptWeightsError: ModelFormatError,
    TokenizerError: ShardsError,
    SamplingError: ShardsError,
    GrammarError: SamplingError,
    FragmentError: ShardsError,
    RunnerError: ShardsError,
    RknnUnavailableError: RunnerError,
    RknnConversionError: RunnerError,
}


def test_every_error_of_the_module_has_its_place_in_the_hierarchy_here() -> None:
    defined = {value for _, value in inspect.getmembers(errors, inspect.isclass)
               if issubclass(value, BaseException) and value.__module__ == errors.__name__}
    assert defined == set(PARENTS)


@pytest.mark.parametrize("error", list(PARENTS), ids=lambda cls: cls.__name__)
def test_each_error_derives_from_its_kind_and_from_shards_error(error: type[Exception]) -> None:
    assert error.__bases__ == (PARENTS[error],)
    assert issubclass(error, ShardsError)
    assert error.__doc__ and error.__doc__.strip()  # says what the problem is


@pytest.mark.parametrize("error", list(PARENTS), ids=lambda cls: cls.__name__)
def test_each_error_is_caught_as_every_kind_above_it_and_no_sibling(error: type[Exception]) -> None:
    above = set()
    kind = error
    while kind is not Exception:
        above.add(kind)
        kind = PARENTS[kind]
    raised = error("what went wrong")
    assert str(raised) == "what went wrong"
    for other in PARENTS:
        assert isinstance(raised, other) is (other in above)


def test_an_unmapped_tensor_error_carries_the_names_of_every_such_tensor() -> None:
    error = UnmappedTensorError("2 tensors", (name for name in ["a.weight", "b.bias"]))  # any iterable
    assert error.names == ("a.weight", "b.bias") and str(error) == "2 tensors"
    assert UnmappedTensorError("none named").names == ()


@settings(max_examples=examples(50), deadline=None)
@given(message=st.text(), names=st.lists(st.text(max_size=20), max_size=8))
def test_the_names_are_kept_in_order_as_a_tuple(message: str, names: list[str]) -> None:
    error = UnmappedTensorError(message, names)
    names.append("changed later")  # the error keeps its own copy
    assert error.names == tuple(names[:-1]) and error.args == (message,)


def test_a_corrupt_weights_error_carries_the_paths_of_the_bad_files() -> None:
    error = CorruptWeightsError("bad files", ("weights/layer.0.safetensors",))
    assert error.paths == ("weights/layer.0.safetensors",) and str(error) == "bad files"
    assert CorruptWeightsError("none named").paths == ()


# --- each kind raised by the code that owns it -----------------------------------------------

def _manifest_of_nothing() -> None:
    from shards.store.manifest import Manifest

    Manifest.from_json("[1, 2]")


def _unknown_model(tmp: Path) -> None:
    from shards.store.model_store import ModelStore

    ModelStore(tmp / "home").manifest("no-such-model")


def _empty_eos_spec() -> None:
    from shards.text.tokenizer_spec import TokenizerSpec

    TokenizerSpec(tokenizer_json='{"model": {}}', chat_template=None, bos_token_id=None, eos_token_ids=(),
                  add_bos=False)


def _negative_temperature() -> None:
    from shards.runtime.sampling import SamplingParams

    SamplingParams(temperature=-1.0)


def _schema_that_is_a_list() -> None:
    from shards.runtime.grammar import json_schema_grammar

    json_schema_grammar(["not", "a", "schema"])


def _fragment_of_no_flavour() -> None:
    from shards.graph.spec import FragmentSpec

    FragmentSpec(first_layer=0, last_layer=1, flavour="no-such-flavour", max_context=16, prefill_chunk=0)


def _chain_of_no_runner() -> None:
    from shards.runtime.chain import RunnerChain

    RunnerChain([])


def _rknn_target_that_does_not_exist() -> None:
    from shards.providers.rknn import rknn_path

    rknn_path(Path("fragment.onnx"), "rk0000")


@pytest.mark.parametrize(("raise_it", "error", "message"), [
    (_manifest_of_nothing, ModelFormatError, "not an object"),
    (_empty_eos_spec, TokenizerError, "end-of-generation"),
    (_negative_temperature, SamplingError, "temperature"),
    (_schema_that_is_a_list, GrammarError, "must be an object"),
    (_fragment_of_no_flavour, FragmentError, "unknown flavour"),
    (_chain_of_no_runner, RunnerError, "consecutive ranges"),
    (_rknn_target_that_does_not_exist, RknnUnavailableError, "rk0000"),
], ids=lambda value: getattr(value, "__name__", None))
def test_the_code_that_owns_a_problem_raises_its_kind(raise_it, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message) as caught:
        raise_it()
    assert type(caught.value) is error


def test_an_unknown_model_is_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        _unknown_model(tmp_path)


def test_an_import_of_an_architecture_ncm_cannot_run_is_refused_as_such(tmp_path: Path) -> None:
    from shards.importers.importer import import_model
    from shards.store.model_store import ModelStore

    checkpoint = write_tiny_checkpoint(tmp_path / "checkpoint", layers=1)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(config | {"model_type": "gpt_bigcode"}))
    with pytest.raises(ModelFormatError, match="gpt_bigcode") as caught:  # caught as the wider kind
        import_model(checkpoint, name="tiny", store=ModelStore(tmp_path / "home"), progress=False)
    assert type(caught.value) is UnsupportedArchitectureError


def test_an_import_that_would_drop_tensors_names_them_all(tmp_path: Path) -> None:
    from shards.importers.importer import import_model
    from shards.store.model_store import ModelStore

    checkpoint = write_tiny_checkpoint(tmp_path / "checkpoint", layers=1)
    extra = {"model.layers.0.extra.weight": np.zeros(4, np.float32), "model.unused": np.ones(2, np.float32)}
    add_tensors(checkpoint, extra)
    store = ModelStore(tmp_path / "home")
    with pytest.raises(UnmappedTensorError, match="2 tensors") as caught:
        import_model(checkpoint, name="tiny", store=store, progress=False)
    assert caught.value.names == tuple(sorted(extra))
    assert not store.has("tiny")


def test_a_weight_file_changed_on_disk_is_a_corrupt_weights_error_naming_it(tmp_path: Path) -> None:
    from shards.importers.importer import import_model
    from shards.store.model_store import ModelStore
    from shards.store.verify import verify_weight_files

    store = ModelStore(tmp_path / "home")
    manifest = import_model(write_tiny_checkpoint(tmp_path / "checkpoint", layers=2), name="tiny", store=store,
                            progress=False)
    model_dir = store.model_dir("tiny")
    verify_weight_files(model_dir, manifest, ["embed", "layer.0", "head"])  # intact: nothing raised
    damaged = manifest.files["layer.1"].path  # not checked yet, so no size-and-time stamp of it is kept
    data = bytearray((model_dir / damaged).read_bytes())
    data[-1] ^= 0xFF
    (model_dir / damaged).write_bytes(bytes(data))
    with pytest.raises(CorruptWeightsError, match="do not match the manifest") as caught:
        verify_weight_files(model_dir, manifest, manifest.files)
    assert caught.value.paths == (damaged,)
