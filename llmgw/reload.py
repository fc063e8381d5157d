"""A config file's parsed value, kept current while the service runs.

A poller compares the files' (mtime, size, inode) every `interval` seconds; on a change it parses
and validates them off the event loop and swaps the value in one assignment. Requests in flight
keep the value they started with. A broken file is refused and the last good value stays, with
an error log line and `llmgw_config_reloads_total{config, result="failed"}`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

from prometheus_client import Counter

from llmgw.config import ConfigError

log = logging.getLogger(__name__)

RELOADS = Counter(
    "llmgw_config_reloads_total",
    "Config file reloads by config and result (ok, failed: the last good one stays).",
    ["config", "result"],
)

T = TypeVar("T")
Stamp = tuple[tuple[int, int, int] | None, ...]


def stamp(paths: Sequence[Path]) -> Stamp:
    out: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            out.append(None)
        else:
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


class Reloading(Generic[T]):
    """`load(previous)` of `paths`, reloaded when any of them changes (previous: the value in
    force, None at start-up)."""

    def __init__(self, name: str, paths: Sequence[Path], load: Callable[[T | None], T]) -> None:
        """Load now: a broken file at start-up is an error, not a silent empty config."""
        self.name = name
        self.paths = tuple(paths)
        self._load = load
        self._stamp = stamp(self.paths)
        self.current: T = load(None)

    def get(self) -> T:
        """The value in force, for a reader handed this method (it reads the latest swap)."""
        return self.current

    async def reload_if_changed(self) -> bool:
        """One poll; True when a new value was installed."""
        now = await asyncio.to_thread(stamp, self.paths)
        if now == self._stamp:
            return False
        self._stamp = now
        try:
            missing = [str(p) for p, s in zip(self.paths, now, strict=True) if s is None]
            if missing:
                raise ConfigError(f"{', '.join(missing)}: file missing")
            fresh = await asyncio.to_thread(self._load, self.current)
        except ConfigError as exc:
            RELOADS.labels(self.name, "failed").inc()
            log.error(
                "config reload refused; keeping the last good one",
                extra={"config": self.name, "error": str(exc)},
            )
            return False
        self.current = fresh
        RELOADS.labels(self.name, "ok").inc()
        log.info("config reloaded", extra={"config": self.name})
        return True

    async def watch(self, interval: float) -> None:
        """Poll until cancelled; nothing a file holds ends the watch (the next edit may fix it)."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self.reload_if_changed()
            except Exception:  # a loader's bug must not end hot reload silently
                RELOADS.labels(self.name, "failed").inc()
                log.exception("config reload failed; keeping the last good one")
