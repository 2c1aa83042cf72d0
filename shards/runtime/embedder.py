"""Running an embedding model: texts in, one vector per text out.

:class:`Embedder` opens a stored encoder (:mod:`shards.store.encoder_manifest`) as one
onnxruntime session of its whole graph (:mod:`shards.graph.encoder_graph`), tokenizes with
the model's own ``tokenizer.json`` (its ``[CLS] ... [SEP]`` template), cuts each text at the
manifest's ``max_tokens`` as sentence-transformers does, and runs texts in batches padded to
their longest.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shards.errors import ModelFormatError, RunnerError
from shards.graph.encoder_graph import EncoderShape, encoder_graph
from shards.store.encoder_manifest import EncoderManifest
from shards.store.model_store import ModelStore
from shards.store.tensorfile import read_tensors

BATCH_TEXTS = 16


class Embedder:
    """One embedding model, open. ``embed`` is thread-safe (onnxruntime's ``run``)."""

    def __init__(self, model_dir: Path, manifest: EncoderManifest, *, threads: int | None = None) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self.manifest = manifest
        weights = read_tensors(Path(model_dir) / manifest.files["weights"].path)
        graph = encoder_graph(weights, EncoderShape.of(manifest)).SerializeToString()
        del weights
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self._session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
        try:
            self._tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        except Exception as error:  # the tokenizers library raises its own exception type
            raise ModelFormatError(f"the embedding model's tokenizer cannot be loaded: {error}") from None
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(manifest.max_tokens)

    @classmethod
    def open(cls, name: str, store: ModelStore, **kw: object) -> Embedder:
        return cls(store.models_dir / name, store.encoder_manifest(name), **kw)  # type: ignore[arg-type]

    @property
    def dimensions(self) -> int:
        return self.manifest.hidden_size

    def tokenize(self, texts: Sequence[str]) -> list[Any]:
        """Each text as the model reads it (a ``tokenizers`` encoding: ``ids``, and
        ``overflowing`` not empty when the text was cut)."""
        if not texts or not all(isinstance(t, str) for t in texts):
            raise RunnerError("embed() takes a non-empty list of strings")
        return self._tokenizer.encode_batch(list(texts))

    def run(self, encodings: Sequence[Any]) -> np.ndarray:
        """``[len(encodings), dimensions]`` float32: one embedding per encoding, in order."""
        out = np.empty((len(encodings), self.dimensions), dtype=np.float32)
        for start in range(0, len(encodings), BATCH_TEXTS):
            batch = encodings[start:start + BATCH_TEXTS]
            longest = max(len(e.ids) for e in batch)
            ids = np.zeros((len(batch), longest), dtype=np.int64)
            mask = np.zeros_like(ids)
            for row, encoding in enumerate(batch):
                ids[row, :len(encoding.ids)] = encoding.ids
                mask[row, :len(encoding.ids)] = 1
            out[start:start + len(batch)] = self._session.run(["embeddings"], {"input_ids": ids, "attention_mask": mask})[0]
        return out

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """``[len(texts), dimensions]`` float32: one embedding per text, in order."""
        return self.run(self.tokenize(texts))


__all__ = ["BATCH_TEXTS", "Embedder"]
