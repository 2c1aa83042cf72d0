"""An embedding model from a GGUF file: sentence-transformers' all-MiniLM-L6-v2 written as
llama.cpp's converter writes a BERT (phantom-space vocabulary, llama.cpp's tensor names,
float16 matrices), imported, tokenised like the folder and embedding like sentence-transformers;
a tiny random nomic-bert written the same way (its tensors named by the gguf package's own map)
embedding like transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shards.errors import UnsupportedArchitectureError
from shards.importers.encoder_gguf import _EMBEDDINGS, _LAYER, PHANTOM_SPACE, import_encoder_gguf, is_encoder_gguf
from shards.runtime.embedder import Embedder
from shards.store.model_store import ModelStore
from shards.store.tensorfile import read_tensors
from tests.shards.importers.test_encoder import SENTENCES, reference, write_tiny_encoder

TEXTS = [f"{subject} {verb} {place}." for subject in ("The cat", "My neighbour", "A small robot")
         for verb in ("sleeps", "reads a book", "waits for the bus", "sings loudly")
         for place in ("in the kitchen", "near the old station", "under a bright moon")]


def _add_vocabulary(w, folder: Path) -> None:  # noqa: ANN001 - a gguf.GGUFWriter
    """The folder's WordPiece vocabulary as the converter writes it (phantom spaces)."""
    import json

    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]

    def phantom(token: str) -> str:
        if token.startswith("[") and token.endswith("]"):
            return token
        return token[2:] if token.startswith("##") else PHANTOM_SPACE + token

    w.add_tokenizer_model("bert")
    w.add_token_list([phantom(t) for t in tokens])
    w.add_token_types([3 if t.startswith("[") and t.endswith("]") else 1 for t in tokens])
    for add, token in ((w.add_bos_token_id, "[CLS]"), (w.add_sep_token_id, "[SEP]"), (w.add_unk_token_id, "[UNK]"),
                       (w.add_pad_token_id, "[PAD]"), (w.add_mask_token_id, "[MASK]")):
        add(vocab[token])


def _write(w, tensors: dict[str, np.ndarray]) -> None:  # noqa: ANN001 - a gguf.GGUFWriter
    for name, t in tensors.items():  # matrices in float16, as the converter writes them
        w.add_tensor(name, t.astype(np.float16) if t.ndim == 2 and not name.startswith("token_") else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_bert_gguf(folder: Path, path: Path, pooling: int = 1) -> Path:
    """``folder`` (a sentence-transformers BERT) as a GGUF, the way llama.cpp's converter writes one."""
    import json

    import gguf

    config = json.loads((folder / "config.json").read_text())
    tensors = {k.removeprefix("bert."): v for k, v in read_tensors(folder / "model.safetensors").items()}
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_head_count(config["num_attention_heads"])
    w.add_layer_norm_eps(config["layer_norm_eps"])
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType(pooling))
    _add_vocabulary(w, folder)
    names = {hf: gg for gg, hf in _EMBEDDINGS.items()}
    for i in range(config["num_hidden_layers"]):
        for gg, hf in _LAYER.items():
            for kind in ("weight", "bias"):
                names[f"encoder.layer.{i}.{hf}.{kind}"] = f"blk.{i}.{gg}.{kind}"
    _write(w, {gg: tensors[hf] for hf, gg in names.items()})
    return path


def write_nomic_gguf(folder: Path, path: Path) -> Path:
    """``folder`` (a nomic-bert saved with nomic-ai's names) as a GGUF, its tensors named by the
    gguf package's map, as llama.cpp's converter names them."""
    import json

    import gguf

    config = json.loads((folder / "config.json").read_text())
    layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.NOMIC_BERT, layers)
    w = gguf.GGUFWriter(str(path), "nomic-bert")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_block_count(layers)
    w.add_head_count(config["num_attention_heads"])
    w.add_layer_norm_eps(config["layer_norm_eps"])
    w.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.MEAN)
    _add_vocabulary(w, folder)
    tensors = {}
    for key, value in read_tensors(folder / "model.safetensors").items():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        tensors[name] = value
    _write(w, tensors)
    return path


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_all_minilm_from_gguf_matches_sentence_transformers(minilm_folder, tmp_path):
    from sentence_transformers import SentenceTransformer
    from tokenizers import Tokenizer

    path = write_bert_gguf(minilm_folder, tmp_path / "all-minilm.gguf")
    assert is_encoder_gguf(path) and not is_encoder_gguf(minilm_folder)
    store = ModelStore(tmp_path / "home")
    manifest = import_encoder_gguf(path, name="all-minilm", store=store)
    assert (manifest.pooling, manifest.normalize, manifest.hidden_size, manifest.max_tokens) == ("mean", True, 384, 512)
    # the vocabulary read back tokenises as the folder's own tokenizer
    ours, theirs = (Tokenizer.from_file(str(d / "tokenizer.json")) for d in (store.models_dir / "all-minilm",
                                                                              minilm_folder))
    theirs.no_padding()  # (the folder's pads to 128; the embedder reads without padding)
    for text in [*TEXTS, "Héllo, WORLD! naïve café 東京 unbelievably-long-compound [MASK] words"]:
        assert ours.encode(text).ids == theirs.encode(text).ids, text
    vectors = Embedder.open("all-minilm", store).embed(TEXTS)
    reference = SentenceTransformer(str(minilm_folder), device="cpu").encode(TEXTS, convert_to_numpy=True)
    assert vectors.shape == (36, 384) and cosines(vectors, reference).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_pooling_a_gguf_names_that_ncm_cannot_do_is_refused(minilm_folder, tmp_path):
    path = write_bert_gguf(minilm_folder, tmp_path / "last.gguf", pooling=3)
    with pytest.raises(UnsupportedArchitectureError, match="pools by the mean or the first token"):
        import_encoder_gguf(path, name="last", store=ModelStore(tmp_path / "home"))


def test_a_nomic_bert_from_gguf_matches_transformers(tmp_path):
    folder = tmp_path / "tiny-nomic"
    write_tiny_encoder(folder, kind="nomic_bert")
    path = write_nomic_gguf(folder, tmp_path / "tiny-nomic.gguf")
    assert is_encoder_gguf(path)
    store = ModelStore(tmp_path / "home")
    manifest = import_encoder_gguf(path, name="tiny-nomic", store=store)
    assert (manifest.architecture, manifest.rope_theta, manifest.pooling, manifest.normalize) == (
        "nomic_bert", 500.0, "mean", True)
    vectors = Embedder.open("tiny-nomic", store).embed(SENTENCES)
    assert cosines(vectors, reference(folder, SENTENCES, pooling="mean", normalize=True)).min() >= 0.999
