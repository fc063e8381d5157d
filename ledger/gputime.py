"""A request's GPU time, estimated from what the gateway sees of it: how long it held its pod
(from when flow control let it go to its end, as Envoy timed it: prefill and decode included)
and the pod's batch over that time, from the router's scrapes (the fleet load's `batches`: each
scrape's running requests, llmgw/fleetload.py, read from Redis every `interval_s`). A request
that shared its pod with 31 others for 2 s used 1/32 of those 2 s:

    gpu_seconds = ∫ from start to end of dt / max(1, running(t))

`running(t)` is the pod's count at its last scrape at or before `t` (the first one known, before
any), a step function at the scrape interval (75 ms). What is approximate: the steps (a batch
that changes between scrapes is seen at the next one), vLLM's own gauge's lag, requests
waiting in the pod's queue counted as running from their start (vLLM's `running` excludes them,
so a queued request is charged time it did not compute), and a pod's GPU time split evenly among
its running requests whatever their lengths. A pod the ledger has no count of: None (unknown).
`bench/gputime.py` measures the error against the simulator's exact accounting.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math

from pydantic import ValidationError

from llmgw import wire
from llmgw.fleetload import FleetLoad
from llmgw.link import RedisLink
from llmgw.resp import RespError

log = logging.getLogger("ledger.gputime")


class Batches:
    """Each pod's running requests over the last `history_s`, as published."""

    def __init__(self, history_s: float = 900.0, max_pods: int = 4096) -> None:
        self.history_s = history_s
        self.max_pods = max_pods
        self._times: dict[str, list[float]] = {}
        self._counts: dict[str, list[float]] = {}
        self._last = 0.0  # the last publication's time

    def observe(self, load: FleetLoad) -> None:
        """One publication; a publication read again (the key not yet rewritten) adds nothing."""
        if load.ts <= self._last:
            return
        self._last = load.ts
        for pod, samples in load.batches.items():
            times = self._times.get(pod)
            if times is None:
                if len(self._times) >= self.max_pods:
                    continue
                times = self._times[pod] = []
                self._counts[pod] = []
            counts = self._counts[pod]
            for at, running in samples:
                if not times or at > times[-1]:  # in order; another replica's may overlap
                    times.append(at)
                    counts.append(running)
        cutoff = load.ts - self.history_s
        for pod in list(self._times):
            times = self._times[pod]
            # Keep the last count before the cutoff: it holds until the next one.
            old = bisect.bisect_left(times, cutoff) - 1
            if old > 0:
                del times[:old]
                del self._counts[pod][:old]
            if not times or times[-1] < cutoff:  # a pod gone from the fleet
                del self._times[pod], self._counts[pod]

    def gpu_seconds(self, pod: str, start: float, end: float) -> float | None:
        """The GPU time of a request on `pod` from `start` to `end` (Unix seconds)."""
        times = self._times.get(pod)
        if not times or end <= start:
            return None if not times else 0.0
        counts = self._counts[pod]
        # The count in force at `start` (the first known, before any), then each next one.
        i = max(bisect.bisect_right(times, start) - 1, 0)
        total, at = 0.0, start
        while at < end:
            upto = min(times[i + 1] if i + 1 < len(times) else math.inf, end)
            total += (upto - at) / max(1.0, counts[i])
            at, i = upto, i + 1
        return total


async def follow(redis: RedisLink, batches: Batches, interval_s: float) -> None:
    """Read the fleet load every `interval_s` until cancelled; a failed read is skipped (the
    counts then hold for longer)."""
    while True:
        try:
            async with asyncio.timeout(interval_s):
                client = await redis.get()
                raw = await client.call("GET", wire.FLEET_LOAD_KEY)
            if isinstance(raw, bytes):
                batches.observe(FleetLoad.model_validate_json(raw))
        except (TimeoutError, ConnectionError, OSError, RespError, ValidationError) as exc:
            log.debug("fleet load not read", extra={"error": repr(exc)})
        await asyncio.sleep(interval_s)
