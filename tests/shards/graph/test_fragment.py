"""Fragments of the real model: split invariance, static == dynamic flavour, cache, errors."""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import onnx
import pytest

from shards.errors import FragmentError
from shards.graph.fragment import BLOB_POOL, INT8_MIN_WEIGHTS, TMP_PREFIX, build_fragment, prune_blobs, sweep_fragments
from shards.runtime.chain import chain_forward
from tests.shards.fragment_helpers import PROMPT_IDS, SMOLLM2, chain, greedy

SPLITS = {
    1: [(0, 29)],
    2: [(0, 14), (15, 29)],
    3: [(0, 9), (10, 19), (20, 29)],
    5: [(0, 0), (1, 5), (6, 17), (18, 28), (29, 29)],
}
DECODE_STEPS = 6


@pytest.fixture(scope="module")
def model_dir(smollm2_store):
    return smollm2_store.model_dir(SMOLLM2)


@pytest.fixture(scope="module")
def whole(model_dir):
    return greedy(chain(model_dir, SPLITS[1], threads=2), "ref", PROMPT_IDS, DECODE_STEPS)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_split_chains_give_the_same_logits_and_tokens(model_dir, whole, n) -> None:
    rows, tokens = greedy(chain(model_dir, SPLITS[n], threads=2), f"split{n}", PROMPT_IDS, DECODE_STEPS)
    assert np.abs(rows - whole[0]).max() <= 1e-5
    assert tokens == whole[1]


def test_prefill_logits_cover_every_position(model_dir) -> None:
    runners = chain(model_dir, SPLITS[1], threads=2)
    full = chain_forward(runners, "full", PROMPT_IDS)
    for r in runners:
        r.close_session("full")
    split = chain(model_dir, SPLITS[3], threads=2)
    first = chain_forward(split, "parts", PROMPT_IDS[:4])
    rest = chain_forward(split, "parts", PROMPT_IDS[4:])
    for r in split:
        r.close_session("parts")
    assert full.shape == (1, len(PROMPT_IDS), 49152) and full.dtype == np.float32
    np.testing.assert_allclose(np.concatenate([first, rest], axis=1), full, atol=1e-4, rtol=0)


def test_static_flavour_equals_dynamic(model_dir, whole) -> None:
    runners = chain(model_dir, SPLITS[2], flavour="static", max_context=64, prefill_chunk=8, threads=2)
    assert all(r.flavour == "static" for r in runners)
    rows, tokens = greedy(runners, "static", PROMPT_IDS, DECODE_STEPS)
    assert np.abs(rows - whole[0]).max() <= 1e-4
    assert tokens == whole[1]


@pytest.mark.parametrize("io_binding", [False, True])
def test_portable_flavour_equals_cpu(model_dir, whole, io_binding) -> None:
    runners = chain(model_dir, SPLITS[3], flavour="portable", io_binding=io_binding, threads=2)
    rows, tokens = greedy(runners, "portable", PROMPT_IDS, DECODE_STEPS)
    assert np.abs(rows - whole[0]).max() <= 1e-4
    assert tokens == whole[1]


def test_portable_graph_has_plain_ops(model_dir) -> None:
    m = onnx.load(build_fragment(model_dir, 29, 29, flavour="portable"), load_external_data=False)
    assert {n.domain for n in m.graph.node} <= {"", "ai.onnx"}


def test_static_graph_has_fixed_shapes_and_plain_ops(model_dir) -> None:
    path = build_fragment(model_dir, 10, 19, flavour="static", max_context=64, prefill_chunk=8)
    m = onnx.load(path, load_external_data=False)
    for vi in list(m.graph.input) + list(m.graph.output):
        dims = vi.type.tensor_type.shape.dim
        assert all(d.HasField("dim_value") for d in dims), vi.name
    assert {n.domain for n in m.graph.node} <= {"", "ai.onnx"}


def test_cpu_flavour_uses_fused_ops_and_external_data(model_dir) -> None:
    path = build_fragment(model_dir, 0, 29)
    m = onnx.load(path, load_external_data=False)
    ops = {n.op_type for n in m.graph.node}
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= ops
    assert path.stat().st_size < 1_000_000 < sum(p.stat().st_size for p in path.parent.glob("*.bin"))


def test_fragments_are_cached_and_keyed_by_shape(model_dir, tmp_path) -> None:
    a = build_fragment(model_dir, 3, 4, cache_dir=tmp_path)
    mtime = a.stat().st_mtime_ns
    assert build_fragment(model_dir, 3, 4, cache_dir=tmp_path) == a and a.stat().st_mtime_ns == mtime
    b = build_fragment(model_dir, 3, 4, cache_dir=tmp_path, max_context=128)
    c = build_fragment(model_dir, 3, 4, cache_dir=tmp_path, flavour="static", max_context=128, prefill_chunk=16)
    d = build_fragment(model_dir, 3, 4, cache_dir=tmp_path, activation_bits=16)
    e = build_fragment(model_dir, 3, 4, cache_dir=tmp_path, activation_bits=16, int8_min_weights=0)  # a draft's
    assert len({a, b, c, d, e}) == 5
    built = {path: json.loads((path.parent / "fragment.json").read_text()) for path in (a, d, e)}
    assert [(built[p]["activation_bits"], built[p]["int8_min_weights"]) for p in (a, d, e)] == [
        (8, INT8_MIN_WEIGHTS[8]), (16, INT8_MIN_WEIGHTS[16]), (16, 0)]  # the defaults first
    assert build_fragment(model_dir, 3, 4, cache_dir=tmp_path, int8_min_weights=0) == a  # 8's default
    stale = a.parent.with_name(a.parent.name[:-20] + "0" * 20)  # as left by an older builder
    stale.mkdir()
    shutil.rmtree(a.parent)  # force a rebuild
    assert build_fragment(model_dir, 3, 4, cache_dir=tmp_path) == a and not stale.exists()
    assert d.is_file() and e.is_file()  # the other activations' builds are no stale ones
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and p.name != BLOB_POOL]  # no temp dirs


def _blobs(fragment) -> dict[int, int]:
    """inode -> size of a fragment's external data files."""
    return {st.st_ino: st.st_size for st in (p.stat() for p in fragment.parent.glob("*.bin"))}


def test_fragments_share_the_bytes_of_common_layers(model_dir, tmp_path) -> None:
    a = build_fragment(model_dir, 3, 5, cache_dir=tmp_path)
    b = build_fragment(model_dir, 4, 6, cache_dir=tmp_path, max_context=64)
    shared = _blobs(a).keys() & _blobs(b).keys()
    assert sum(_blobs(b)[i] for i in shared) > 0.6 * sum(_blobs(b).values())  # layers 4 and 5 of 3
    assert prune_blobs(tmp_path) == 0  # every pooled blob is in use
    a_alone = sum(size for inode, size in _blobs(a).items() if inode not in shared)  # layer 3, rope tables
    shutil.rmtree(a.parent)
    assert prune_blobs(tmp_path) == a_alone
    assert all(p.stat().st_nlink == 2 for p in b.parent.glob("*.bin"))  # b and the pool
    assert len(list((tmp_path / BLOB_POOL).iterdir())) == len(_blobs(b))



def test_a_pooled_blob_cut_short_is_written_again(model_dir, tmp_path) -> None:
    a = build_fragment(model_dir, 3, 3, cache_dir=tmp_path)
    biggest = max(a.parent.glob("*.bin"), key=lambda p: p.stat().st_size)
    with open(biggest, "r+b") as f:  # the pool's copy is the same file
        f.truncate(100)
    shutil.rmtree(a.parent)
    again = build_fragment(model_dir, 3, 3, cache_dir=tmp_path)
    m = onnx.load(again, load_external_data=False)
    lengths = {e.value: int(next(x.value for x in t.external_data if x.key == "length"))
               for t in m.graph.initializer for e in t.external_data if e.key == "location"}
    assert {p.name: p.stat().st_size for p in again.parent.glob("*.bin")} == lengths
    assert (tmp_path / BLOB_POOL / biggest.stem).stat().st_size == lengths[biggest.name]


def test_sweep_removes_other_builders_and_abandoned_temporary_builds(model_dir, tmp_path) -> None:
    keep = build_fragment(model_dir, 3, 3, cache_dir=tmp_path)
    older = build_fragment(model_dir, 4, 4, cache_dir=tmp_path)
    info_path = older.parent / "fragment.json"
    info = json.loads(info_path.read_text())
    del info["builder"]  # as written by an older builder
    info_path.write_text(json.dumps(info))
    in_progress = tmp_path / (TMP_PREFIX + "running")
    in_progress.mkdir()
    abandoned = tmp_path / (TMP_PREFIX + "crashed")
    abandoned.mkdir()
    os.utime(abandoned, (0, 0))
    assert sweep_fragments(tmp_path, now_s=time.time()) == 2
    assert keep.is_file() and in_progress.is_dir() and not older.parent.exists() and not abandoned.exists()
    assert sorted(p.name for p in (tmp_path / BLOB_POOL).iterdir()) == sorted(p.stem for p in keep.parent.glob("*.bin"))
    assert sweep_fragments(tmp_path, now_s=time.time()) == 0


@pytest.mark.parametrize("args,kw", [
    ((5, 4), {}), ((0, 30), {}), ((-1, 3), {}), ((0, 1), {"flavour": "tpu"}),
    ((0, 1), {"max_context": 100_000}), ((0, 1), {"flavour": "static", "max_context": 8, "prefill_chunk": 16}),
    ((0, 1), {"activation_bits": 12}), ((0, 1), {"int8_min_weights": -1}),
])
def test_bad_fragment_requests(model_dir, tmp_path, args, kw) -> None:
    with pytest.raises(FragmentError):
        build_fragment(model_dir, *args, cache_dir=tmp_path, **kw)
    assert list(tmp_path.iterdir()) == []
