"""Description of one stored embedding model (a BERT-family encoder: BERT's own layers, or
nomic-bert's rotary, bias-free, SwiGLU ones): ``encoder.json`` in its model directory, next to
its weights and tokenizer.

An embedding model is small and runs whole on one node: it has no layer files and no plan,
so it has a manifest of its own kind, which the decoder models' listing never sees.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from shards.errors import ModelFormatError
from shards.store.manifest import WeightFile, valid_model_name

ENCODER_FILE = "encoder.json"
POOLINGS = ("mean", "cls")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
ENCODER_ARCHITECTURES = ("bert", "nomic_bert")
ROTARY_ARCHITECTURES = ("nomic_bert",)  # positions by rotation (``rope_theta``), not a table
WEIGHTS_KEY = "weights"


@dataclass(frozen=True)
class EncoderManifest:
    """An embedding model: its shape, how it pools, the most tokens it reads of a text
    (longer ones are cut, as sentence-transformers cuts them) and its one weight file."""

    name: str
    architecture: str
    n_layers: int
    hidden_size: int
    intermediate_size: int
    n_heads: int
    vocab_size: int
    max_positions: int
    max_tokens: int
    layer_norm_eps: float
    pooling: str
    normalize: bool
    files: Mapping[str, WeightFile]
    source_digest: str
    source: str = ""
    rope_theta: float | None = None

    def __post_init__(self) -> None:
        if not valid_model_name(self.name):
            raise ModelFormatError(f"encoder manifest: bad model name {self.name!r}")
        if self.architecture not in ENCODER_ARCHITECTURES:
            raise ModelFormatError(f"encoder manifest: unknown architecture {self.architecture!r}")
        for field in ("n_layers", "hidden_size", "intermediate_size", "n_heads", "vocab_size", "max_positions",
                      "max_tokens"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelFormatError(f"encoder manifest: {field} must be a positive integer, got {value!r}")
        if self.max_tokens > self.max_positions:
            raise ModelFormatError("encoder manifest: max_tokens exceeds the model's positions")
        if self.pooling not in POOLINGS or not isinstance(self.normalize, bool):
            raise ModelFormatError(f"encoder manifest: pooling must be one of {POOLINGS}, normalize a boolean")
        if not isinstance(self.layer_norm_eps, (int, float)) or not 0 < self.layer_norm_eps < 1:
            raise ModelFormatError("encoder manifest: layer_norm_eps must be in (0, 1)")
        rotary = self.architecture in ROTARY_ARCHITECTURES
        if rotary != (self.rope_theta is not None) or rotary and not (
                isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise ModelFormatError(f"encoder manifest: rope_theta must be a positive number for "
                                   f"{', '.join(ROTARY_ARCHITECTURES)} and absent otherwise")
        if set(self.files) != {WEIGHTS_KEY} or not isinstance(self.files[WEIGHTS_KEY], WeightFile):
            raise ModelFormatError(f"encoder manifest: files must be {{{WEIGHTS_KEY!r}: a weight file}}")
        if not isinstance(self.source_digest, str) or not _SHA256.match(self.source_digest):
            raise ModelFormatError("encoder manifest: source_digest must be a sha256 hex digest")

    @property
    def weight_bytes(self) -> int:
        return self.files[WEIGHTS_KEY].bytes

    def to_json(self) -> str:
        data = asdict(self)
        data["files"] = {key: asdict(f) for key, f in self.files.items()}
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EncoderManifest:
        try:
            data: dict[str, Any] = json.loads(text)
            data["files"] = {key: WeightFile(**f) for key, f in data["files"].items()}
            return cls(**data)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise ModelFormatError(f"encoder manifest: unreadable ({error})") from None


__all__ = ["ENCODER_ARCHITECTURES", "ENCODER_FILE", "EncoderManifest", "POOLINGS", "ROTARY_ARCHITECTURES",
           "WEIGHTS_KEY"]
