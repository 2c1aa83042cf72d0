"""agent.local.identity: what a node id is (12-64 lowercase hex characters, surrounding space
ignored), the ids made for new nodes, and the node-id file in the state directory: created on
first start (readable by all, one line), read as it is afterwards (also when first boot wrote
it), and a file that cannot be read, holds no node id or cannot be created is a ConfigError
that names the path."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.local.config import ConfigError
from agent.local.identity import NODE_ID_FILE, load_or_create_node_id, new_node_id, node_id

HEX = "0123456789abcdef"
valid_ids = st.text(HEX, min_size=12, max_size=64)
spaces = st.text(" \t\r\n", max_size=3)


@given(valid_ids, spaces, spaces)
def test_a_node_id_is_12_to_64_lowercase_hex_characters_with_the_space_around_it_dropped(
        value: str, before: str, after: str) -> None:
    assert node_id(before + value + after) == value


@given(st.text(HEX, max_size=11) | st.text(HEX, min_size=65, max_size=80))
def test_a_node_id_too_short_or_too_long_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="12-64 lowercase hex characters"):
        node_id(value)


@given(valid_ids, st.data())
def test_one_character_that_is_not_lowercase_hex_spoils_a_node_id(value: str, data: st.DataObject) -> None:
    index = data.draw(st.integers(0, len(value) - 1))
    wrong = data.draw(st.characters().filter(lambda c: c not in HEX and not c.isspace()))
    with pytest.raises(ValueError):
        node_id(value[:index] + wrong + value[index + 1:])


def test_a_node_id_with_space_inside_or_a_trailing_line_of_junk_is_refused() -> None:
    for text in ("0123456789ab cdef", "0123456789abcdef\njunk", "0123456789ABCDEF", "../../etc/passwd0"):
        with pytest.raises(ValueError):
            node_id(text)


def test_new_node_ids_are_valid_32_character_ids_and_differ() -> None:
    made = {new_node_id() for _ in range(200)}
    assert len(made) == 200
    assert all(len(value) == 32 and node_id(value) == value for value in made)


def test_the_first_start_creates_the_state_directory_and_a_one_line_file_readable_by_all(tmp_path: Path) -> None:
    state = tmp_path / "var" / "lib" / "ncm"
    created = load_or_create_node_id(state)
    path = state / NODE_ID_FILE
    assert path.read_text(encoding="utf-8") == created + "\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert node_id(created) == created and len(created) == 32
    assert sorted(p.name for p in state.iterdir()) == [NODE_ID_FILE]  # no temporary file left


def test_an_id_written_by_first_boot_is_read_as_it_is(tmp_path: Path) -> None:
    (tmp_path / NODE_ID_FILE).write_text("\n  0123456789abcdef0123  \n\n", encoding="utf-8")
    assert load_or_create_node_id(tmp_path) == "0123456789abcdef0123"
    assert (tmp_path / NODE_ID_FILE).read_text() == "\n  0123456789abcdef0123  \n\n"  # not rewritten


def test_an_empty_or_blank_file_is_replaced_by_a_new_id(tmp_path: Path) -> None:
    path = tmp_path / NODE_ID_FILE
    path.write_text(" \n\t\n")
    created = load_or_create_node_id(tmp_path)
    assert path.read_text() == created + "\n" and load_or_create_node_id(tmp_path) == created


def test_a_file_with_uppercase_hex_is_refused_with_the_path_and_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / NODE_ID_FILE
    path.write_text("0123456789ABCDEF\n")
    with pytest.raises(ConfigError) as caught:
        load_or_create_node_id(tmp_path)
    assert str(path) in str(caught.value) and "delete the file to create a new one" in str(caught.value)
    assert path.read_text() == "0123456789ABCDEF\n"  # left for the user to look at


def test_a_node_id_path_that_cannot_be_read_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / NODE_ID_FILE).mkdir()  # a directory where the file should be
    with pytest.raises(ConfigError, match=r"cannot read node id from .*node-id.*: Is a directory"):
        load_or_create_node_id(tmp_path)
    not_a_folder = tmp_path / "plain-file"
    not_a_folder.write_text("")
    with pytest.raises(ConfigError, match="cannot read node id from .*: Not a directory"):
        load_or_create_node_id(not_a_folder)


def test_a_state_directory_that_cannot_be_made_is_a_config_error_naming_it(tmp_path: Path) -> None:
    """The state directory's parent is a dangling link: reading finds no file, making the
    directory fails (also as root)."""
    (tmp_path / "gone").symlink_to(tmp_path / "missing-target")
    state = tmp_path / "gone" / "state"
    with pytest.raises(ConfigError, match=r"cannot create node id in .*gone/state.*: File exists"):
        load_or_create_node_id(state)
    assert not (tmp_path / "missing-target").exists()


def test_a_file_of_bytes_that_are_not_text_is_a_config_error_too(tmp_path: Path) -> None:
    (tmp_path / NODE_ID_FILE).write_bytes(b"\xff\xfe\x00\x13garbage after a power cut")
    with pytest.raises(ConfigError, match="delete the file to create a new one"):
        load_or_create_node_id(tmp_path)
