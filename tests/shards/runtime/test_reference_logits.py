"""Independent reference: Hugging Face transformers loading the SAME GGUF (dequantised, fp32)."""

from __future__ import annotations

import numpy as np
import pytest

from shards.errors import RunnerError
from shards.runtime.chain import chain_forward
from tests.shards.fragment_helpers import SMOLLM2, chain, greedy

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")]
PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Water boils at a temperature of",
           "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def runners(smollm2_store):
    return chain(smollm2_store.model_dir(SMOLLM2), [(0, 14), (15, 29)], threads=2)


@pytest.mark.parametrize("text", PROMPTS)
def test_prefill_logits_match_transformers(hf_model, runners, smollm2_tokenizer, text) -> None:
    import torch

    ids = np.array(smollm2_tokenizer.encode(text), np.int64)
    with torch.no_grad():
        ref = hf_model(torch.from_numpy(ids[None, :])).logits[0].numpy()
    ours = chain_forward(runners, "ref", ids)[0]
    for r in runners:
        r.close_session("ref")
    assert np.abs(ours - ref).max() <= 1e-3


def test_32_greedy_tokens_match_transformers(hf_model, runners, smollm2_tokenizer) -> None:
    import torch

    ids = np.array(smollm2_tokenizer.encode(PROMPTS[0]), np.int64)
    ref_tokens: list[int] = []
    with torch.no_grad():  # plain greedy loop with transformers' own KV cache (no EOS stop)
        out = hf_model(torch.from_numpy(ids[None, :]), use_cache=True)
        for _ in range(32):
            ref_tokens.append(int(out.logits[0, -1].argmax()))
            out = hf_model(torch.tensor([[ref_tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    _, tokens = greedy(runners, "greedy", ids, 32)
    assert tokens == ref_tokens
    assert "Paris" in smollm2_tokenizer.decode(tokens)


@pytest.mark.parametrize("flavour", ["cpu", "portable", "static"])
def test_a_tails_final_hidden_states_match_transformers(hf_model, smollm2_store, smollm2_tokenizer, flavour) -> None:
    """What an embedding of a prompt reads: the final norm's hidden states, every row or the
    last alone, in each flavour's own path through the runner (pooled rows, plain, chunks)."""
    import torch

    ids = np.array(smollm2_tokenizer.encode(PROMPTS[1]), np.int64)
    with torch.no_grad():
        ref = hf_model(torch.from_numpy(ids[None, :]), output_hidden_states=True).hidden_states[-1][0].numpy()
    runners = chain(smollm2_store.model_dir(SMOLLM2), [(0, 14), (15, 29)], threads=2, flavour=flavour)
    for last_only in (False, True):
        for r in runners:
            r.open_session("hidden")
        h = runners[0].forward("hidden", ids[None, :])
        ours = runners[1].forward("hidden", h, last_only=last_only, hidden=True)[0]
        for r in runners:
            r.close_session("hidden")
        assert ours.shape == (1 if last_only else len(ids), 576)
        assert np.abs(ours - ref[-len(ours):]).max() <= 1e-3
    with pytest.raises(RunnerError, match="no tail"):
        runners[0].forward("absent", ids[None, :], hidden=True)
