"""Fused matrices split into the ones ncm stores: Phi-3's query/key/value projection
(``qkv_proj``, GGUF ``attn_qkv``) and its gate/up one (``gate_up_proj``, GGUF ``ffn_up``,
gate first), for the Hugging Face and the GGUF import alike."""

from __future__ import annotations

from typing import Any

import numpy as np

SPLITS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def split_fused(params: dict[str, Any], name: str, matrix: np.ndarray) -> dict[str, np.ndarray]:
    """The matrices fused in ``matrix`` (rows [out, in]) under their own names."""
    if name == "qkv_proj":
        kv = params["n_kv_heads"] * params["head_dim"]
        rows = (params["n_heads"] * params["head_dim"], kv, kv)
    else:
        rows = (params["intermediate_size"],) * 2
    return dict(zip(SPLITS[name], np.split(matrix, np.cumsum(rows)[:-1])))


__all__ = ["SPLITS", "split_fused"]
