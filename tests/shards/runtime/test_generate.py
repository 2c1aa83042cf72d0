"""TextStream (stop strings, EOS, max_tokens, streaming text) and generation on the real model."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shards.errors import RunnerError, SamplingError
from shards.runtime.generate import FINISH_LENGTH, FINISH_STOP, LocalModel, TextStream, generate, prompt_ids_for
from shards.runtime.sampling import SamplingParams
from tests.examples import examples

MODEL = "smollm2-135m"


def run_stream(tokenizer, text: str, **params) -> tuple[list[str], TextStream]:
    """Feed the tokens of ``text`` to a TextStream, finishing it when they run out."""
    stream = TextStream(tokenizer, SamplingParams(max_tokens=params.pop("max_tokens", 10_000), **params))
    pieces = []
    for token_id in tokenizer.encode(text):
        pieces.append(stream.push(token_id))
        if stream.done:
            break
    if not stream.done:
        pieces.append(stream.finish())
    return pieces, stream


def test_stop_string_is_never_emitted(smollm2_tokenizer) -> None:
    pieces, stream = run_stream(smollm2_tokenizer, "Hello there END and more", stop=("END",))
    assert "".join(pieces) == "Hello there " == stream.text
    assert stream.finish_reason == FINISH_STOP


def test_stop_string_across_token_boundaries(smollm2_tokenizer) -> None:
    text = "The answer: forty-two.\n\nQuestion: next"
    stop = "two.\n\nQues"
    ids = smollm2_tokenizer.encode(text)
    assert not any(stop in smollm2_tokenizer.decode([i]) for i in ids)  # spans several tokens
    pieces, stream = run_stream(smollm2_tokenizer, text, stop=(stop,))
    assert "".join(pieces) == "The answer: forty-"
    assert stream.finish_reason == FINISH_STOP


def test_false_stop_prefix_is_held_then_released(smollm2_tokenizer) -> None:
    pieces, stream = run_stream(smollm2_tokenizer, "Hello ENDING", stop=("END!",))
    assert "".join(pieces) == "Hello ENDING"
    assert stream.finish_reason == FINISH_LENGTH
    held_at = [i for i, piece in enumerate(pieces) if piece == ""]
    assert held_at, "the possible stop beginning 'END' should have been held back"


def test_first_completed_stop_wins(smollm2_tokenizer) -> None:
    pieces, _ = run_stream(smollm2_tokenizer, "one two three four", stop=("four", "two", "three"))
    assert "".join(pieces) == "one "
    pieces, _ = run_stream(smollm2_tokenizer, "say abcd", stop=("abcd", "bc"))
    assert "".join(pieces) == "say a"


def test_eos_ends_with_stop_and_flushes_held_text(smollm2_tokenizer) -> None:
    stream = TextStream(smollm2_tokenizer, SamplingParams(stop=("ab!",)))
    out = "".join(stream.push(i) for i in smollm2_tokenizer.encode("x ab"))
    out += stream.push(smollm2_tokenizer.eos_token_ids[0])
    assert out == "x ab"
    assert stream.finish_reason == FINISH_STOP
    assert stream.token_ids == [*smollm2_tokenizer.encode("x ab"), smollm2_tokenizer.eos_token_ids[0]]
    assert stream.completion_tokens == len(stream.token_ids)
    with pytest.raises(SamplingError):
        stream.push(5)


def test_max_tokens_ends_with_length(smollm2_tokenizer) -> None:
    pieces, stream = run_stream(smollm2_tokenizer, "a b c d e f g", max_tokens=3)
    assert stream.finish_reason == FINISH_LENGTH and stream.completion_tokens == 3
    assert "".join(pieces) == smollm2_tokenizer.decode(smollm2_tokenizer.encode("a b c d e f g")[:3])


def test_special_tokens_are_not_shown(smollm2_tokenizer) -> None:
    pieces, _ = run_stream(smollm2_tokenizer, "hi<|im_start|>there")
    assert "".join(pieces) == "hithere"


_STOP_ALPHABET = st.sampled_from(list("ab \n東🤖") + ["ab", "🤖b"])


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.lists(_STOP_ALPHABET, max_size=25).map("".join),
       stops=st.lists(st.lists(_STOP_ALPHABET, min_size=1, max_size=3).map("".join), min_size=1, max_size=3))
def test_stream_output_is_text_up_to_first_stop(smollm2_tokenizer, text: str, stops: list[str]) -> None:
    pieces, stream = run_stream(smollm2_tokenizer, text, stop=tuple(stops))
    expected, found = text, False
    for end in range(1, len(text) + 1):  # characters arriving one by one
        ending = [len(s) for s in stops if text[:end].endswith(s)]
        if ending:
            expected, found = text[:end - max(ending)], True
            break
    assert "".join(pieces) == expected
    assert stream.finish_reason == (FINISH_STOP if found else FINISH_LENGTH)
    emitted = ""
    for piece in pieces:
        emitted += piece
        assert expected.startswith(emitted)


# --- real model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_model(smollm2_store):
    with LocalModel.open(MODEL, smollm2_store) as model:
        yield model


@pytest.mark.slow
def test_capital_of_france_greedy(local_model) -> None:
    ids = prompt_ids_for(local_model.tokenizer, "What is the capital of France?")
    events = list(local_model.generate(ids, SamplingParams(max_tokens=32)))
    text = "".join(e.text for e in events)
    assert "Paris" in text
    final = events[-1]
    assert final.finish_reason == FINISH_STOP and final.usage is not None
    assert final.usage.prompt_tokens == len(ids)
    assert final.usage.completion_tokens == sum(1 for e in events if e.token_id is not None) + 1  # + EOS
    assert all(not r.sessions() for r in local_model.runners)


@pytest.mark.slow
def test_max_tokens_stop_string_and_sessions_freed(local_model) -> None:
    ids = prompt_ids_for(local_model.tokenizer, "Count from 1 to 20, separated by commas.")
    events = list(local_model.generate(ids, SamplingParams(max_tokens=5)))
    assert events[-1].finish_reason == FINISH_LENGTH and events[-1].usage.completion_tokens == 5
    full = "".join(e.text for e in local_model.generate(ids, SamplingParams(max_tokens=40)))
    assert "5" in full
    cut = full.index("5")
    events = list(local_model.generate(ids, SamplingParams(max_tokens=40, stop=("5",))))
    assert "".join(e.text for e in events) == full[:cut]
    assert events[-1].finish_reason == FINISH_STOP
    assert all(not r.sessions() for r in local_model.runners)


@pytest.mark.slow
def test_seeded_sampling_repeats_and_closing_early_frees_sessions(local_model) -> None:
    ids = prompt_ids_for(local_model.tokenizer, "Tell me a story.")
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=123, max_tokens=12)
    first = "".join(e.text for e in local_model.generate(ids, params))
    second = "".join(e.text for e in local_model.generate(ids, params))
    assert first == second
    stream = local_model.generate(ids, params, session_id="early")
    next(stream)
    assert all("early" in r.sessions() for r in local_model.runners)
    stream.close()
    assert all(not r.sessions() for r in local_model.runners)


@pytest.mark.slow
def test_generate_rejects_bad_prompts(local_model) -> None:
    with pytest.raises(SamplingError):
        list(generate(local_model.runners, local_model.tokenizer, [], SamplingParams()))
    with pytest.raises(SamplingError):
        list(generate(local_model.runners, local_model.tokenizer, [10**9], SamplingParams()))
    with pytest.raises(RunnerError):
        list(generate([], local_model.tokenizer, [1], SamplingParams()))
    with pytest.raises(SamplingError, match="system"):
        prompt_ids_for(local_model.tokenizer, "x", raw=True, system="be nice")


@pytest.mark.slow
def test_chunked_prefill_gives_the_same_answer(local_model) -> None:
    ids = prompt_ids_for(local_model.tokenizer, "Name three primary colours.", system="Answer briefly.")
    params = SamplingParams(max_tokens=16)
    whole = "".join(e.text for e in local_model.generate(ids, params))
    chunked = "".join(e.text for e in local_model.generate(ids, params, prefill_chunk_tokens=7))
    assert chunked == whole and whole


@pytest.mark.slow
def test_full_context_ends_with_length(smollm2_store) -> None:
    with LocalModel.open(MODEL, smollm2_store, max_context=48) as model:
        ids = prompt_ids_for(model.tokenizer, "Write a long poem about the sea.")
        assert len(ids) < 48
        events = list(model.generate(ids, SamplingParams(max_tokens=200)))
        assert events[-1].finish_reason == FINISH_LENGTH
        assert events[-1].usage.completion_tokens == 48 - len(ids)
        with pytest.raises(RunnerError, match="context"):
            list(model.generate(list(range(100, 160)), SamplingParams()))
        assert all(not r.sessions() for r in model.runners)
