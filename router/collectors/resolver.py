"""Which pods there are: a static list of `host:port` and/or a DNS name resolving to every pod,
both re-resolved every `resolve_seconds`. Pod IDs are `ip:port`."""

from __future__ import annotations

import asyncio
import logging
import socket

from router.fleet import Fleet, split_hostport
from router.types import PodId

log = logging.getLogger(__name__)


class Resolver:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def resolve(self) -> set[PodId]:
        settings = self.fleet.settings
        targets = [split_hostport(t) for t in settings.pods]
        if settings.dns is not None:
            targets.append((settings.dns.name, settings.dns.port))
        loop = asyncio.get_running_loop()
        found: set[PodId] = set()
        for host, port in targets:
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                log.warning("resolve failed", extra={"target": host, "error": str(exc)})
                continue
            for family, _, _, _, addr in infos:
                ip, port_s = str(addr[0]), str(addr[1])
                found.add(f"{ip}:{port_s}" if family == socket.AF_INET else f"[{ip}]:{port_s}")
        return found

    async def run(self) -> None:
        """Resolve every `resolve_seconds`; a round that finds nothing keeps the pods known."""
        while True:
            found = await self.resolve()
            if found or not self.fleet.snapshots:
                self.fleet.set_pods(found)
            await asyncio.sleep(self.fleet.settings.resolve_seconds)
