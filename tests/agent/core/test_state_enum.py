"""The base of the state enums (agent.core.state_enum): a member is its string value wherever it
is shown (str, format, f-strings, %-formatting, JSON), compares and hashes as that string,
and is found from it; its repr still names the enum."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.deployments import ClusterState
from agent.core.model_registry import ModelState
from agent.core.state_enum import StateEnum

FORMAT_SPECS = ["", "s", ">12", "<7", "^9", "*^11", ".2", "-<4"]


class Light(StateEnum):
    """A small enum for the example tests."""

    GREEN = "green"
    AMBER = "amber"
    RED = "red"


def make_enum(values: list[str]) -> type[StateEnum]:
    return StateEnum("Drawn", [(f"M{index}", value) for index, value in enumerate(values)])


@given(st.lists(st.text(max_size=12), min_size=1, max_size=6, unique=True), st.sampled_from(FORMAT_SPECS))
def test_every_member_shows_as_its_value(values, spec):
    enum = make_enum(values)
    for member, value in zip(enum, values):
        assert str(member) == value and f"{member}" == value and "%s" % member == value
        assert format(member, spec) == format(value, spec) and f"[{member:{spec}}]" == f"[{value:{spec}}]"
        assert json.dumps(member) == json.dumps(value) and json.dumps({"state": member}) == json.dumps({"state": value})


@given(st.lists(st.text(max_size=12), min_size=1, max_size=6, unique=True))
def test_every_member_equals_hashes_as_and_is_found_from_its_value(values):
    enum = make_enum(values)
    for member, value in zip(enum, values):
        assert member == value and hash(member) == hash(value) and isinstance(member, str)
        assert enum(value) is member
        assert {value: "seen"}[member] == "seen" and {member: "seen"}[value] == "seen"
    assert len(enum) == len(values)


@given(st.lists(st.text(max_size=12), min_size=2, max_size=6, unique=True))
def test_members_differ_exactly_where_their_values_do(values):
    enum = make_enum(values)
    members = list(enum)
    for a in members:
        for b in members:
            assert (a == b) == (a.value == b.value) and (a != b) == (a is not b)


def test_the_repr_still_names_the_enum_and_the_member():
    assert repr(Light.AMBER) == "<Light.AMBER: 'amber'>"
    assert f"{Light.AMBER!r}" == "<Light.AMBER: 'amber'>"


def test_a_member_reads_as_its_value_in_messages_and_logs():
    assert f"the light is {Light.RED}" == "the light is red"
    assert "light: %s" % Light.GREEN == "light: green"
    assert "{} then {:>6}".format(Light.GREEN, Light.RED) == "green then    red"
    assert Light.AMBER.upper() == "AMBER" and Light.RED + "!" == "red!"


def test_an_unknown_value_is_no_member():
    with pytest.raises(ValueError, match="'blue' is not a valid Light"):
        Light("blue")
    assert Light.GREEN != "GREEN" and Light.GREEN != "Light.GREEN"


@pytest.mark.parametrize("enum", [ClusterState, ModelState])
def test_the_core_state_enums_show_their_values(enum):
    assert issubclass(enum, StateEnum) and len(enum) > 1
    for member in enum:
        assert str(member) == member.value == f"{member}" and json.loads(json.dumps(member)) == member.value
