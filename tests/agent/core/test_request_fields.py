"""The table of what ncm does with each request field: every field is honoured, refused by
name, or documented as having no effect; unknown fields are refused."""

import pytest

from agent.core.errors import InvalidRequestError
from agent.core.request_fields import (
    HONOURED,
    NO_EFFECT,
    OLLAMA_CHAT,
    OLLAMA_GENERATE,
    OLLAMA_OPTIONS,
    OPENAI_CHAT,
    OPENAI_COMPLETION,
    REFUSED,
    TABLES,
    check_fields,
    integer,
)

# The fields the two APIs publish (OpenAI's chat and legacy completions references, Ollama's
# api.md with the options of its Modelfile and runner), as of late 2026.
PUBLISHED = {
    "/v1/chat/completions": {
        "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
        "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
        "presence_penalty", "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier", "seed",
        "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
        "top_logprobs", "top_p", "user", "verbosity", "web_search_options"},
    "/v1/completions": {
        "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
        "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user"},
    "/api/chat": {"model", "messages", "tools", "format", "options", "stream", "keep_alive", "think"},
    "/api/generate": {"model", "prompt", "suffix", "images", "format", "options", "system", "template", "stream",
                      "raw", "keep_alive", "context", "think"},
    "options": {"num_keep", "seed", "num_predict", "top_k", "top_p", "min_p", "typical_p", "repeat_last_n",
                "temperature", "repeat_penalty", "presence_penalty", "frequency_penalty", "penalize_newline",
                "stop", "numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "use_mmap", "num_thread",
                "mirostat", "mirostat_tau", "mirostat_eta", "tfs_z", "low_vram", "vocab_only", "use_mlock",
                "f16_kv", "logits_all", "embedding_only"},
}


@pytest.mark.parametrize("endpoint", sorted(PUBLISHED))
def test_every_published_field_has_a_handling(endpoint):
    table = TABLES[endpoint]
    assert PUBLISHED[endpoint] <= set(table), PUBLISHED[endpoint] - set(table)
    for field in table.values():
        assert field.handling in (HONOURED, NO_EFFECT, REFUSED) and field.what


@pytest.mark.parametrize("endpoint", sorted(PUBLISHED))
def test_a_refused_field_is_named_unless_neutral(endpoint):
    table = TABLES[endpoint]
    for name, field in table.items():
        if field.handling != REFUSED:
            check_fields({name: "anything"}, table)
            continue
        for neutral in field.neutral:
            check_fields({name: neutral}, table)
        with pytest.raises(InvalidRequestError) as caught:
            check_fields({name: {"not": "neutral"}}, table, where="options." if endpoint == "options" else "")
        assert caught.value.param.endswith(name) and caught.value.status == 400


def test_unknown_fields_are_refused_by_name_and_internal_ones_pass():
    with pytest.raises(InvalidRequestError, match="unknown field 'colour'"):
        check_fields({"model": "m", "colour": "red"}, OPENAI_CHAT)
    check_fields({"ncm_resume": {}}, OPENAI_CHAT, internal=("ncm_resume",))
    with pytest.raises(InvalidRequestError, match="'options.mirostat'"):
        check_fields({"mirostat": 2}, OLLAMA_OPTIONS, where="options.")


def test_a_boolean_is_not_a_neutral_number():
    with pytest.raises(InvalidRequestError):
        check_fields({"n": True}, OPENAI_COMPLETION)
    check_fields({"mirostat": 0.0, "typical_p": 1}, OLLAMA_OPTIONS)


def test_integer_takes_integral_floats_only():
    assert integer(8192.0) == 8192 and integer(3) == 3
    assert integer(8192.5) is None and integer(True) is None and integer("8") is None


def test_tables_share_their_common_fields():
    for name in ("model", "stream", "format", "options", "keep_alive"):
        assert OLLAMA_CHAT[name] == OLLAMA_GENERATE[name]
    for name in ("temperature", "seed", "logit_bias", "frequency_penalty"):
        assert OPENAI_CHAT[name] == OPENAI_COMPLETION[name]


def test_the_api_docs_print_the_tables():
    from pathlib import Path

    from agent.core.request_fields import markdown_tables

    docs = (Path(__file__).parents[3] / "docs" / "api.md").read_text()
    assert markdown_tables() in docs
