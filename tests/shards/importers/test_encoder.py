"""Embedding models: a BERT-family encoder imported from a Hugging Face folder runs as one
ONNX graph with its pooling and gives transformers' / sentence-transformers' embeddings
(tiny random checkpoints made here: BERT with mean and first-token pooling, nomic-bert saved
with nomic-ai's own tensor names; and the real all-MiniLM-L6-v2 against sentence-transformers
itself), a batch equal to its texts one by one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shards.errors import ModelFormatError, UnsupportedArchitectureError
from shards.importers.encoder import import_encoder, is_encoder_folder
from shards.runtime.embedder import Embedder
from shards.store.model_store import ModelStore

pytestmark = pytest.mark.slow  # transformers and sentence-transformers are the references
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "in", "park", "paris", "is", "capital", "of", "france",
         "house", "light", "kitchen", "turn", "off", "##s", "##ing", "."]
SENTENCES = ["the cat sat on the mat .", "a dog ran in the park", "paris is the capital of france",
             "turn off the kitchen lights", "the dog", "cats sitting on a house"]


def write_tiny_encoder(folder: Path, *, kind: str = "bert", pooling: str = "mean", normalize: bool = True,
                       seed: int = 0) -> None:
    """A random BertModel or NomicBertModel (hidden 32, 2 layers) with a WordPiece
    tokenizer.json and the sentence-transformers modules of ``pooling`` (and Normalize)."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, NomicBertConfig, NomicBertModel

    vocab = {token: i for i, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    torch.manual_seed(seed)
    shape = {"vocab_size": len(vocab), "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 64, "max_position_embeddings": 64}
    if kind == "bert":
        model = BertModel(BertConfig(**shape))
    else:  # saved with nomic-ai's names (attn.Wqkv, mlp.fc11...), as its checkpoints are
        model = NomicBertModel(NomicBertConfig(**shape, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                                              initializer_range=0.3))  # sharp attention: positions show
        with torch.no_grad():  # LayerNorms away from 1 and 0, so that a misplaced one shows
            for name, param in model.named_parameters():
                if "LayerNorm" in name or "layernorm" in name:
                    param.add_(torch.randn_like(param) * 0.1)
    model.eval().save_pretrained(folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_cls_token": pooling == "cls"}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16}))


def reference(folder: Path, texts: list[str], *, pooling: str, normalize: bool) -> np.ndarray:
    """transformers' model of the folder, pooled and normalised by hand the way
    sentence-transformers does."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModel

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_truncation(16)
    model = AutoModel.from_pretrained(folder).eval()
    out = []
    for text in texts:
        ids = torch.tensor([tokenizer.encode(text).ids])
        with torch.no_grad():
            states = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
        vector = states.mean(0) if pooling == "mean" else states[0]
        out.append((vector / vector.norm() if normalize else vector).numpy())
    return np.stack(out)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("kind, pooling, normalize", [("bert", "mean", True), ("bert", "cls", False),
                                                      ("nomic_bert", "mean", True)])
def test_a_tiny_random_encoder_matches_transformers(tmp_path, kind, pooling, normalize):
    folder = tmp_path / "tiny"
    write_tiny_encoder(folder, kind=kind, pooling=pooling, normalize=normalize)
    assert is_encoder_folder(folder)
    store = ModelStore(tmp_path / "home")
    manifest = import_encoder(folder, name="tiny", store=store)
    assert (manifest.architecture, manifest.pooling, manifest.normalize, manifest.max_tokens) == (
        kind, pooling, normalize, 16)
    assert manifest.rope_theta == (500.0 if kind == "nomic_bert" else None)
    assert store.encoders() == ["tiny"] and store.list() == []  # not a chat model
    embedder = Embedder.open("tiny", store)
    texts = SENTENCES + ["the " * 40]  # the last is cut at 16 tokens, as sentence-transformers cuts it
    ours = embedder.embed(texts)
    assert cosines(ours, reference(folder, texts, pooling=pooling, normalize=normalize)).min() >= 0.9999
    one_by_one = np.stack([embedder.embed([text])[0] for text in texts])
    np.testing.assert_allclose(ours, one_by_one, atol=1e-5)


def test_pooling_that_ncm_cannot_do_is_refused(tmp_path):
    folder = tmp_path / "tiny-bert"
    write_tiny_encoder(folder)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(UnsupportedArchitectureError, match="pool"):
        import_encoder(folder, name="tiny-bert", store=ModelStore(tmp_path / "home"))
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelFormatError):
        import_encoder(folder, name="tiny-bert", store=ModelStore(tmp_path / "home"))


def test_a_nomic_bert_ncm_cannot_run_is_refused_by_its_setting(tmp_path):
    folder = tmp_path / "tiny-nomic"
    write_tiny_encoder(folder, kind="nomic_bert")
    config = json.loads((folder / "config.json").read_text())
    for setting, value in (("rotary_emb_fraction", 0.5), ("prenorm", True), ("hidden_act", "gelu")):
        (folder / "config.json").write_text(json.dumps({**config, setting: value}))
        with pytest.raises(UnsupportedArchitectureError):
            import_encoder(folder, name="tiny-nomic", store=ModelStore(tmp_path / "home"))


def test_all_minilm_matches_sentence_transformers(minilm_folder, tmp_path):
    from sentence_transformers import SentenceTransformer

    store = ModelStore(tmp_path / "home")
    import_encoder(minilm_folder, name="all-minilm-l6-v2", store=store)
    texts = [f"{subject} {verb} {place}." for subject in ("The cat", "My neighbour", "A small robot")
             for verb in ("sleeps", "reads a book", "waits for the bus", "sings loudly")
             for place in ("in the kitchen", "near the old station", "under a bright moon")]
    assert len(texts) == 36
    ours = Embedder.open("all-minilm-l6-v2", store).embed(texts)
    theirs = SentenceTransformer(str(minilm_folder), device="cpu").encode(texts, convert_to_numpy=True)
    assert ours.shape == (36, 384) and cosines(ours, theirs).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)  # its Normalize module
