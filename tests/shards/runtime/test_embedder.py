"""Running an embedding model (shards.runtime.embedder): an Embedder opened on tiny random BERT
encoders imported here (mean pooling and normalised; first-token pooling, not normalised),
giving one float32 vector per text in the order of the texts, whatever the batches and their
padding (more texts than one batch), the same alone or in a crowd, from several threads at
once, and with any thread count; texts read as the model's own tokenizer reads them (its
[CLS] ... [SEP] template, cut at the manifest's max_tokens); and what it refuses.

That the vectors are transformers' / sentence-transformers' own is tested in
tests/shards/importers/test_encoder.py."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shards.errors import ModelFormatError, ModelNotFoundError, RunnerError
from shards.importers.encoder import import_encoder
from shards.runtime.embedder import BATCH_TEXTS, Embedder
from shards.store.model_store import ModelStore
from tests.examples import examples
from tests.shards.importers.test_encoder import SENTENCES, WORDS, write_tiny_encoder

MAX_TOKENS = 16  # write_tiny_encoder's sentence_bert_config.json: [CLS], 14 tokens of text, [SEP]
CLS, SEP, UNK = 2, 3, 1
HIDDEN = 32


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> ModelStore:
    """A store holding "mean" (mean pooling, normalised) and "cls" (first token, not normalised)."""
    root = tmp_path_factory.mktemp("embedder")
    store = ModelStore(root / "home")
    for name, pooling, normalize, seed in (("mean", "mean", True, 0), ("cls", "cls", False, 1)):
        write_tiny_encoder(root / name, pooling=pooling, normalize=normalize, seed=seed)
        import_encoder(root / name, name=name, store=store)
    return store


@pytest.fixture(scope="module")
def mean(store: ModelStore) -> Embedder:
    return Embedder.open("mean", store)


@pytest.fixture(scope="module")
def cls(store: ModelStore) -> Embedder:
    return Embedder.open("cls", store)


def alone(embedder: Embedder, texts: list[str]) -> np.ndarray:
    return np.stack([embedder.embed([text])[0] for text in texts])


def test_an_embedder_opens_by_name_with_the_models_width(store: ModelStore, mean: Embedder) -> None:
    assert mean.dimensions == mean.manifest.hidden_size == HIDDEN
    assert mean.manifest == store.encoder_manifest("mean") and mean.manifest.max_tokens == MAX_TOKENS
    with pytest.raises(ModelNotFoundError, match="no-such-encoder"):
        Embedder.open("no-such-encoder", store)


def test_one_float32_vector_per_text_normalised_where_the_model_says(mean: Embedder, cls: Embedder) -> None:
    for embedder in (mean, cls):
        vectors = embedder.embed(SENTENCES)
        assert vectors.shape == (len(SENTENCES), HIDDEN) and vectors.dtype == np.float32
        assert np.isfinite(vectors).all()
    np.testing.assert_allclose(np.linalg.norm(mean.embed(SENTENCES), axis=1), 1.0, atol=1e-5)
    assert np.abs(np.linalg.norm(cls.embed(SENTENCES), axis=1) - 1.0).max() > 0.1  # its own lengths


def test_texts_past_one_batch_give_what_each_gives_alone(mean: Embedder, cls: Embedder) -> None:
    """Three batches (16, 16, 3), each padded to its own longest text."""
    rng = np.random.default_rng(4)
    texts = [" ".join(rng.choice(WORDS, size=rng.integers(0, 12))) for _ in range(2 * BATCH_TEXTS + 3)]
    for embedder in (mean, cls):
        np.testing.assert_allclose(embedder.embed(texts), alone(embedder, texts), atol=1e-5, rtol=0)


@settings(max_examples=examples(40), deadline=None)
@given(texts=st.lists(st.lists(st.sampled_from(WORDS + ["zebra", "!"]), max_size=20).map(" ".join),
                      min_size=1, max_size=8), data=st.data())
def test_a_texts_vector_does_not_depend_on_the_texts_around_it_nor_their_order(
        mean: Embedder, texts: list[str], data: st.DataObject) -> None:
    vectors = mean.embed(texts)
    np.testing.assert_allclose(vectors, alone(mean, texts), atol=1e-5, rtol=0)
    order = data.draw(st.permutations(range(len(texts))))
    np.testing.assert_allclose(mean.embed([texts[i] for i in order]), vectors[order], atol=1e-5, rtol=0)


def test_the_same_text_twice_gives_the_same_vector_and_different_texts_differ(mean: Embedder) -> None:
    vectors = mean.embed(["the cat sat", "a dog ran in the park", "the cat sat"])
    np.testing.assert_allclose(vectors[0], vectors[2], atol=1e-6, rtol=0)
    assert np.abs(vectors[0] - vectors[1]).max() > 1e-3


def test_a_text_is_read_with_the_models_template_and_cut_at_max_tokens(mean: Embedder) -> None:
    short, long = mean.tokenize(["The cat sat.", "the " * 40])
    assert short.ids[0] == CLS and short.ids[-1] == SEP and len(short.ids) == 6 and not short.overflowing
    assert long.ids == [CLS] + [long.ids[1]] * (MAX_TOKENS - 2) + [SEP] and long.overflowing
    # what is cut off changes nothing: the long text is its first 14 words
    np.testing.assert_allclose(mean.embed(["the " * 40])[0], mean.embed(["the " * (MAX_TOKENS - 2)])[0],
                               atol=1e-6, rtol=0)
    assert np.abs(mean.embed(["the " * 13])[0] - mean.embed(["the " * 14])[0]).max() > 1e-4


def test_words_the_vocabulary_lacks_and_empty_texts_still_embed(mean: Embedder) -> None:
    unknown, empty = mean.tokenize(["xylophone", ""])
    assert unknown.ids == [CLS, UNK, SEP] and empty.ids == [CLS, SEP]
    vectors = mean.embed(["xylophone", ""])
    assert np.isfinite(vectors).all()
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_run_embeds_encodings_made_by_tokenize(mean: Embedder) -> None:
    encodings = mean.tokenize(SENTENCES)
    np.testing.assert_allclose(mean.run(encodings), mean.embed(SENTENCES), atol=1e-6, rtol=0)
    np.testing.assert_allclose(mean.run(encodings[2:3])[0], mean.embed(SENTENCES[2:3])[0], atol=1e-6, rtol=0)


def test_several_threads_embedding_at_once_each_get_their_own_vectors(mean: Embedder) -> None:
    jobs = [SENTENCES[i:] + SENTENCES[:i] for i in range(len(SENTENCES))] * 3
    expected = [mean.embed(texts) for texts in jobs]
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(mean.embed, jobs))
    for mine, theirs in zip(got, expected):
        np.testing.assert_allclose(mine, theirs, atol=1e-5, rtol=0)


def test_the_thread_count_changes_nothing_but_speed(store: ModelStore, mean: Embedder) -> None:
    one = Embedder.open("mean", store, threads=1)
    np.testing.assert_allclose(one.embed(SENTENCES), mean.embed(SENTENCES), atol=1e-5, rtol=0)


@pytest.mark.parametrize("texts", [[], ["fine", 3], [None], [b"bytes"]])
def test_anything_but_a_non_empty_list_of_strings_is_refused(mean: Embedder, texts) -> None:
    with pytest.raises(RunnerError, match="non-empty list of strings"):
        mean.embed(texts)


def test_a_model_whose_tokenizer_cannot_be_loaded_is_refused(store: ModelStore, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(store.models_dir / "mean", broken)
    (broken / "tokenizer.json").write_text(json.dumps({"model": {"type": "no-such-model"}}))
    with pytest.raises(ModelFormatError, match="tokenizer cannot be loaded"):
        Embedder(broken, store.encoder_manifest("mean"))
