"""mDNS discovery with python-zeroconf's asyncio API: advertise this agent as
`_ncm._tcp.local.` and feed the URLs of agents of the same cluster to the membership.

mDNS only finds peers; whether a peer is alive is decided by contacting it (membership).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from agent.cluster.addresses import choose_addresses
from agent.core.advert import SERVICE_TYPE, NodeAdvert, decode_txt, encode_txt
from agent.core.errors import WireError

if TYPE_CHECKING:
    from agent.cluster.membership import Membership

log = logging.getLogger(__name__)
LOOKUP_TIMEOUT_MS = 3000


class Discovery:
    """One zeroconf instance per process: registration, browsing and TXT updates."""

    def __init__(self, membership: Membership, interfaces: tuple[str, ...] = ()) -> None:
        self.membership = membership
        self.addresses = choose_addresses(interfaces)
        self.aiozc: AsyncZeroconf | None = None
        self.browser: AsyncServiceBrowser | None = None
        self.info: AsyncServiceInfo | None = None
        self._lookups: set[asyncio.Task[None]] = set()
        self._advertised: dict[str, str] | None = None

    def _service_info(self, advert: NodeAdvert) -> AsyncServiceInfo:
        properties = encode_txt(advert)
        return AsyncServiceInfo(
            SERVICE_TYPE,
            f"ncm-{advert.node_id[:12]}.{SERVICE_TYPE}",
            port=advert.api_port,
            properties=properties,
            server=f"ncm-{advert.node_id[:12]}.local.",
            parsed_addresses=self.addresses,
        )

    async def start(self) -> None:
        if not self.addresses:
            log.warning("mDNS: no usable network interface; relying on static peers")
            return
        self.aiozc = AsyncZeroconf(interfaces=self.addresses, ip_version=IPVersion.V4Only)
        advert = self.membership.advert()
        self.info = self._service_info(advert)
        await self.aiozc.async_register_service(self.info, allow_name_change=True)
        self._advertised = encode_txt(advert)
        self.browser = AsyncServiceBrowser(self.aiozc.zeroconf, SERVICE_TYPE, handlers=[self._on_change])
        log.info("mDNS: advertising %s on %s", self.info.name, ", ".join(self.addresses))

    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            task = asyncio.get_running_loop().create_task(self._lookup(name))
            self._lookups.add(task)
            task.add_done_callback(self._lookups.discard)

    async def _lookup(self, name: str) -> None:
        assert self.aiozc is not None
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(self.aiozc.zeroconf, LOOKUP_TIMEOUT_MS):
            return
        try:
            advert = decode_txt(info.properties)
        except WireError as error:
            log.debug("mDNS: ignoring %s: %s", name, error)
            return
        if advert.cluster != self.membership.config.cluster_name or advert.node_id == self.membership.node_id:
            return
        for address in info.parsed_addresses(IPVersion.V4Only):
            self.membership.discovered(f"http://{address}:{advert.api_port}", "mdns")
            break

    async def refresh(self) -> None:
        """Re-advertise when role, epoch or capacity changed."""
        if self.aiozc is None or self.info is None:
            return
        advert = self.membership.advert()
        properties = encode_txt(advert)
        if properties == self._advertised:
            return
        self.info = self._service_info(advert)
        await self.aiozc.async_update_service(self.info)
        self._advertised = properties

    async def run(self) -> None:
        """Keep the TXT record current (owned by the service's cleanup context)."""
        changes = self.membership.subscribe()
        while True:
            await changes.wait()
            changes.clear()
            await self.refresh()

    async def stop(self) -> None:
        for task in list(self._lookups):
            task.cancel()
        if self.browser is not None:
            await self.browser.async_cancel()
        if self.aiozc is not None:
            if self.info is not None:
                await self.aiozc.async_unregister_service(self.info)  # goodbye packets
            await self.aiozc.async_close()
