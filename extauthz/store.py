"""The live tenants snapshot and its hot reload.

A poller compares the file's (mtime, size, inode) every `interval` seconds; on a change it parses
and validates the file off the event loop and swaps the snapshot in one assignment. Requests in
flight keep the snapshot they started with. A broken file is refused, the last good one stays.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from extauthz import metrics, tenants
from extauthz.types import Snapshot
from llmgw.config import ConfigError

log = logging.getLogger(__name__)

FileStamp = tuple[int, int, int] | None


def _stamp(path: Path) -> FileStamp:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class TenantsStore:
    def __init__(self, path: Path) -> None:
        """Load the file now; a broken file at start-up is an error, not a silent empty config."""
        self.path = path
        self._stamp = _stamp(path)
        self.current: Snapshot = tenants.load(path)
        metrics.TENANTS.set(len(self.current.tenants))

    async def reload_if_changed(self) -> bool:
        """One poll; True when a new snapshot was installed."""
        stamp = await asyncio.to_thread(_stamp, self.path)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            if stamp is None:
                raise ConfigError(f"{self.path}: file missing")
            fresh = await asyncio.to_thread(tenants.load, self.path)
        except ConfigError as exc:
            metrics.RELOADS.labels(result="failed").inc()
            log.error(
                "tenants reload refused; keeping the last good config", extra={"error": str(exc)}
            )
            return False
        self.current = fresh
        metrics.RELOADS.labels(result="ok").inc()
        metrics.TENANTS.set(len(fresh.tenants))
        log.info("tenants reloaded", extra={"tenants": len(fresh.tenants), "keys": len(fresh.keys)})
        return True

    async def watch(self, interval: float) -> None:
        """Poll until cancelled."""
        while True:
            await asyncio.sleep(interval)
            await self.reload_if_changed()
