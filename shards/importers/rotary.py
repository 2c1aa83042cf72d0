"""A rotary over part of each head (Phi-4-mini's ``partial_rotary_factor``, a GGUF's
``rope.dimension_count`` below the head's width), read the same way by both importers."""

from __future__ import annotations

from typing import Any

from shards.errors import UnsupportedArchitectureError

PARTIAL_ROTARY_ARCHITECTURES = ("phi3",)  # whose maths rotates the first dims and passes the rest
ROTARY_DIM_MULTIPLE = 16  # onnxruntime's fused attention rotates a multiple of 16 dims


def rotary_params(source: str, architecture: str, rotary_dim: int, head_dim: int) -> dict[str, Any]:
    """The manifest's ``rotary_dim`` for ``rotary_dim`` of ``head_dim`` dims rotated (nothing
    when the whole head rotates); UnsupportedArchitectureError, in one line, for a partial rotary
    ncm does not run."""
    if rotary_dim == head_dim:
        return {}
    if architecture not in PARTIAL_ROTARY_ARCHITECTURES:
        raise UnsupportedArchitectureError(f"{source}: a rotary over part of each head ({rotary_dim} of "
                                           f"{head_dim} dims) is not supported for {architecture}")
    if not 0 < rotary_dim < head_dim or rotary_dim % ROTARY_DIM_MULTIPLE:
        raise UnsupportedArchitectureError(f"{source}: a rotary over {rotary_dim} of {head_dim} dims is not supported "
                                           f"(ncm rotates a multiple of {ROTARY_DIM_MULTIPLE})")
    return {"rotary_dim": rotary_dim}


__all__ = ["PARTIAL_ROTARY_ARCHITECTURES", "ROTARY_DIM_MULTIPLE", "rotary_params"]
