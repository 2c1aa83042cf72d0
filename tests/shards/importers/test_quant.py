"""Quantised weights: the MatMulNBits layout, and the q4 store of the packaged model against its float store."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from shards.importers.importer import import_model
from shards.importers.quant import dequantize, exact_q8, quantize_q4, quantize_q8
from shards.runtime.chain import chain_forward
from shards.store.model_store import ModelStore
from tests.shards.fragment_helpers import SMOLLM2, SMOLLM2_Q4, chain, greedy


def nbits_matmul(x: np.ndarray, q: dict[str, np.ndarray], bits: int) -> np.ndarray:
    """Run onnxruntime's MatMulNBits on our stored layout (+ the q4 offset term)."""
    n, kb, _ = q["qweight"].shape
    inits = [numpy_helper.from_array(q["qweight"], "B"), numpy_helper.from_array(q["scales"].reshape(-1), "S")]
    ins = ["A", "B", "S"]
    if bits == 8:
        inits.append(numpy_helper.from_array(q["zeros"].reshape(-1), "Z"))
        ins.append("Z")
    node = helper.make_node("MatMulNBits", ins, ["Y"], domain="com.microsoft", K=kb * 32, N=n, bits=bits,
                            block_size=32, accuracy_level=0)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, list(x.shape))],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [x.shape[0], n])], initializer=inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"A": x})[0]
    if bits == 4:
        y = y + x.reshape(x.shape[0], kb, 32).sum(-1) @ q["offsets"].T
    return y


@pytest.mark.parametrize("bits", [4, 8])
def test_stored_layout_is_what_matmulnbits_computes(bits) -> None:
    rng = np.random.default_rng(bits)
    w = rng.standard_normal((48, 96)).astype(np.float32)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    q = quantize_q4(w) if bits == 4 else quantize_q8(w)
    deq = dequantize(q)
    np.testing.assert_allclose(nbits_matmul(x, q, bits), x @ deq.T, atol=1e-4, rtol=1e-4)
    step = (w.max() - w.min()) / (15 if bits == 4 else 255)
    assert np.abs(deq - w).max() <= step / 2 + 1e-6


def test_q4_represents_q4_1_blocks_exactly() -> None:
    rng = np.random.default_rng(0)
    d = rng.uniform(0.01, 0.1, (8, 4, 1)).astype(np.float32)
    m = rng.uniform(-1, 0, (8, 4, 1)).astype(np.float32)
    codes = rng.integers(0, 16, (8, 4, 32))
    codes[..., 0], codes[..., 1] = 0, 15  # each block spans its whole grid
    w = (codes * d + m).reshape(8, 128).astype(np.float32)
    np.testing.assert_allclose(dequantize(quantize_q4(w)), w, atol=1e-6)


def q4_0_grid(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Float32 weights as a GGUF Q4_0 file holds them (quantised, then dequantised by gguf)."""
    import gguf

    w = np.random.default_rng(seed).normal(0.0, 0.02, (rows, cols)).astype(np.float32)
    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)
    return gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_0).reshape(rows, cols).astype(np.float32)


def test_q4_0_blocks_keep_their_symmetric_grid_with_no_offset() -> None:
    w = q4_0_grid(64, 256)
    q = quantize_q4(w)
    assert not q["offsets"].any()
    np.testing.assert_array_equal(dequantize(q), w)
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    np.testing.assert_allclose(nbits_matmul(x, q, 4), x @ w.T, atol=1e-4, rtol=1e-4)
    mixed = w.copy()
    mixed[5, 40] += 1e-3  # off the grid: that block alone gets an offset
    q = quantize_q4(mixed)
    assert np.count_nonzero(q["offsets"]) == 1 and q["offsets"][5, 1] != 0
    deq, block = dequantize(q), np.s_[5, 32:64]
    assert np.abs(deq[block] - mixed[block]).max() <= np.ptp(mixed[block]) / 15 / 2 + 1e-7
    deq[block] = mixed[block]
    np.testing.assert_array_equal(deq, mixed)  # every other block exactly


def test_a_fragment_of_q4_0_weights_has_no_offsets_matmul(tmp_path) -> None:
    from shards.graph.fragment import build_fragment
    from tests.shards.fragment_helpers import write_tiny_checkpoint

    source = write_tiny_checkpoint(tmp_path / "checkpoint", q4_0_grid=True)
    store = ModelStore(tmp_path / "home")
    m = import_model(source, name="m", weights="q4", store=store, progress=False)
    from shards.store.tensorfile import read_tensors

    stored = read_tensors(store.model_dir("m") / m.files["layer.0"].path)
    assert "q_proj.qweight" in stored and not any(k.endswith(".offsets") for k in stored)  # none stored either
    graph = onnx.load(build_fragment(store.model_dir("m"), 0, 1, cache_dir=tmp_path / "cache"), load_external_data=False)
    names = [i.name for i in graph.graph.initializer]
    assert any(n.endswith(".qweight") for n in names) and not any(n.endswith(".offsets") for n in names)
    import_model(source, name="f32", weights="f32", store=store, progress=False)  # the same weights, exactly
    ids = np.array([1, 7, 8, 9, 10], np.int64)
    q4_logits = chain_forward(chain(store.model_dir("m"), [(0, 1)], threads=1), "s", ids)
    f32_logits = chain_forward(chain(store.model_dir("f32"), [(0, 1)], threads=1), "s", ids)
    assert np.abs(q4_logits - f32_logits).max() <= 0.02 * np.abs(f32_logits).max()  # the lm_head's int8 x2 only
    assert (q4_logits[0].argmax(-1) == f32_logits[0].argmax(-1)).all()


def test_q8_0_blocks_keep_their_grid_and_other_blocks_round_to_half_a_step() -> None:
    rng = np.random.default_rng(5)
    d = rng.uniform(1e-3, 1e-1, size=(64, 4, 1)).astype(np.float16).astype(np.float32)  # GGUF Q8_0: fp16 d
    k = rng.integers(-127, 128, size=(64, 4, 32))
    k[:, :, 0] = rng.choice([-127, 127], size=(64, 4))  # the block's largest magnitude maps to 127
    q8_0 = (d * k).astype(np.float32).reshape(64, 128)
    assert exact_q8(q8_0)
    np.testing.assert_array_equal(dequantize(quantize_q8(q8_0)), q8_0)
    w = rng.standard_normal((64, 128)).astype(np.float32)
    assert not exact_q8(w) and not exact_q8(w[:, :100])
    q = quantize_q8(w)
    step = np.repeat(q["scales"], 32, axis=1)
    assert (np.abs(dequantize(q) - w) <= 0.5 * step * (1 + 1e-5)).all()


def test_blocks_of_a_quantised_file_keep_their_grid_when_their_codes_miss_its_ends() -> None:
    """d * q + m blocks (GGUF Q4_1, Q4_K) whose codes use 3..12 only, and d * (q - 16) blocks
    (Q5_0) in 8 bits: the file's values exactly, where spreading [min, max] over every code
    would move them."""
    rng = np.random.default_rng(8)
    d = rng.uniform(1e-3, 1e-1, size=(32, 4, 1)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-1, 0, size=(32, 4, 1)).astype(np.float16).astype(np.float32)
    q4_k = (d * rng.integers(3, 13, size=(32, 4, 32)) + m).astype(np.float32).reshape(32, 128)
    np.testing.assert_array_equal(dequantize(quantize_q4(q4_k)), q4_k)
    q5_0 = (d * (rng.integers(0, 32, size=(32, 4, 32)) - 16)).astype(np.float32).reshape(32, 128)
    np.testing.assert_array_equal(dequantize(quantize_q8(q5_0)), q5_0)


def test_positive_blocks_on_a_grid_from_a_whole_number_of_steps_keep_it_in_8_bits() -> None:
    """d * q blocks with q in 1..31 (a GGUF Q5_K or Q4_K block of positive weights: no min)
    count from code 0 (the grid's own zero, -min / d, would be a negative code); a block whose
    codes would pass 255 so is spread instead."""
    rng = np.random.default_rng(9)
    d = rng.uniform(1e-3, 1e-1, size=(16, 4, 1)).astype(np.float16).astype(np.float32)
    positive = (d * rng.integers(1, 32, size=(16, 4, 32))).astype(np.float32).reshape(16, 128)
    np.testing.assert_array_equal(dequantize(quantize_q8(positive)), positive)
    far = (d * rng.integers(250, 300, size=(16, 4, 32))).astype(np.float32).reshape(16, 128)
    q = quantize_q8(far)
    assert (np.abs(dequantize(q) - far) <= 0.5 * np.repeat(q["scales"], 32, axis=1) * (1 + 1e-5)).all()


def test_degenerate_blocks() -> None:
    w = np.zeros((2, 64), np.float32)
    w[1, 32:] = 3.0
    np.testing.assert_array_equal(dequantize(quantize_q4(w)), w)
    np.testing.assert_array_equal(dequantize(quantize_q8(w)), w)


REFERENCE_QUESTIONS = ["What is the capital of France?", "What is 2+2?", "Write a haiku about the sea.",
                       "Name three primary colors.", "Who wrote Romeo and Juliet?"]


@pytest.fixture(scope="module")
def smollm2_q4(smollm2_store, smollm2_gguf):
    """The packaged model imported as q4 (next to its f32 import)."""
    if not smollm2_store.has(SMOLLM2_Q4):
        import_model(smollm2_gguf, name=SMOLLM2_Q4, weights="q4", store=smollm2_store, progress=False)
    return smollm2_store.model_dir(SMOLLM2_Q4)


@pytest.mark.slow
def test_the_q4_store_answers_like_the_float_store(smollm2_store, smollm2_q4, smollm2_tokenizer) -> None:
    """The q4 store (the file's Q4_1 blocks on the 4-bit grid, its Q8_0 table on the 8-bit one)
    answers the reference questions, under SmolLM2's default system line, word for word as the
    float store does, its logits within 0.02 of the float store's at every step (0.0015
    measured), with its 8-bit lm_head's activations at about 16 bits (``activation_bits`` 16).
    With int8 activations once (8, the default, as llama.cpp's on the same file), it answers the
    first with "L'Étoile, la Marseillaise, …", as llama.cpp does: the float model's first two
    candidate tokens there are 0.08 apart."""
    f32 = chain(smollm2_store.model_dir(SMOLLM2), [(0, 29)], threads=2)
    q4 = chain(smollm2_q4, [(0, 14), (15, 29)], threads=2, activation_bits=16)
    for i, question in enumerate(REFERENCE_QUESTIONS):
        ids = np.array(smollm2_tokenizer.encode_chat([{"role": "user", "content": question}],
                                                     add_generation_prompt=True), np.int64)
        ref_logits, ref_tokens = greedy(f32, f"f{i}", ids, 24)
        logits, tokens = greedy(q4, f"q{i}", ids, 24)
        assert smollm2_tokenizer.decode(tokens) == smollm2_tokenizer.decode(ref_tokens), question
        assert np.abs(logits - ref_logits).max() <= 0.02, question


@pytest.mark.slow
def test_q4_top1_agrees_with_fp32(smollm2_store, smollm2_q4, smollm2_tokenizer) -> None:
    m = smollm2_store.manifest(SMOLLM2_Q4)
    assert m.weight_format == "q4" and m.layer_bytes(0) * 4 < smollm2_store.manifest(SMOLLM2).layer_bytes(0)
    f32 = chain(smollm2_store.model_dir(SMOLLM2), [(0, 29)], threads=2)
    q4 = chain(smollm2_q4, [(0, 14), (15, 29)], threads=2)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    agree = total = 0
    for i, text in enumerate(prompts):
        ids = np.array(smollm2_tokenizer.encode(text), np.int64)
        seq = list(ids)
        logits = chain_forward(f32, f"p{i}", ids)
        for _ in range(100):  # fp32 greedy continuation
            seq.append(int(logits[0, -1].argmax()))
            logits = chain_forward(f32, f"p{i}", np.array(seq[-1:]))
        f32[0].close_session(f"p{i}")
        ql = chain_forward(q4, f"q{i}", np.array(seq[:-1], np.int64))[0]  # teacher-forced in one pass
        for r in q4:
            r.close_session(f"q{i}")
        pred = ql[len(ids) - 1:].argmax(-1)
        agree += int((pred == np.array(seq[len(ids):])).sum())
        total += len(pred)
    assert total == 300
    assert agree / total >= 0.95, agree / total


def test_a_4_bit_lm_head_reads_half_the_bytes_and_picks_the_same_tokens(tmp_path) -> None:
    from shards.errors import ModelFormatError
    from shards.store.tensorfile import read_tensors
    from tests.shards.fragment_helpers import write_tiny_checkpoint

    source = write_tiny_checkpoint(tmp_path / "checkpoint", q4_0_grid=True)  # lm_head: the tied embedding
    store = ModelStore(tmp_path / "home")
    import_model(source, name="lm8", weights="q4", store=store, progress=False)
    import_model(source, name="lm4", weights="q4", store=store, progress=False, lm_head_bits=4)
    import_model(source, name="f32", weights="f32", store=store, progress=False)
    lm4 = read_tensors(store.model_dir("lm4") / "weights" / "head.safetensors")["lm_head.qweight"]
    lm8 = read_tensors(store.model_dir("lm8") / "weights" / "embed.safetensors")["embed.qweight"]  # shared
    assert lm4.shape[-1] == 16 and lm8.shape[-1] == 32 and lm4.nbytes * 2 == lm8.nbytes
    ids = np.array([1, 7, 8, 9, 10], np.int64)
    logits = {n: chain_forward(chain(store.model_dir(n), [(0, 1)], threads=1), "s", ids) for n in ("lm4", "f32")}
    # the lm_head lies on Q4_0 grids, which 4-bit blocks hold exactly: int8 activations are the only error
    assert np.abs(logits["lm4"] - logits["f32"]).max() <= 0.02 * np.abs(logits["f32"]).max()
    assert (logits["lm4"][0].argmax(-1) == logits["f32"][0].argmax(-1)).all()
    for weights, bits in (("f32", 4), ("q4", 6)):
        with pytest.raises(ModelFormatError, match="lm_head_bits must be 8, or 4 with q4 weights"):
            import_model(source, name="bad", weights=weights, store=store, progress=False, lm_head_bits=bits)


def test_a_tied_table_is_stored_once_and_read_by_the_embedding_and_the_output_layer(tmp_path) -> None:
    """A q4 store of a tied model keeps its table once, in 8-bit blocks in the embed file: the
    head file holds the final norm alone; a tail fragment on its own reads the embed file too,
    and the model answers as one fragment does and as the float store does."""
    from shards.store.tensorfile import read_tensors
    from tests.shards.fragment_helpers import write_tiny_checkpoint

    source = write_tiny_checkpoint(tmp_path / "checkpoint", layers=3, q4_0_grid=True)
    store = ModelStore(tmp_path / "home")
    shared = import_model(source, name="shared", weights="q4", store=store, progress=False)
    apart = import_model(source, name="apart", weights="q4", store=store, progress=False, lm_head_bits=4)
    import_model(source, name="f32", weights="f32", store=store, progress=False)
    assert shared.shared_table and not apart.shared_table
    assert set(read_tensors(store.model_dir("shared") / "weights" / "head.safetensors")) == {"norm"}
    assert shared.fragment_files(2, 2) == ["embed", "layer.2", "head"]
    assert shared.fragment_files(1, 1) == ["layer.1"] and apart.fragment_files(2, 2) == ["layer.2", "head"]
    table_bytes = shared.vocab_size * shared.hidden_size  # one byte a weight in 8 bits
    assert shared.embed_bytes >= table_bytes > 2 * shared.head_bytes
    ids = np.array([1, 7, 8, 9, 10], np.int64)
    # 16 bits: the small 4-bit layers on float activations, so the store's error alone is measured
    whole = chain_forward(chain(store.model_dir("shared"), [(0, 2)], threads=1, activation_bits=16), "s", ids)
    split = chain_forward(chain(store.model_dir("shared"), [(0, 0), (1, 1), (2, 2)], threads=1, activation_bits=16),
                          "s", ids)
    float_ = chain_forward(chain(store.model_dir("f32"), [(0, 2)], threads=1), "s", ids)
    np.testing.assert_allclose(split, whole, atol=1e-4)
    # weights on Q4_0 grids: the 4-bit layers are exact, the table's 8-bit blocks all but exact
    assert np.abs(whole - float_).max() <= 0.02 * np.abs(float_).max()
    assert (whole[0].argmax(-1) == float_[0].argmax(-1)).all()
