"""agent.cluster.addresses: which IPv4 addresses of this device the cluster uses — on this
machine's real interfaces, and on interface lists made of ifaddr's own adapter objects (the
Docker bridges, VPN tunnels and link-local addresses a test machine may not have)."""

from __future__ import annotations

import ipaddress

import ifaddr
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.cluster.addresses import VIRTUAL_PREFIXES, choose_addresses


def adapter(name: str, *ips: str | tuple[str, int, int]) -> ifaddr.Adapter:
    return ifaddr.Adapter(name, name, [ifaddr.IP(ip, 24 if isinstance(ip, str) else 64, name) for ip in ips])


HOME = [
    adapter("lo", "127.0.0.1", ("::1", 0, 0)),
    adapter("eth0", "192.168.1.20", ("fe80::1", 0, 2), "169.254.10.1"),
    adapter("docker0", "172.17.0.1"),
    adapter("veth12ab", "172.17.0.2"),
    adapter("br-5f2e", "172.18.0.1"),
    adapter("wlan0", "10.0.0.7"),
    adapter("wg0", "10.8.0.2"),
    adapter("tailscale0", "100.64.0.3"),
    adapter("br0", "192.168.2.1"),
]


@pytest.fixture
def home_interfaces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ifaddr, "get_adapters", lambda: HOME)


def test_by_default_every_real_interface_and_no_virtual_one(home_interfaces: None) -> None:
    assert choose_addresses() == ["192.168.1.20", "10.0.0.7", "192.168.2.1"]


def test_named_interfaces_are_used_even_virtual_ones_in_the_order_of_the_system(home_interfaces: None) -> None:
    assert choose_addresses(("wg0", "eth0")) == ["192.168.1.20", "10.8.0.2"]
    assert choose_addresses(("lo",)) == ["127.0.0.1"]
    assert choose_addresses(("eth1",)) == []


def test_link_local_and_ipv6_addresses_are_never_used(home_interfaces: None) -> None:
    for wanted in ((), ("eth0",)):
        chosen = choose_addresses(wanted)
        assert "169.254.10.1" not in chosen and "192.168.1.20" in chosen
        assert all(isinstance(address, str) and ipaddress.ip_address(address).version == 4 for address in chosen)


def test_on_this_machine_loopback_is_left_out_unless_named() -> None:
    real = ifaddr.get_adapters()
    chosen = choose_addresses()
    assert not any(ipaddress.ip_address(address).is_loopback for address in chosen)
    assert not any(ipaddress.ip_address(address).is_link_local for address in chosen)
    by_name = {a.nice_name: [ip.ip for ip in a.ips if isinstance(ip.ip, str)] for a in real}
    for address in chosen:
        assert any(address in ips and not name.startswith(VIRTUAL_PREFIXES) for name, ips in by_name.items())
    loopback = next((a.nice_name for a in real if any(ip.ip == "127.0.0.1" for ip in a.ips)), None)
    if loopback is None:
        pytest.skip("this machine has no 127.0.0.1 on any interface")
    assert "127.0.0.1" in choose_addresses((loopback,))
    assert choose_addresses(("no-such-interface",)) == []


names = st.one_of(st.sampled_from(VIRTUAL_PREFIXES).map(lambda prefix: prefix + "0"),
                  st.sampled_from(["eth0", "enp3s0", "wlan0", "br0", "end0", "usb0"]))
ipv4 = st.ip_addresses(v=4).map(str)
ipv6 = st.ip_addresses(v=6).map(lambda address: (str(address), 0, 0))
adapters = st.lists(st.tuples(names, st.lists(st.one_of(ipv4, ipv6), max_size=4)), max_size=6,
                    unique_by=lambda item: item[0])


@given(adapters, st.lists(names, max_size=3))
def test_the_choice_is_every_usable_ipv4_address_of_the_chosen_interfaces(
        listed: list[tuple[str, list[str | tuple[str, int, int]]]], wanted: list[str]) -> None:
    system = [adapter(name, *ips) for name, ips in listed]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ifaddr, "get_adapters", lambda: system)
        chosen = choose_addresses(tuple(wanted))
    used = [a for a in system if (a.nice_name in wanted if wanted else not a.nice_name.startswith(VIRTUAL_PREFIXES))]
    expected = [ip.ip for a in used for ip in a.ips
                if isinstance(ip.ip, str) and not ipaddress.ip_address(ip.ip).is_link_local]
    assert chosen == expected
