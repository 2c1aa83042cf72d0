"""The reasoning of an answer read apart from its reply: whatever pieces the text streams in,
the same split as for the whole text; what templates say about thinking."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shards.runtime.reasoning import ReasoningSplitter, prompt_opens_thinking, reasoning_support


def split(pieces: list[str], *, inside: bool = False) -> tuple[str, str]:
    splitter = ReasoningSplitter(inside=inside)
    reasoning, reply = "", ""
    for piece in pieces:
        r, c = splitter.push(piece)
        reasoning, reply = reasoning + r, reply + c
    r, c = splitter.finish()
    return reasoning + r, reply + c


def test_a_think_block_then_the_reply():
    assert split(["<think>\nLet me see.\n</think>\n\nParis."]) == ("Let me see.", "Paris.")
    assert split(["  <think>a</think>b <think>c</think>"]) == ("a", "b <think>c</think>")  # one block, at the start
    assert split(["Paris."]) == ("", "Paris.")
    assert split(["<think>\n\n</think>\n\nParis."]) == ("", "Paris.")


def test_an_answer_the_prompt_opened_a_think_block_for():
    assert split(["so it is Paris\n</think>\n\nParis."], inside=True) == ("so it is Paris", "Paris.")
    assert split(["thinking, never done"], inside=True) == ("thinking, never done", "")


def test_a_lone_start_of_a_marker_is_text():
    assert split(["<thi"]) == ("", "<thi")
    assert split(["<think>x</thi"]) == ("x</thi", "")
    assert split(["<b>bold</b>"]) == ("", "<b>bold</b>")


TEXTS = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "th", "ink>", "\n", " ", "a", "b c", "</thin"]),
                 max_size=14).map("".join)


@given(TEXTS, st.lists(st.integers(0, 60), max_size=8), st.booleans())
def test_any_pieces_split_as_the_whole_text(text, cuts, inside):
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    assert split(pieces, inside=inside) == split([text], inside=inside)
    one_by_one = split(list(text), inside=inside)
    assert one_by_one == split([text], inside=inside)


QWEN3_TAIL = ("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and "
              "enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def test_what_templates_say_about_thinking():
    assert reasoning_support(QWEN3_TAIL).switch
    assert reasoning_support("{{ reasoning_effort }}").effort
    always = reasoning_support("{% if '</think>' in content %}{% endif %}<｜Assistant｜><think>\n")
    assert always is not None and not always.switch
    assert reasoning_support("{{ messages }}") is None and reasoning_support(None) is None
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
