"""agent.cli.setup_file on its own: how ``ncm-setup.txt`` is read (any spelling of keys and
booleans, comments, quotes, line endings), what each setting accepts and the error that names
the line otherwise, join strings, and the pure helpers first boot uses (the merged config, the
hostname, /etc/hosts). tests/agent/cli/test_firstboot.py runs them through first boot."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.cli.setup_file import (
    MODEL_NAME,
    SETUP_KEYS,
    BootSetup,
    FirstbootError,
    SetupFileError,
    default_hostname,
    hosts_with_hostname,
    merge_config,
    parse_join_string,
    parse_setup_text,
    validate_hostname,
    validate_node_id,
)
from agent.core.invites import JOIN_PREFIX, JoinString, fingerprint

KEY = "correct-horse-battery-staple"

# --- the round trip: whatever a person may write, read back as meant ------------------------------
SPELLINGS = {True: ["yes", "true", "on", "1"], False: ["no", "false", "off", "0"]}
secret_text = st.text(st.sampled_from("abcdefXYZ0123456789-_.:+/=@!$%^&*~#"), min_size=16, max_size=40)
hostnames = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)
peer_urls = st.builds(lambda ip, port: f"http://{ip}:{port}", st.ip_addresses(v=4), st.integers(1, 65535))


def spelled(draw: st.DrawFn, key: str) -> str:
    """``key`` as a person may type it: any case, '-' for '_', spaces around '='."""
    name = "".join(ch.upper() if draw(st.booleans()) else ch for ch in key)
    name = name.replace("_", "-") if draw(st.booleans()) else name
    return name + draw(st.sampled_from(["=", " = ", "\t=  ", " ="]))


def as_value(draw: st.DrawFn, text: str) -> str:
    """``text`` bare, quoted, or followed by a comment (quoted when it starts with '#': bare, it is one)."""
    form = draw(st.sampled_from(["bare", "double", "single", "comment"]))
    if text.startswith("#") and form in ("bare", "comment"):
        form = "single" if '"' in text else "double"
    if form == "double" and '"' not in text:
        return f'"{text}"' + draw(st.sampled_from(["", "  # quoted"]))
    if form == "single" and "'" not in text:
        return f"'{text}'"
    if form == "comment":
        return f"{text}   # what this is"
    return text


def boolean(draw: st.DrawFn, value: bool) -> str:
    word = draw(st.sampled_from(SPELLINGS[value]))
    return "".join(ch.upper() if draw(st.booleans()) else ch for ch in word)


@st.composite
def setup_files(draw: st.DrawFn) -> tuple[str, BootSetup]:
    """The text of a valid setup file and what it says."""
    lines: list[str] = []
    expected: dict[str, object] = {}
    if draw(st.booleans()):
        expected["cluster_name"] = draw(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,20}", fullmatch=True))
        lines.append(spelled(draw, "cluster_name") + as_value(draw, str(expected["cluster_name"])))
    if draw(st.booleans()):
        expected["cluster_key"] = draw(secret_text)
        lines.append(spelled(draw, "cluster_key") + as_value(draw, str(expected["cluster_key"])))
    if draw(st.booleans()):
        expected["api_token"] = draw(secret_text)
        lines.append(spelled(draw, "api_token") + as_value(draw, str(expected["api_token"])))
    if draw(st.booleans()):
        expected["model"] = draw(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,30}", fullmatch=True))
        lines.append(spelled(draw, "model") + as_value(draw, str(expected["model"])))
        if draw(st.booleans()):
            expected["pull"] = draw(st.booleans())
            lines.append(spelled(draw, "pull") + boolean(draw, bool(expected["pull"])))
    for key in ("orchestrator", "mdns"):
        if draw(st.booleans()):
            expected[key] = draw(st.booleans())
            lines.append(spelled(draw, key) + boolean(draw, bool(expected[key])))
    if draw(st.booleans()):
        expected["hostname"] = draw(hostnames)
        typed = "".join(ch.upper() if draw(st.booleans()) else ch for ch in str(expected["hostname"]))
        lines.append(spelled(draw, "hostname") + as_value(draw, typed))
    if draw(st.booleans()):
        expected["port"] = draw(st.integers(1, 65535))
        lines.append(spelled(draw, "port") + as_value(draw, str(expected["port"])))
    if draw(st.booleans()):
        names = draw(st.lists(st.from_regex(r"[A-Za-z0-9_.:@-]{1,15}", fullmatch=True), max_size=3))
        expected["interfaces"] = tuple(names)
        lines.append(spelled(draw, "interfaces") + draw(st.sampled_from([", ", " ", " ,\t"])).join(names))
    if draw(st.booleans()):
        expected["npu_tops"] = draw(st.floats(0, 10_000))
        lines.append(spelled(draw, "npu_tops") + as_value(draw, repr(expected["npu_tops"])))
    peers = draw(st.lists(peer_urls, max_size=4))
    groups = {}
    for group in (peers[:2], peers[2:]):
        if group:
            line = spelled(draw, draw(st.sampled_from(["peers", "peer"]))) + ", ".join(group)
            groups[line] = group
            lines.append(line)
    lines = draw(st.permutations(lines))
    peers = [url for line in lines for url in groups.get(line, [])]
    for _ in range(draw(st.integers(0, 3))):
        lines.insert(draw(st.integers(0, len(lines))), draw(st.sampled_from(["", "# a comment", "; another", "   "])))
    ending = draw(st.sampled_from(["\n", "\r\n", "\r"]))
    text = ("\ufeff" if draw(st.booleans()) else "") + ending.join(lines) + draw(st.sampled_from(["", ending]))
    return text, BootSetup(peers=tuple(dict.fromkeys(peers)), **expected)  # type: ignore[arg-type]


@settings(deadline=None)  # drawing a whole file takes a while on a busy machine
@given(setup_files())
def test_a_setup_file_reads_back_as_written_and_keeps_its_secrets_out_of_repr(case: tuple[str, BootSetup]) -> None:
    text, expected = case
    setup = parse_setup_text(text)
    assert setup == expected
    for secret in (setup.cluster_key, setup.api_token):
        if secret is not None:
            assert secret not in repr(setup)


@given(st.lists(st.sampled_from(["", "   ", "# note", "; note", "peer = http://10.0.0.1:8080"]), max_size=8),
       st.sampled_from(["port = 0", "hostname = a_b", "mdns = sometimes", "colour = blue", "no equals sign"]),
       st.sampled_from(["\n", "\r\n"]))
def test_an_error_names_the_line_it_is_on(before: list[str], bad: str, ending: str) -> None:
    text = ending.join([*before, bad, "# after"])
    with pytest.raises(SetupFileError, match=rf"^ncm-setup\.txt line {len(before) + 1}: "):
        parse_setup_text(text)


# --- each setting ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("line", "message"), [
    ("api_token = two words", "api_token: the API token must be 1-256 characters without spaces"),
    ("api_token = ''", "api_token: the API token must be 1-256 characters without spaces"),
    (f"api_token = {'t' * 257}", "api_token: the API token must be 1-256 characters without spaces"),
    ("model = -leading-dash", "model: a model name is letters, digits and . _ : / @ + -"),
    ("model = two words", "model: a model name is letters, digits and . _ : / @ + -"),
    ("port = 0", "port: the port is a number from 1 to 65535"),
    ("port = 65536", "port: the port is a number from 1 to 65535"),
    ("port = 80a", "port: the port is a number from 1 to 65535"),
    ("port = -1", "port: the port is a number from 1 to 65535"),
    ("interfaces = eth0, a-name-far-too-long", "interfaces: bad interface name 'a-name-far-too-long'"),
    ("interfaces = eth0 wl/an0", "interfaces: bad interface name 'wl/an0'"),
    ("npu_tops = fast", "npu_tops: npu_tops is a number"),
    ("npu_tops = -1", "npu_tops: npu_tops must be between 0 and 10000"),
    ("npu_tops = 10000.5", "npu_tops: npu_tops must be between 0 and 10000"),
    ("npu_tops = nan", "npu_tops: npu_tops must be between 0 and 10000"),
    ("npu_tops = inf", "npu_tops: npu_tops must be between 0 and 10000"),
    ("hostname = " + "a" * 64, "hostname: a hostname is 1-63 letters, digits or '-'"),
    ("hostname = ncm.local", "hostname: a hostname is 1-63 letters, digits or '-'"),
    ("mdns = maybe", "mdns: expected yes or no"),
    ("pull = 2", "pull: expected yes or no"),
    ("cluster_name = _home", "cluster_name: a cluster name is 1-63 letters, digits, '-' or '_'"),
    ("peers = http://a:8080/path", "peers: a peer URL has no path"),
    ("peer = http://a:8080?x=1", "peers: a peer URL takes no ?query or #fragment"),
    ("model = 'm1' and more", "model: text after the closing quote"),
])
def test_a_bad_value_is_refused_with_the_rule_it_breaks(line: str, message: str) -> None:
    with pytest.raises(SetupFileError) as caught:
        parse_setup_text(f"# setup\n{line}\n", source="boot/ncm-setup.txt")
    assert str(caught.value).startswith(f"boot/ncm-setup.txt line 2: {message}")
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, FirstbootError)


def test_values_at_the_edges_of_their_rules_are_accepted() -> None:
    setup = parse_setup_text("port = 1\nnpu_tops = 0\nhostname = " + "a" * 63 + "\napi_token = " + "t" * 256
                             + "\nmodel = hf.co/org/Model-1.5B:Q4_K_M@main+x\ninterfaces =\n")
    assert setup.port == 1 and setup.npu_tops == 0.0 and setup.hostname == "a" * 63
    assert setup.api_token == "t" * 256 and setup.model == "hf.co/org/Model-1.5B:Q4_K_M@main+x"
    assert setup.interfaces == ()  # given empty: every interface, not "not given" (None)
    assert parse_setup_text("port = 65535\nnpu_tops = 10000\n").port == 65535
    assert parse_setup_text("").interfaces is None and parse_setup_text("") == BootSetup()


def test_a_comment_needs_a_space_before_it_and_quotes_end_the_value() -> None:
    setup = parse_setup_text("api_token = abc#def==  # the token\n"
                             "model = \"m1\" # quoted, then a comment\n"
                             f"cluster_key = \"#{KEY}\"\n"
                             "cluster_name = 'kitchen'\n")
    assert setup.api_token == "abc#def==" and setup.model == "m1"
    assert setup.cluster_key == f"#{KEY}" and setup.cluster_name == "kitchen"
    with pytest.raises(SetupFileError, match="line 1: api_token: the API token must be 1-256 characters"):
        parse_setup_text("api_token =   # set it later\n")  # a value that is only a comment is empty
    with pytest.raises(SetupFileError, match="line 1: cluster_key: the cluster key must have 16-256 characters"):
        parse_setup_text(f"cluster_key = {KEY[:10]} #{KEY[10:]}\n")  # the key cut at ' #'


def test_an_unknown_setting_lists_the_known_ones_and_names_are_normalised() -> None:
    with pytest.raises(SetupFileError) as caught:
        parse_setup_text("clusterkey = " + KEY)
    assert str(caught.value) == f"ncm-setup.txt line 1: unknown setting 'clusterkey' (known: {', '.join(SETUP_KEYS)})"
    assert KEY not in str(caught.value)
    assert parse_setup_text("NPU-Tops = 2.5\nPeer = http://a:1\nPEERS = http://b:2").npu_tops == 2.5
    with pytest.raises(SetupFileError, match="line 2: npu_tops is already set on line 1"):
        parse_setup_text("npu-tops = 1\nNPU_TOPS = 2\n")


def test_peers_from_every_line_are_normalised_and_kept_once_in_order() -> None:
    setup = parse_setup_text("peers = http://b:2/, http://[FD00::2]:8080\npeer = https://a\n"
                             "peer = http://b:2\npeers = http://c:3 http://a:1\n")
    assert setup.peers == ("http://b:2", "http://[fd00::2]:8080", "https://a", "http://c:3", "http://a:1")


@pytest.mark.parametrize("secret_line", [
    "cluster_key = {secret}",
    "api_token = {secret}",
    "join = http://10.0.0.5:8080#{secret}",
    "join = http://10.0.0.5:8080/?cluster=home#{secret}",
])
@given(st.lists(st.from_regex(r"[A-Za-z0-9]{8,20}", fullmatch=True), min_size=2, max_size=3))
def test_a_refused_secret_never_appears_in_the_error(secret_line: str, words: list[str]) -> None:
    secret = " ".join(words)  # spaces: refused as a key and as a token
    with pytest.raises(SetupFileError) as caught:
        parse_setup_text("# setup\n" + secret_line.format(secret=f'"{secret}"' if "join" not in secret_line
                                                          else secret) + "\n")
    message = str(caught.value)
    assert message.startswith("ncm-setup.txt line 2: ")
    assert not any(word in message for word in words), message


# --- join strings ----------------------------------------------------------------------------------
hosts = st.one_of(st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map(lambda ip: f"[{ip}]"),
                  st.from_regex(r"ncm-[a-z0-9]{1,10}\.local", fullmatch=True))
cluster_names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,20}", fullmatch=True)
keys = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=16, max_size=64)


@given(st.sampled_from(["http", "https"]), hosts, st.none() | st.integers(1, 65535), st.none() | cluster_names, keys)
def test_a_join_string_gives_the_peer_the_key_and_the_cluster(scheme: str, host: str, port: int | None,
                                                              name: str | None, key: str) -> None:
    url = f"{scheme}://{host}" + (f":{port}" if port else "")
    text = url + (f"/?cluster={name}" if name else "") + "#" + key
    peer, got_key, got_name = parse_join_string(f"  {text}\n")
    assert (got_key, got_name) == (key, name)
    assert peer == url


@pytest.mark.parametrize(("join", "message"), [
    (f"http://a:8080/?token=x#{KEY}", "unknown join-string parameter 'token' (only cluster=NAME)"),
    (f"http://a:8080/?cluster=#{KEY}", "unknown join-string parameter 'cluster'"),
    (f"http://a:8080/?cluster=home&x=1#{KEY}", "unknown join-string parameter 'x'"),
    (f"http://a:8080/?cluster=-home#{KEY}", "a cluster name is 1-63 letters"),
    (f"http://a:8080/join#{KEY}", "a peer URL has no path"),
    (f"ftp://a:8080#{KEY}", "a peer URL starts with http:// or https://"),
    ("http://a:8080#short", "the cluster key must have 16-256 characters"),
])
def test_a_bad_join_string_says_what_is_wrong(join: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_join_string(join)


def test_a_join_string_in_the_setup_file_sets_the_key_the_name_and_the_first_peer() -> None:
    setup = parse_setup_text(f"peer = http://10.0.0.6:8080\njoin = http://10.0.0.5:8080/?cluster=kitchen#{KEY}\n"
                             f"peer = http://10.0.0.5:8080\n")
    assert (setup.cluster_key, setup.cluster_name) == (KEY, "kitchen")
    assert setup.peers == ("http://10.0.0.5:8080", "http://10.0.0.6:8080")
    # Said twice alike: fine. Two different names: refused.
    same = parse_setup_text(f"cluster_name = kitchen\ncluster_key = {KEY}\njoin = http://h:1/?cluster=kitchen#{KEY}")
    assert (same.cluster_key, same.cluster_name, same.peers) == (KEY, "kitchen", ("http://h:1",))
    with pytest.raises(SetupFileError, match="^ncm-setup.txt: join and cluster_name give two different cluster names"):
        parse_setup_text(f"cluster_name = garage\njoin = http://h:1/?cluster=kitchen#{KEY}\n")
    # A join string without a name leaves the name to the file.
    assert parse_setup_text(f"join = http://h:1#{KEY}\ncluster_name = garage").cluster_name == "garage"
    with pytest.raises(SetupFileError, match="line 2: join is already set on line 1"):
        parse_setup_text(f"join = http://h:1#{KEY}\njoin = http://h:2#{KEY}\n")


def test_an_invite_in_the_setup_file_is_kept_for_the_agent_to_redeem() -> None:
    join = JoinString("kitchen", "http://192.168.1.20:8080", "0123abcd0123abcd", bytes(range(24)),
                      fingerprint(KEY.encode()))
    setup = parse_setup_text(f"join = '{join.encode()}'  # from ncm invite\n")
    assert setup.invite == join.encode() and JoinString.decode(setup.invite) == join
    assert setup.cluster_key is None and setup.cluster_name is None and setup.peers == ()
    body = {"c": "kitchen", "u": "ftp://192.168.1.20", "i": "0123abcd0123abcd", "s": "00" * 24,
            "f": fingerprint(KEY.encode())}
    forged = JOIN_PREFIX + base64.urlsafe_b64encode(json.dumps(body).encode()).decode().rstrip("=")
    with pytest.raises(SetupFileError, match="line 1: join: the join string holds no valid http"):
        parse_setup_text(f"join = {forged}\n")


# --- the helpers of first boot ---------------------------------------------------------------------
def test_hostnames_and_node_ids() -> None:
    assert validate_hostname("  NCM-Kitchen ") == "ncm-kitchen"
    for bad in ("", "-a", "a-", "a_b", "a" * 64, "é"):
        with pytest.raises(ValueError, match="a hostname is 1-63"):
            validate_hostname(bad)
    node = "0123456789abcdef0123456789abcdef"
    assert default_hostname(node) == "ncm-012345" and validate_hostname(default_hostname(node)) == "ncm-012345"
    assert validate_node_id(f" {node}\n") == node
    for bad in ("0123456789ABCDEF", "0123456789a", "g" * 32, "a" * 65):
        with pytest.raises(FirstbootError, match="12-64 lowercase hex characters"):
            validate_node_id(bad)


def test_settings_of_the_file_win_even_when_false(tmp_path: Path) -> None:
    existing = {"cluster_name": "old", "cluster_key": "k" * 32, "orchestrator": True, "mdns": True, "port": 8080,
                "interfaces": ["eth0"], "peers": "not-a-list", "state_dir": "kept-state", "model": "old-model"}
    setup = parse_setup_text("cluster_name = new\norchestrator = no\nmdns = off\nport = 9090\ninterfaces =\n"
                             "peer = http://a:1\nnpu_tops = 0\n")
    config, generated = merge_config(existing, setup, state_dir=tmp_path)
    assert not generated
    assert config == {"cluster_name": "new", "cluster_key": "k" * 32, "orchestrator": False, "mdns": False,
                      "port": 9090, "interfaces": [], "peers": ["http://a:1"], "state_dir": "kept-state",
                      "model": "old-model", "npu_tops": 0.0}
    assert existing["orchestrator"] is True  # the existing mapping is left as it was
    # Nothing said: nothing changes but the defaults.
    same, generated = merge_config(existing, BootSetup(), state_dir=tmp_path)
    assert same == existing and not generated


hosts_lines = st.lists(st.sampled_from(["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost", "127.0.1.1\told",
                                        "127.0.1.1 other alias", "# 127.0.1.1 commented", "", "10.0.0.2 nas",
                                        "  127.0.0.1   localhost.localdomain"]), max_size=8)


@given(hosts_lines, hostnames, st.sampled_from(["\n", "\r\n", ""]))
def test_etc_hosts_names_this_host_once_and_keeps_every_other_line(lines: list[str], hostname: str,
                                                                    end: str) -> None:
    text = "\n".join(lines) + end
    lines = text.splitlines()
    updated = hosts_with_hostname(text, hostname)
    assert updated.endswith("\n") and hosts_with_hostname(updated, hostname) == updated
    new_lines = updated.splitlines()
    named = [line for line in new_lines if line.split()[:1] == ["127.0.1.1"]]
    assert f"127.0.1.1\t{hostname}" in new_lines
    assert len(named) == max(1, sum(line.split()[:1] == ["127.0.1.1"] for line in lines))
    others = [line for line in new_lines if line != f"127.0.1.1\t{hostname}"]
    first_named = next((i for i, line in enumerate(lines) if line.split()[:1] == ["127.0.1.1"]), None)
    assert others == [line for i, line in enumerate(lines) if i != first_named and line != f"127.0.1.1\t{hostname}"]


def test_etc_hosts_gets_the_name_after_localhost_or_first() -> None:
    assert hosts_with_hostname("127.0.0.1\tlocalhost\n::1\tlocalhost\n", "ncm-a") == (
        "127.0.0.1\tlocalhost\n127.0.1.1\tncm-a\n::1\tlocalhost\n")
    assert hosts_with_hostname("::1 localhost", "ncm-a") == "127.0.1.1\tncm-a\n::1 localhost\n"
    assert hosts_with_hostname("", "ncm-a") == "127.0.1.1\tncm-a\n"
    assert hosts_with_hostname("127.0.1.1 raspberrypi\n127.0.1.1 second\n", "ncm-a") == (
        "127.0.1.1\tncm-a\n127.0.1.1 second\n")


def test_model_names_of_the_store_are_accepted() -> None:
    for name in ("smollm2-135m", "smollm2-135m-q4", "gemma3-270m", "ncm-tiny"):
        assert MODEL_NAME.match(name) and parse_setup_text(f"model = {name}").model == name
