"""What ncm does with each field of the two APIs it speaks: one table, so that no field is
ever silently ignored (docs/api.md prints it).

Every field a request may carry is listed with what happens to it: ``HONOURED`` (it does what
the API says), ``NO_EFFECT`` (it changes nothing an answer holds, by its nature: an end-user
id, a machine-tuning option of a one-box server) or ``REFUSED`` unless it holds the value that
changes nothing (``neutral``). A field in no table is refused by name: an app that sends a
field ncm does not know learns it at once.

Pure: :func:`check_fields` raises :class:`InvalidRequestError` naming the first field refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.core.errors import InvalidRequestError

HONOURED, NO_EFFECT, REFUSED = "honoured", "no effect", "refused"


@dataclass(frozen=True)
class Field:
    """One request field: what ncm does with it and, when it is refused, the values accepted
    anyway because they leave the answer as it would be without them."""

    name: str
    handling: str
    what: str
    neutral: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if self.handling not in (HONOURED, NO_EFFECT, REFUSED):
            raise ValueError(f"unknown handling {self.handling!r}")

    def accepts(self, value: Any) -> bool:
        if self.handling != REFUSED or value is None:
            return True
        return any(isinstance(value, bool) == isinstance(neutral, bool) and value == neutral
                   for neutral in self.neutral)


def _table(*fields: Field) -> dict[str, Field]:
    return {f.name: f for f in fields}


_SAMPLING_OPENAI = (
    Field("model", HONOURED, "the model or alias (a name /v1/models or /api/tags lists; default: the main model)"),
    Field("max_tokens", HONOURED, "most tokens to generate (default: the agent's default_max_tokens, 2048)"),
    Field("temperature", HONOURED, "sampling temperature, 0-2 (0: greedy)"),
    Field("top_p", HONOURED, "nucleus sampling"),
    Field("top_k", HONOURED, "keep the k likeliest tokens (llama.cpp's extension; 0: off)"),
    Field("min_p", HONOURED, "drop tokens below this share of the likeliest one's probability (llama.cpp's extension)"),
    Field("seed", HONOURED, "a seeded request gives the same answer again on the same route"),
    Field("stop", HONOURED, "up to 4 stop strings, never part of the answer"),
    Field("stream", HONOURED, "Server-Sent Events"),
    Field("stream_options", HONOURED, "include_usage: a last chunk with the token counts"),
    Field("frequency_penalty", HONOURED, "lowers a token's logit per time it appears in the last repeat_last_n tokens"),
    Field("presence_penalty", HONOURED, "lowers the logit of a token present in the last repeat_last_n tokens"),
    Field("repeat_penalty", HONOURED, "divides the logits of recent tokens (llama.cpp's extension; 1: off)"),
    Field("repeat_last_n", HONOURED, "the window of the three penalties (llama.cpp's extension; default 64, -1: all)"),
    Field("logit_bias", HONOURED, "adds to the logits of the token ids named (-100 bans one)"),
    Field("cache_prompt", HONOURED, "false: read the whole prompt, and keep nothing for the next request (llama.cpp's "
                                    "extension; default true: start from the KV cache of one that began the same way)"),
    Field("speculative.n_max", HONOURED, "most tokens a step drafts from the context and verifies in one trip "
                                         "(llama.cpp's extension; 0-16, 0: no speculative decoding; default: the "
                                         "agent's draft_tokens, 8); the answer is the same either way"),
    Field("speculative.p_min", HONOURED, "a draft model's token less likely than this ends its draft (llama.cpp's "
                                         "extension; 0-1, default 0.2; drafts from the context have no "
                                         "probabilities); the answer is the same either way"),
    Field("n", REFUSED, "one choice per request", (1,)),
    Field("user", NO_EFFECT, "an end-user id for the app's own records"),
)
OPENAI_CHAT = _table(
    *_SAMPLING_OPENAI,
    Field("messages", HONOURED, "system/developer, user, assistant (with tool_calls) and tool turns; text content"),
    Field("max_completion_tokens", HONOURED, "the same as max_tokens"),
    Field("tools", HONOURED, "functions the model may call (rendered by the model's chat template)"),
    Field("tool_choice", HONOURED, "auto, none, required or a named function (forced by constrained decoding)"),
    Field("parallel_tool_calls", HONOURED, "false: at most one call per answer; unset: several where the tool "
                                          "format writes several (hermes, mistral), one in the generic and Llama 3 "
                                          "formats, as llama.cpp's server follows the template"),
    Field("response_format", HONOURED, "text, json_object or json_schema (constrained decoding: the output parses)"),
    Field("logprobs", HONOURED, "each token's log-probability under the model (choices[].logprobs.content)"),
    Field("top_logprobs", HONOURED, "with logprobs: that many likeliest alternatives per token (0-20)"),
    Field("reasoning_effort", HONOURED, "none turns thinking off, the others on (and reach a template that reads "
                                        "them); a model that cannot think refuses all but none"),
    Field("chat_template_kwargs", HONOURED, "more variables of the chat template (llama.cpp's extension); "
                                            "enable_thinking is thinking on or off"),
    Field("modalities", REFUSED, "text models only", (["text"],)),
    Field("audio", REFUSED, "text models only"),
    Field("prediction", REFUSED, "predicted outputs are not supported"),
    Field("web_search_options", REFUSED, "ncm does not search the web"),
    Field("functions", REFUSED, "deprecated by OpenAI: send tools"),
    Field("function_call", REFUSED, "deprecated by OpenAI: send tool_choice"),
    Field("store", REFUSED, "ncm stores no completions", (False,)),
    Field("metadata", NO_EFFECT, "tags for stored completions; ncm stores none"),
    Field("service_tier", REFUSED, "one tier", ("auto", "default")),
    Field("verbosity", REFUSED, "not a parameter of these models", ("medium",)),
    Field("prompt_cache_key", NO_EFFECT, "a caching hint; ncm's cache needs no key"),
    Field("safety_identifier", NO_EFFECT, "an end-user id for the app's own records"),
)
OPENAI_COMPLETION = _table(
    *_SAMPLING_OPENAI,
    Field("prompt", HONOURED, "the text to continue (one string)"),
    Field("logprobs", HONOURED, "each token's log-probability and that many likeliest alternatives (0-5)"),
    Field("echo", REFUSED, "the prompt is not repeated in the answer", (False,)),
    Field("suffix", REFUSED, "insertion is not supported", ("",)),
    Field("best_of", REFUSED, "one choice per request", (1,)),
)
OLLAMA_OPTIONS = _table(
    Field("temperature", HONOURED, "sampling temperature (0: greedy)"),
    Field("top_p", HONOURED, "nucleus sampling"),
    Field("top_k", HONOURED, "keep the k likeliest tokens (0: off)"),
    Field("min_p", HONOURED, "drop tokens below this share of the likeliest one's probability"),
    Field("seed", HONOURED, "a seeded request gives the same answer again on the same route (-1: random)"),
    Field("num_predict", HONOURED, "most tokens to generate (default: default_max_tokens; -1, -2: until the end, "
                                   "the context full)"),
    Field("stop", HONOURED, "stop strings"),
    Field("num_ctx", HONOURED, "narrows the context (capped at what the model was planned for)"),
    Field("repeat_penalty", HONOURED, "divides the logits of recent tokens (1: off)"),
    Field("repeat_last_n", HONOURED, "the window of the penalties (default 64, -1: the whole context, 0: off)"),
    Field("presence_penalty", HONOURED, "lowers the logit of a token present in the window"),
    Field("frequency_penalty", HONOURED, "lowers a token's logit per time it appears in the window"),
    Field("typical_p", REFUSED, "locally typical sampling is not implemented", (1.0,)),
    Field("tfs_z", REFUSED, "tail-free sampling is not implemented", (1.0,)),
    Field("mirostat", REFUSED, "mirostat sampling is not implemented", (0,)),
    Field("mirostat_tau", NO_EFFECT, "used by mirostat only (which is off)"),
    Field("mirostat_eta", NO_EFFECT, "used by mirostat only (which is off)"),
    Field("penalize_newline", NO_EFFECT, "dropped by Ollama too: newlines are penalised like any token"),
    *(Field(name, NO_EFFECT, "tunes how a one-box server runs the model; the cluster's plan decides that")
      for name in ("num_thread", "num_gpu", "main_gpu", "use_mmap", "use_mlock", "low_vram", "num_batch", "numa",
                   "num_keep", "vocab_only", "f16_kv", "logits_all", "embedding_only")),
)
_OLLAMA_COMMON = (
    Field("model", HONOURED, "the model (name or name:latest)"),
    Field("options", HONOURED, "sampling and context options (the table below)"),
    Field("stream", HONOURED, "NDJSON lines (default true)"),
    Field("keep_alive", HONOURED, "how long the model stays loaded after this request (0 with the admin token: unload)"),
    Field("format", HONOURED, "\"json\" or a JSON schema (constrained decoding: the output parses)"),
    Field("think", HONOURED, "true or false: the model thinks or not (\"low\", \"medium\", \"high\": on, the "
                             "level passed to a template that reads it); the reasoning comes apart in thinking; a "
                             "model that cannot think refuses true"),
)
OLLAMA_CHAT = _table(
    *_OLLAMA_COMMON,
    Field("messages", HONOURED, "system, user, assistant (with tool_calls) and tool turns"),
    Field("tools", HONOURED, "functions the model may call; answers carry message.tool_calls"),
)
OLLAMA_GENERATE = _table(
    *_OLLAMA_COMMON,
    Field("prompt", HONOURED, "the prompt (empty: load the model)"),
    Field("system", HONOURED, "a system turn before the prompt"),
    Field("raw", HONOURED, "true: the prompt as it is, without the chat template"),
    Field("images", REFUSED, "text models only", ([],)),
    Field("suffix", REFUSED, "insertion is not supported", ("",)),
    Field("template", REFUSED, "the model's own chat template is used", ("",)),
    Field("context", REFUSED, "send the conversation as messages to /api/chat", ([],)),
)
_DIMENSIONS = Field("dimensions", HONOURED, "accepted when it is the model's own size; other sizes are refused "
                   "(400): these models' vectors cannot be shortened")
OPENAI_EMBEDDINGS = _table(
    Field("model", HONOURED, "an embedding model, or a chat model (its last token's final hidden state, "
                             "normalised; GET /v1/models lists both)"),
    Field("input", HONOURED, "a string or a list of strings (token ids are refused), each cut at what the model reads"),
    Field("encoding_format", HONOURED, "float (default) or base64 (little-endian float32)"),
    _DIMENSIONS,
    Field("user", NO_EFFECT, "an end-user id for the app's own records"),
)
_OLLAMA_EMBED_COMMON = (
    Field("model", HONOURED, "an embedding model or a chat model (name or name:latest)"),
    Field("options", REFUSED, "no option changes an embedding", ({},)),
    Field("keep_alive", HONOURED, "how long the model stays open idle after the request (negative: until asked); "
                                  "0 closes (a chat model: unloads) it now from the admin token, else the idle "
                                  "rule (sleep_idle_s) applies"),
)
OLLAMA_EMBED = _table(
    *_OLLAMA_EMBED_COMMON,
    Field("input", HONOURED, "a string or a list of strings"),
    Field("truncate", HONOURED, "true (default): a text longer than the model reads is cut; false: refused (400)"),
    _DIMENSIONS,
)
OLLAMA_EMBEDDINGS = _table(*_OLLAMA_EMBED_COMMON, Field("prompt", HONOURED, "one string"))
TABLES: Mapping[str, Mapping[str, Field]] = {
    "/v1/chat/completions": OPENAI_CHAT, "/v1/completions": OPENAI_COMPLETION, "/v1/embeddings": OPENAI_EMBEDDINGS,
    "/api/chat": OLLAMA_CHAT, "/api/generate": OLLAMA_GENERATE, "options": OLLAMA_OPTIONS,
    "/api/embed": OLLAMA_EMBED, "/api/embeddings": OLLAMA_EMBEDDINGS,
}


def check_fields(body: Mapping[str, Any], table: Mapping[str, Field], *, where: str = "",
                 internal: Iterable[str] = ()) -> None:
    """Refuse, by name, the first field of ``body`` that ``table`` refuses or does not know
    (``internal``: fields an agent passing a request on adds, believed by the caller)."""
    allowed_extra = set(internal)
    for name, value in body.items():
        param = f"{where}{name}"
        field = table.get(name)
        if field is None:
            if name in allowed_extra:
                continue
            raise InvalidRequestError(f"unknown field '{param}': ncm does not know it (docs/api.md lists every "
                                      "field and what ncm does with it)", param, "unsupported_field")
        if not field.accepts(value):
            neutral = " or ".join(repr(v) for v in field.neutral)
            only = f" (only {neutral} is accepted)" if neutral else ""
            raise InvalidRequestError(f"'{param}' is not supported by ncm: {field.what}{only}", param,
                                      "unsupported_field")


def markdown_tables() -> str:
    """The tables as docs/api.md prints them (a test keeps the two the same)."""
    titles = {"/v1/chat/completions": "`POST /v1/chat/completions`", "/v1/completions": "`POST /v1/completions`",
              "/v1/embeddings": "`POST /v1/embeddings`", "/api/chat": "`POST /api/chat`",
              "/api/generate": "`POST /api/generate`", "options": "Ollama's `options` (chat and generate)",
              "/api/embed": "`POST /api/embed`", "/api/embeddings": "`POST /api/embeddings`"}
    parts = []
    for key, table in TABLES.items():
        rows = ["| field | ncm | what it does |", "|---|---|---|"]
        for field in table.values():
            handling = field.handling
            if field.handling == REFUSED and field.neutral:
                handling += " unless " + " or ".join(f"`{json.dumps(value)}`" for value in field.neutral)
            rows.append(f"| `{field.name}` | {handling} | {field.what} |")
        parts.append(f"{titles[key]}:\n\n" + "\n".join(rows))
    return "\n\n".join(parts) + "\n"


def integer(value: Any) -> int | None:
    """``value`` as an integer when it is one, also written as a float (``8192.0``: Home
    Assistant sends its options so, and Ollama takes them); None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


__all__ = ["Field", "HONOURED", "NO_EFFECT", "REFUSED", "TABLES", "check_fields", "integer", "OPENAI_CHAT",
           "OPENAI_COMPLETION", "OPENAI_EMBEDDINGS", "OLLAMA_CHAT", "OLLAMA_EMBED", "OLLAMA_EMBEDDINGS", "OLLAMA_GENERATE",
           "OLLAMA_OPTIONS", "markdown_tables"]
