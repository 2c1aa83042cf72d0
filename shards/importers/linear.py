"""Which of a layer's tensors are linear weights: the ones block formats quantise."""

from __future__ import annotations

import re

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_LINEAR = re.compile(r"(?:experts\.\d+|shared_expert)\.(gate_proj|up_proj|down_proj)")


def is_linear(name: str) -> bool:
    """A layer tensor that is a linear weight (quantised in block formats): a projection, an
    expert's or the shared expert's."""
    return name in LINEAR or EXPERT_LINEAR.fullmatch(name) is not None


__all__ = ["LINEAR", "EXPERT_LINEAR", "is_linear"]
