"""The "gpu" flavour (CUDA's: the fused graph in mixed precision, float16 KV rows) run here on
the CPU provider, which has the same float16 kernels' contract: it gives float32 logits within
float16's precision of the exact float32 graph, keeps its KV rows in float16 (half the bytes),
batches ragged rows and chains with float32 fragments of another flavour."""

from __future__ import annotations

import numpy as np
import pytest

import shards.graph.fragment as fragment_module
import shards.runtime.kv_pool as kv_pool_module
import shards.runtime.ort_runner as runner_module
from shards.importers.importer import import_model
from shards.providers.backends import CPU, Backend
from shards.runtime.chain import chain_forward
from shards.runtime.ort_runner import OrtFragmentRunner
from shards.store.model_store import ModelStore
from tests.shards.fragment_helpers import PROMPT_IDS, SMOLLM2, greedy, write_tiny_checkpoint

GROWTH = 16
HALF_TOLERANCE = 2e-2  # logits of the tiny models are a few units: float16 keeps ~3 digits


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-flavour")
    store = ModelStore(root / "home")
    for weights in ("f32", "q4"):
        import_model(write_tiny_checkpoint(root / f"checkpoint-{weights}", layers=3), name=f"tiny-{weights}",
                     weights=weights, store=store, progress=False)
    return store


@pytest.fixture(autouse=True)
def small_growth(monkeypatch):
    monkeypatch.setattr(runner_module, "KV_GROWTH_POSITIONS", GROWTH)


def exact_reference(model_dir, tmp_path, monkeypatch, first: int = 0, last: int = 2) -> OrtFragmentRunner:
    """The float32 fused graph with quantised products computed exactly (not on int8 activations)."""
    monkeypatch.setattr(fragment_module, "Q4_ACCURACY_LEVEL", 0)
    monkeypatch.setattr(fragment_module, "Q8_ACCURACY_LEVEL", 0)
    reference = OrtFragmentRunner(model_dir, first, last, threads=1, cache_dir=tmp_path / "exact")
    monkeypatch.undo()
    monkeypatch.setattr(runner_module, "KV_GROWTH_POSITIONS", GROWTH)
    return reference


@pytest.mark.parametrize("weights", ["f32", "q4"])
def test_half_precision_logits_follow_the_exact_graph_across_doublings_and_batches(store, weights, tmp_path,
                                                                                monkeypatch) -> None:
    model_dir = store.model_dir(f"tiny-{weights}")
    half = OrtFragmentRunner(model_dir, 0, 2, threads=1, flavour="gpu", cache_dir=tmp_path)
    exact = exact_reference(model_dir, tmp_path, monkeypatch)
    allocate = kv_pool_module.allocate

    def like_a_device(shape, dtype):  # a device's rows grow by doubling: no room for the whole context at once
        if shape[2] == half.max_context:
            raise MemoryError("no room for the whole context")
        return allocate(shape, dtype)

    monkeypatch.setattr(kv_pool_module, "allocate", like_a_device)
    assert half.flavour == "gpu" and half._pool.dtype == np.float16
    rng = np.random.default_rng(7)
    prompts = {"a": 20, "idle": 3, "b": 9}
    for sid, length in prompts.items():
        ids = rng.integers(3, 90, size=(1, length))
        for runner in (half, exact):
            runner.open_session(sid)
        got, want = half.forward(sid, ids), exact.forward(sid, ids)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, atol=HALF_TOLERANCE, rtol=0)
    for _ in range(16):  # "a" crosses the growth from 32 to 64 positions
        ids = rng.integers(3, 90, size=(2, 1))
        got = half.forward_batch(["b", "a"], ids)
        want = np.concatenate([exact.forward("b", ids[:1]), exact.forward("a", ids[1:])])
        np.testing.assert_allclose(got, want, atol=HALF_TOLERANCE, rtol=0)
        assert (got[:, -1].argmax(-1) == want[:, -1].argmax(-1)).all()
    assert half.session_length("a") == 36 and half._pool.capacity == 64
    assert half._pool.nbytes() * 2 == exact._pool.nbytes()  # the same rows, in float16


def test_a_half_precision_fragment_chains_with_float32_ones(store, tmp_path, monkeypatch) -> None:
    """Hidden states cross a link in float32 whatever the flavours on either side."""
    model_dir = store.model_dir("tiny-f32")
    mixed = [OrtFragmentRunner(model_dir, 0, 0, threads=1, cache_dir=tmp_path),
             OrtFragmentRunner(model_dir, 1, 1, threads=1, flavour="gpu", cache_dir=tmp_path),
             OrtFragmentRunner(model_dir, 2, 2, threads=1, cache_dir=tmp_path)]
    whole = exact_reference(model_dir, tmp_path, monkeypatch)
    ids = np.random.default_rng(3).integers(3, 90, size=(1, 12))
    np.testing.assert_allclose(chain_forward(mixed, "s", ids), chain_forward([whole], "s", ids),
                               atol=HALF_TOLERANCE, rtol=0)


@pytest.mark.filterwarnings("ignore:Specified provider .CUDAExecutionProvider.")  # onnxruntime says it too
def test_a_cuda_backend_asks_for_the_gpu_flavour_and_falls_back_to_the_cpu_here(store, tmp_path) -> None:
    cuda = Backend("cuda", "CUDAExecutionProvider", "gpu", "gpu", (("device_id", "0"),))
    runner = OrtFragmentRunner(store.model_dir("tiny-f32"), 0, 2, threads=1, cache_dir=tmp_path,
                               backends=[cuda, Backend("cpu", CPU, "cpu", "cpu")])
    assert runner.flavour == "cpu" and runner.describe()["fallbacks"][0].startswith("cuda: ")


def test_smollm2_in_half_precision_keeps_the_greedy_tokens(smollm2_store, tmp_path) -> None:
    model_dir = smollm2_store.model_dir(SMOLLM2)
    results = {}
    for flavour in ("cpu", "gpu"):
        runner = OrtFragmentRunner(model_dir, 0, 29, threads=2, flavour=flavour, max_context=128, cache_dir=tmp_path)
        results[flavour] = greedy([runner], "s", PROMPT_IDS[None], 32)
        runner.close()
    (want, want_tokens), (got, got_tokens) = results["cpu"], results["gpu"]
    assert got_tokens == want_tokens
    # float16 weights and products: about 6e-4 of the logits' range here (0.022 of 37.6)
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()
