"""A tiny random Llama (hidden 64, a word-level tokenizer) written and imported like any
Hugging Face checkpoint, and a cluster of in-process agents serving it: it loads and answers in
well under a second, so the API, router and admission tests run on the real path in seconds.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from agent.service_keys import MEMBERSHIP, ROUTER
from shards.importer import import_model
from shards.store import ModelStore
from shards.tensorfile import write_tensors
from tests.agent.inprocess import LocalAgent, eventually, local_agents
from tests.shards.fragment_helpers import write_word_tokenizer

TINY = "tiny"
VOCAB = 96
# Turns as words of the vocabulary: w3 opens a system turn, w4 a user one, w5 an assistant one.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ {'system': 'w3', 'user': 'w4'}.get(m['role'], 'w5') }} "
                 "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w5 {% endif %}")


def write_tiny_checkpoint(folder: Path, *, seed: int = 0, layers: int = 2) -> Path:
    """A random llama checkpoint (config.json, model.safetensors, a word-level tokenizer)."""
    rng = np.random.default_rng(seed)
    hidden, inter, heads, kv_heads = 64, 160, 4, 2
    head_dim = hidden // heads

    def weight(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.15, shape).astype(np.float32)

    tensors = {"model.embed_tokens.weight": weight(VOCAB, hidden), "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        prefix = f"model.layers.{i}."
        tensors.update({
            prefix + "input_layernorm.weight": np.ones(hidden, np.float32),
            prefix + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
            prefix + "self_attn.q_proj.weight": weight(heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
            prefix + "mlp.gate_proj.weight": weight(inter, hidden),
            prefix + "mlp.up_proj.weight": weight(inter, hidden),
            prefix + "mlp.down_proj.weight": weight(hidden, inter),
        })
    folder.mkdir(parents=True, exist_ok=True)
    write_tensors(folder / "model.safetensors", tensors)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": VOCAB,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2}))
    write_word_tokenizer(folder, VOCAB)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def store_tiny_models(tmp: Path, names: tuple[str, ...] = (TINY,), *, layers: int = 2) -> ModelStore:
    """The store of the first in-process agent, holding the tiny model under every name."""
    source = write_tiny_checkpoint(tmp / "checkpoint", layers=layers)
    store = ModelStore(tmp / "home-0")
    for name in names:
        import_model(source, name=name, store=store, progress=False)
    return store


@contextlib.asynccontextmanager
async def tiny_cluster(tmp: Path, count: int = 2, *, names: tuple[str, ...] = (TINY,), layers: int = 2,
                       **settings: Any) -> AsyncIterator[tuple[LocalAgent, list[LocalAgent]]]:
    """``count`` in-process agents, the first storing the tiny models; yields the orchestrator
    (once the main model is ready) and the others."""
    store_tiny_models(tmp, names, layers=layers)
    async with local_agents(tmp, count, model=TINY, **settings) as agents:
        await eventually(lambda: all(a.app[MEMBERSHIP].election for a in agents), timeout_s=20, what="an election")
        leader = agents[0].app[MEMBERSHIP].election.orchestrator
        orchestrator = next(a for a in agents if a.node_id == leader)
        router = orchestrator.app[ROUTER]
        await eventually(lambda: TINY in router.registry.entries and router.registry.entries[TINY].state == "ready",
                         timeout_s=60, what="the tiny model loaded at start")
        yield orchestrator, [a for a in agents if a is not orchestrator]
