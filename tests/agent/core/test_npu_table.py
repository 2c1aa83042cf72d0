"""The table of known accelerators (agent.core.npu_table): every entry can be found, the more
specific entries win, and npu_tops_for matches case-insensitively, in any description, NULs
read as spaces, and answers (0.0, None) when nothing is known."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.npu_table import KNOWN_ACCELERATORS, npu_tops_for

NEEDLES = [needle for needle, _ in KNOWN_ACCELERATORS]
TOPS = dict(KNOWN_ACCELERATORS)
FILLER = st.text(alphabet=st.characters(codec="ascii"), max_size=30)


def index_of(needle: str | None) -> int:
    return len(NEEDLES) if needle is None else NEEDLES.index(needle)


def mixed_case(text: str, flips: list[bool]) -> str:
    return "".join(c.upper() if flip else c for c, flip in zip(text, flips + [False] * len(text)))


def test_the_table_lists_each_accelerator_once_in_lower_case_with_a_positive_figure():
    assert len(set(NEEDLES)) == len(NEEDLES)
    assert all(needle == needle.lower() and needle.strip() == needle for needle in NEEDLES)
    assert all(isinstance(tops, float) and tops > 0 for _, tops in KNOWN_ACCELERATORS)


@pytest.mark.parametrize("needle", NEEDLES)
def test_every_entry_is_found_by_its_own_name_so_none_is_shadowed_by_an_earlier_one(needle):
    assert npu_tops_for([needle]) == (TOPS[needle], needle)


@pytest.mark.parametrize(
    ("description", "expected"),
    [
        ("NVIDIA Jetson AGX Orin Developer Kit", ("jetson agx orin", 200.0)),
        ("NVIDIA Jetson AGX Orin 64GB Developer Kit", ("jetson agx orin 64gb", 275.0)),
        ("NVIDIA Jetson Orin Nano Engineering Reference Developer Kit", ("jetson orin nano", 20.0)),
        ("NVIDIA Jetson Nano Developer Kit", ("jetson nano", 0.5)),
        ("rockchip,rock-5b\x00rockchip,rk3588\x00", ("rk3588", 6.0)),
        ("Intel(R) Core(TM) Ultra 7 258V", ("intel(r) core(tm) ultra 7 2", 48.0)),
        ("Intel(R) Core(TM) Ultra 7 155H", ("intel(r) core(tm) ultra", 11.0)),
        ("hailo-8l m.2 module", ("hailo-8l", 13.0)),
        ("Hailo-8 AI accelerator", ("hailo-8", 26.0)),
    ],
)
def test_board_and_cpu_strings_name_their_accelerator(description, expected):
    needle, tops = expected
    assert npu_tops_for([description]) == (tops, needle)


def test_nothing_known_gives_no_tops_and_no_name():
    assert npu_tops_for([]) == (0.0, None)
    assert npu_tops_for(["Raspberry Pi 5 Model B Rev 1.0", "AMD Ryzen 7 7840U", ""]) == (0.0, None)


def test_a_nul_separates_words_like_a_space():
    assert npu_tops_for(["NVIDIA Jetson\x00AGX Orin"]) == (200.0, "jetson agx orin")
    assert npu_tops_for(["nvidia jetson agxorin"]) == (0.0, None)


@given(st.sampled_from(NEEDLES), FILLER, FILLER, st.lists(st.booleans(), max_size=40))
def test_a_name_is_found_in_any_case_anywhere_in_a_description(needle, before, after, flips):
    tops, found = npu_tops_for([before + mixed_case(needle, flips) + after])
    assert found is not None and index_of(found) <= index_of(needle) and tops == TOPS[found]
    assert found in (before + needle + after).lower()


@given(st.lists(FILLER | st.sampled_from(NEEDLES).map(str.upper), max_size=6), st.randoms(use_true_random=False))
def test_the_order_of_the_descriptions_does_not_matter(descriptions, rng):
    shuffled = list(descriptions)
    rng.shuffle(shuffled)
    assert npu_tops_for(shuffled) == npu_tops_for(descriptions)


@given(st.lists(FILLER | st.sampled_from(NEEDLES), max_size=5), st.lists(FILLER | st.sampled_from(NEEDLES), max_size=5))
def test_more_descriptions_never_lose_an_accelerator_and_only_find_a_more_specific_one(first, more):
    tops_before, before = npu_tops_for(first)
    tops_after, after = npu_tops_for(first + more)
    assert index_of(after) <= index_of(before)
    assert (after is None) == (tops_after == 0.0)
    assert (tops_before, before) == ((0.0, None) if before is None else (TOPS[before], before))


@given(st.lists(FILLER, max_size=5))
def test_text_without_any_known_name_gives_nothing(descriptions):
    lowered = " ".join(descriptions).lower()
    if not any(needle in text.lower().replace("\x00", " ") for text in descriptions for needle in NEEDLES):
        assert npu_tops_for(descriptions) == (0.0, None)
    else:
        assert npu_tops_for(descriptions)[1] in lowered.replace("\x00", " ")
