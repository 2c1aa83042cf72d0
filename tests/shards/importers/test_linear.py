"""Which layer tensors are linear weights (the ones block formats quantise)."""

from __future__ import annotations

import pytest

from shards.importers.linear import is_linear


@pytest.mark.parametrize("name", ["q_proj", "down_proj", "experts.0.gate_proj", "experts.63.down_proj",
                                  "shared_expert.up_proj"])
def test_projections_and_experts_are_linear(name: str) -> None:
    assert is_linear(name)


@pytest.mark.parametrize("name", ["input_norm", "q_bias", "router", "shared_expert_gate", "experts.0.router",
                                  "experts.x.gate_proj", "lm_head", "embed"])
def test_norms_biases_routers_and_tables_are_not(name: str) -> None:
    assert not is_linear(name)
