"""Which of this device's addresses the cluster uses: the named interfaces, else every one
that is not virtual (Docker and VM bridges, VPN tunnels, loopback)."""

from __future__ import annotations

import ifaddr

VIRTUAL_PREFIXES = ("lo", "docker", "veth", "br-", "virbr", "vnet", "tun", "tap", "wg", "zt", "tailscale", "cni", "flannel")


def choose_addresses(wanted: tuple[str, ...] = ()) -> list[str]:
    """IPv4 addresses of the interfaces to use: the named ones, else every non-virtual one."""
    addresses = []
    for adapter in ifaddr.get_adapters():
        name = adapter.nice_name
        if wanted and name not in wanted:
            continue
        if not wanted and name.startswith(VIRTUAL_PREFIXES):
            continue
        addresses += [ip.ip for ip in adapter.ips if isinstance(ip.ip, str) and not ip.ip.startswith("169.254.")]
    return addresses
