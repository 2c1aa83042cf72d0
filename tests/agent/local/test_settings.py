"""One rule per setting: the agent's configuration and first boot's setup file accept and
refuse the same values, with the same reason (agent/local/settings.py)."""

from __future__ import annotations

import pytest

from agent.cli.setup_file import SetupFileError, parse_setup_text
from agent.local import settings
from agent.local.config import AgentConfig, ConfigError

REFUSED = [
    ("cluster_name", "x" * 64),
    ("cluster_name", "-home"),
    ("cluster_name", "my.home"),
    ("cluster_key", "short"),
    ("cluster_key", "a key with spaces in it"),
    ("peers", "http://192.168.1.20:8080/v1"),
    ("peers", "ftp://192.168.1.20"),
    ("peers", "http://user:pw@192.168.1.20:8080"),
    ("peers", "http://192.168.1.20:8080?x=1"),
]
ACCEPTED = [("cluster_name", "x" * 63), ("cluster_name", "attic_2"), ("cluster_key", "k" * 256),
            ("peers", "http://192.168.1.20:8080"), ("peers", "https://[fd00::1]:8443/")]


def config_value(setting: str, value: str):
    return (value,) if setting == "peers" else value


@pytest.mark.parametrize(("setting", "value"), REFUSED)
def test_config_and_first_boot_refuse_the_same_values_with_the_same_reason(setting, value):
    with pytest.raises(ConfigError) as config_error:
        AgentConfig(**{setting: config_value(setting, value)})
    with pytest.raises(SetupFileError) as setup_error:
        parse_setup_text(f"{setting} = {value}\n")
    reason = str(config_error.value).removeprefix(f"{setting}: ")
    assert reason != str(config_error.value) and str(setup_error.value).endswith(f"{setting}: {reason}")


@pytest.mark.parametrize(("setting", "value"), ACCEPTED)
def test_config_and_first_boot_accept_the_same_values(setting, value):
    AgentConfig(**{setting: config_value(setting, value)})
    parsed = parse_setup_text(f"{setting} = {value}\n")
    assert getattr(parsed, setting) == (config_value(setting, settings.peer_url(value)) if setting == "peers" else value)


def test_a_cluster_key_is_never_quoted_in_its_refusal():
    with pytest.raises(ValueError) as refused:
        settings.cluster_key("secret with spaces")
    assert "secret" not in str(refused.value)
