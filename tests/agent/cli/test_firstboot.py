"""agent.cli.firstboot: the boot-partition setup file and first-boot provisioning."""

from __future__ import annotations

import argparse
import logging
import tomllib
from pathlib import Path

import pytest

from agent.cli import firstboot
from agent.cli.firstboot import run_firstboot
from agent.cli.setup_file import (
    BootSetup,
    FirstbootError,
    SetupFileError,
    merge_config,
    parse_join_string,
    parse_setup_text,
    render_config,
)
from agent.core.errors import NcmError

KEY = "correct-horse-battery-staple"

EXAMPLE = (
    "\ufeff# written in Notepad\r\n"
    "cluster_name = kitchen\r\n"
    f"cluster_key = \"{KEY}\"   # same on every device\r\n"
    "peers = http://192.168.1.20:8080, http://[fd00::2]:8080\r\n"
    "peer = http://nas.local:8080\r\n"
    "model = smollm2-135m\r\n"
    "pull = yes\r\n"
    "hostname = NCM-Kitchen\r\n"
    "orchestrator = no\r\n"
    "port = 8081\r\n"
    "interfaces = eth0 wlan0\r\n"
)


def test_parse_a_full_file() -> None:
    setup = parse_setup_text(EXAMPLE)
    assert setup == BootSetup(
        cluster_name="kitchen",
        cluster_key=KEY,
        peers=("http://192.168.1.20:8080", "http://[fd00::2]:8080", "http://nas.local:8080"),
        model="smollm2-135m",
        pull=True,
        hostname="ncm-kitchen",
        orchestrator=False,
        port=8081,
        interfaces=("eth0", "wlan0"),
    )
    assert KEY not in repr(setup)


def test_join_string() -> None:
    url, key, name = parse_join_string(f"http://192.168.1.20:8080/?cluster=home#{KEY}")
    assert (url, key, name) == ("http://192.168.1.20:8080", KEY, "home")
    assert parse_join_string(f"https://ncm-a1b2c3.local:8080#{KEY}") == ("https://ncm-a1b2c3.local:8080", KEY, None)
    setup = parse_setup_text(f"join = http://10.0.0.5:8080#{KEY}\npeers = http://10.0.0.6:8080\n")
    assert setup.cluster_key == KEY
    assert setup.peers == ("http://10.0.0.5:8080", "http://10.0.0.6:8080")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("cluster_nmae = home\n", "line 1: unknown setting 'cluster_nmae'"),
        ("\n\nport = 99999\n", "line 3: port"),
        ("cluster_key = short\n", "16-256 characters"),
        ("peers = ftp://x\n", "http://"),
        ("peers = http://user:pw@x:8080\n", "user or password"),
        ("hostname = -bad-\n", "hostname"),
        ("orchestrator = maybe\n", "yes or no"),
        ("just some words\n", "key = value"),
        ("model = a\nmodel = b\n", "already set on line 1"),
        ("pull = yes\n", "needs a model"),
        ("join = http://x:8080\n", "cluster key after '#' is missing"),
        (f"join = http://x:8080#{KEY}\ncluster_key = another-key-of-enough-length\n", "two different cluster keys"),
        ("cluster_name = 'home\n", "unterminated quote"),
    ],
)
def test_bad_files_name_the_problem(text: str, needle: str) -> None:
    with pytest.raises(SetupFileError, match=None) as info:
        parse_setup_text(text)
    assert needle in str(info.value)
    assert isinstance(info.value, NcmError)


def test_secrets_never_appear_in_errors() -> None:
    secret = "s3cret with spaces inside it"
    with pytest.raises(SetupFileError) as info:
        parse_setup_text(f"cluster_key = {secret}\n")
    assert secret not in str(info.value)
    with pytest.raises(SetupFileError) as info:
        parse_setup_text("join = http://x:8080#tooshort\n")
    assert "tooshort" not in str(info.value)


def test_merge_keeps_existing_keys_and_generates_a_key(tmp_path: Path) -> None:
    existing = {"peers": ["http://old:8080"], "api_token": "keep-me", "custom": 3}
    config, generated = merge_config(existing, parse_setup_text("peers = http://new:8080\n"), state_dir=tmp_path)
    assert generated
    assert len(str(config["cluster_key"])) >= 16
    assert config["peers"] == ["http://old:8080", "http://new:8080"]
    assert config["api_token"] == "keep-me" and config["custom"] == 3
    assert config["cluster_name"] == "home"
    assert config["state_dir"] == str(tmp_path)


def test_render_config_is_valid_toml() -> None:
    config = {"cluster_name": "home", "cluster_key": 'a"b\\c\u0001' + "x" * 16, "port": 8080,
              "orchestrator": True, "peers": ["http://a:1"], "npu_tops": 6.0, "extra": "é"}
    assert tomllib.loads(render_config(config)) == config
    with pytest.raises(FirstbootError):
        render_config({"nested": {"a": 1}})


def _run(tmp_path: Path, setup_text: str | None, **kwargs: object) -> firstboot.FirstbootResult:
    boot = tmp_path / "boot"
    boot.mkdir(exist_ok=True)
    boot_file = None
    if setup_text is not None:
        boot_file = boot / "ncm-setup.txt"
        boot_file.write_text(setup_text)
    etc = tmp_path / "etc"
    etc.mkdir(exist_ok=True)
    return run_firstboot(boot_file, etc / "ncm" / "agent.toml", tmp_path / "state",
                         set_hostname=True, etc_dir=etc, group=None, **kwargs)


def test_run_firstboot_provisions_and_is_idempotent(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "hosts").write_text("127.0.0.1\tlocalhost\n::1\tlocalhost\n")
    first = _run(tmp_path, EXAMPLE)
    assert first.created_node_id and not first.generated_cluster_key
    node_id = (tmp_path / "state" / "node-id").read_text().strip()
    assert node_id == first.node_id and len(node_id) == 32 and int(node_id, 16) >= 0
    config_path = tmp_path / "etc" / "ncm" / "agent.toml"
    config = tomllib.loads(config_path.read_text())
    assert config["cluster_key"] == KEY and config["port"] == 8081 and config["model"] == "smollm2-135m"
    assert config_path.stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "etc" / "hostname").read_text() == "ncm-kitchen\n"
    assert "127.0.1.1\tncm-kitchen" in (tmp_path / "etc" / "hosts").read_text()
    assert (tmp_path / "state" / "pull-model").read_text() == "smollm2-135m\n"
    assert KEY not in caplog.text

    before = config_path.read_text()
    second = _run(tmp_path, EXAMPLE)
    assert second.node_id == first.node_id and not second.created_node_id
    assert config_path.read_text() == before


def test_default_hostname_and_generated_key(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    result = _run(tmp_path, None)
    assert result.generated_cluster_key
    assert result.hostname == f"ncm-{result.node_id[:6]}"
    assert (tmp_path / "etc" / "hostname").read_text() == result.hostname + "\n"
    config = tomllib.loads((tmp_path / "etc" / "ncm" / "agent.toml").read_text())
    assert str(config["cluster_key"]) not in caplog.text
    # Run again: the generated key stays.
    again = _run(tmp_path, None)
    assert not again.generated_cluster_key
    assert tomllib.loads((tmp_path / "etc" / "ncm" / "agent.toml").read_text())["cluster_key"] == config["cluster_key"]


def test_a_bad_file_writes_nothing_and_leaves_an_error_note(tmp_path: Path) -> None:
    with pytest.raises(SetupFileError):
        _run(tmp_path, "cluster_name = home\nport = eighty\n")
    assert not (tmp_path / "state" / "node-id").exists()
    assert not (tmp_path / "etc" / "ncm" / "agent.toml").exists()
    note = (tmp_path / "boot" / "ncm-setup-error.txt").read_text()
    assert "line 2: port" in note
    # Fixed file: provisioning succeeds and the note goes away.
    _run(tmp_path, "cluster_name = home\nport = 8080\n")
    assert (tmp_path / "state" / "node-id").exists()
    assert not (tmp_path / "boot" / "ncm-setup-error.txt").exists()


def test_a_corrupt_node_id_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "node-id").write_text("not hex\n")
    with pytest.raises(FirstbootError, match="node-id"):
        _run(tmp_path, None)


def test_find_boot_file(tmp_path: Path) -> None:
    (tmp_path / "efi").mkdir()
    (tmp_path / "firmware").mkdir()
    (tmp_path / "firmware" / "ncm-setup.txt").write_text("")
    assert firstboot.find_boot_file([tmp_path / "efi", tmp_path / "firmware"]) == tmp_path / "firmware" / "ncm-setup.txt"
    assert firstboot.find_boot_file([tmp_path / "efi"]) is None


def test_pull_pending(tmp_path: Path) -> None:
    pulled: list[str] = []
    assert firstboot.pull_pending(tmp_path, pull=lambda name: pulled.append(name) or 0) == 0
    assert pulled == []
    (tmp_path / "pull-model").write_text("smollm2-135m\n")
    assert firstboot.pull_pending(tmp_path, pull=lambda name: 1) == 1
    assert (tmp_path / "pull-model").exists()  # kept for the next try
    assert firstboot.pull_pending(tmp_path, pull=lambda name: pulled.append(name) or 0) == 0
    assert pulled == ["smollm2-135m"] and not (tmp_path / "pull-model").exists()


def test_subcommand(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="ncm")
    sub = parser.add_subparsers(dest="command")
    firstboot.register(sub)
    boot = tmp_path / "boot"
    boot.mkdir()
    (boot / "ncm-setup.txt").write_text(f"cluster_key = {KEY}\n")
    args = parser.parse_args(["firstboot", "--boot-dir", str(tmp_path / "none"), "--boot-dir", str(boot),
                              "--config", str(tmp_path / "agent.toml"), "--state-dir", str(tmp_path / "state"),
                              "--no-hostname"])
    assert args.func(args) == 0
    assert tomllib.loads((tmp_path / "agent.toml").read_text())["cluster_key"] == KEY
    args = parser.parse_args(["firstboot", "--boot-file", str(tmp_path / "missing.txt"),
                              "--config", str(tmp_path / "agent.toml"), "--state-dir", str(tmp_path / "state")])
    with pytest.raises(FirstbootError, match="does not exist"):
        args.func(args)


def test_a_join_string_from_ncm_invite_waits_for_the_agent(tmp_path: Path) -> None:
    """`join = ncm1.…` in the setup file: the agent redeems it once it runs (the member may
    not be reachable at first boot); the string is kept readable by the service only."""
    from agent.core.invites import JoinString, fingerprint

    join = JoinString("home", "http://192.168.1.20:8080", "0123abcd0123abcd", bytes(24),
                      fingerprint(b"cluster-key-0123456789")).encode()
    result = _run(tmp_path, f"join = {join}\n")
    pending = tmp_path / "state" / "pending-join"
    assert pending.read_text().strip() == join
    assert oct(pending.stat().st_mode & 0o777) == "0o640"
    assert join not in repr(parse_setup_text(f"join = {join}\n"))  # a secret: never in a repr or log
    assert result.created_node_id
    with pytest.raises(SetupFileError, match="damaged"):
        parse_setup_text("join = ncm1.not-a-real-one\n")
