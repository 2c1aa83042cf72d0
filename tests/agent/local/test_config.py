from pathlib import Path

import pytest

from agent.local.config import AgentConfig, ConfigError, load_config
from agent.local.identity import load_or_create_node_id


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return path


def test_file_then_environment_then_flags(tmp_path):
    path = write(tmp_path, 'port = 9000\ncluster_name = "attic"\npeers = ["http://a:1"]\nmdns = true\n')
    config = load_config(path, environ={"NCM_PORT": "9100", "NCM_MDNS": "off", "NCM_PEERS": "http://b:1, http://c:1"},
                         overrides={"port": 9200, "model": None})
    assert config.port == 9200  # flag beats environment beats file
    assert config.mdns is False
    assert config.peers == ("http://b:1", "http://c:1")
    assert config.cluster_name == "attic"


@pytest.mark.parametrize(
    "text, message",
    [
        ("port = 'high'\n", "port (from config file"),
        ("colour = 'blue'\n", "unknown setting 'colour'"),
        ("peers = ['ftp://x']\n", "peers: a peer URL starts with http:// or https://, got 'ftp://x'"),
        ("cluster_key = 'short'\n", "cluster_key: the cluster key must have 16-256 characters"),
        ("failure_threshold = 0\n", "failure_threshold must be >= 1"),
        ("activation_bits = 4\n", "activation_bits must be 8 or 16, got 4"),
        ("advertise_peer_port = 70000\n", "port, peer_port and advertise_peer_port must be in 0-65535"),
        ("port = [\n", "not valid TOML"),
    ],
)
def test_bad_values_name_the_field(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config(write(tmp_path, text), environ={})


def test_bad_environment_value_names_the_variable_source(tmp_path):
    with pytest.raises(ConfigError, match=r"port \(from environment NCM_\*\) must be an integer"):
        load_config(None, environ={"NCM_PORT": "eighty"})


def test_agent_table_is_accepted_and_missing_file_is_clear(tmp_path):
    assert load_config(write(tmp_path, "[agent]\nport = 1234\n"), environ={}).port == 1234
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", environ={})


def test_node_id_is_created_once_and_kept(tmp_path):
    first = load_or_create_node_id(tmp_path / "state")
    assert len(first) == 32 and first == load_or_create_node_id(tmp_path / "state")
    (tmp_path / "state" / "node-id").write_text("../../etc\n")
    with pytest.raises(ConfigError, match="does not hold 12-64 lowercase hex characters; delete the file"):
        load_or_create_node_id(tmp_path / "state")


def test_defaults_are_valid():
    assert AgentConfig().port == 8080


def test_router_settings_and_what_was_set_explicitly(tmp_path):
    path = write(tmp_path, 'max_context = 1024\nmodels_preset = "/etc/ncm/models.ini"\n')
    config = load_config(path, environ={"NCM_MODELS_MAX": "2", "NCM_SLEEP_IDLE_S": "30"}, overrides={"port": None})
    assert config.models_max == 2 and config.sleep_idle_s == 30.0 and config.models_preset == Path("/etc/ncm/models.ini")
    assert config.explicit == {"max_context", "models_preset", "models_max", "sleep_idle_s"}  # they beat presets
    assert config.models_autoload and config.models_memory_margin_mib == 256
    with pytest.raises(ConfigError, match="models_max"):
        load_config(None, environ={"NCM_MODELS_MAX": "-1"})
    assert AgentConfig().default_placement == "auto"
    assert load_config(None, environ={"NCM_DEFAULT_PLACEMENT": "split"}).default_placement == "split"
    with pytest.raises(ConfigError, match="default_placement must be one of split, replicas, auto, got 'pipeline'"):
        load_config(None, environ={"NCM_DEFAULT_PLACEMENT": "pipeline"})
