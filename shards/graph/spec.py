"""What a fragment is: its layer range, flavour and fixed shapes, and the names of its files."""

from __future__ import annotations

from dataclasses import dataclass

from shards.errors import FragmentError
from shards.providers.backends import FLAVOURS
from shards.store.manifest import Manifest

FUSED_FLAVOURS = ("cpu", "gpu")  # GroupQueryAttention, the KV pool, batches of rows
IR_VERSION = 8  # of every fragment written (onnx.ModelProto.ir_version)
ONNX_FILE = "fragment.onnx"
FINAL_HIDDEN = "final_hidden"  # a tail's last output: the final norm's hidden states (the rows its logits are of)


@dataclass(frozen=True)
class FragmentSpec:
    """What a fragment is: layer range, flavour and fixed shapes (validated)."""

    first_layer: int
    last_layer: int
    flavour: str
    max_context: int
    prefill_chunk: int  # 0 for dynamic flavours

    def __post_init__(self) -> None:
        if self.flavour not in FLAVOURS:
            raise FragmentError(f"unknown flavour {self.flavour!r} (known: {', '.join(FLAVOURS)})")
        if not 0 <= self.first_layer <= self.last_layer:
            raise FragmentError(f"bad layer range {self.first_layer}..{self.last_layer}")
        if self.max_context <= 0 or self.prefill_chunk < 0:
            raise FragmentError("max_context must be positive and prefill_chunk not negative")
        if self.flavour == "static" and not 0 < self.prefill_chunk <= self.max_context:
            raise FragmentError("the static flavour needs 0 < prefill_chunk <= max_context")

    def validate(self, m: Manifest) -> None:
        """Checks that need the model: the range and the context length."""
        if not (0 <= self.first_layer <= self.last_layer < m.n_layers):
            raise FragmentError(f"bad layer range {self.first_layer}..{self.last_layer} "
                                f"for a model with {m.n_layers} layers")
        if self.max_context > m.context_length:
            raise FragmentError(f"max_context {self.max_context} must be in 1..{m.context_length}")
