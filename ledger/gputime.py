"""A request's GPU time, estimated from what the gateway sees of it: how long it held its pod
(from when flow control let it go to its end, as Envoy timed it: prefill and decode included)
and the pod's batch over that time, from the router's scrapes (each scrape's running requests:
llmgw/podbatches.py, read from the routers' Redis stream every `interval_s`). A request that
shared its pod with 31 others for 2 s used 1/32 of those 2 s:

    gpu_seconds = ∫ from start to end of dt / max(1, running(t))

`running(t)` is the pod's count at its last scrape at or before `t` (the first one known, before
any): a step function at the scrape interval (75 ms). What is approximate: the steps and vLLM's
own gauge lag the batch, time a request spent in the pod's own queue or API server counts as
shared, and a pod's time is split evenly among its running requests whatever their lengths.
A pod the ledger has no count of: None (unknown). `bench/gputime.py` measures the error against
the simulator's exact accounting.

Bounded: `history_s` of each pod's changes of count (a scrape that repeats the last count adds
nothing), at most `max_pods` pods; a scrape from the future (a replica's clock ahead by more
than `FUTURE_S`) is ignored. Each estimate is two binary searches over a running integral.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from array import array
from collections.abc import Callable

from pydantic import ValidationError

from llmgw import wire
from llmgw.link import RedisLink
from llmgw.podbatches import PodBatches
from llmgw.resp import Reply, RespError

log = logging.getLogger("ledger.gputime")

FUTURE_S = 5.0
_READ_COUNT = 256  # stream entries a read takes at most


class PodSeries:
    """One pod's count over time, and the running integral of 1 / max(1, count)."""

    __slots__ = ("areas", "counts", "seen", "times")

    def __init__(self) -> None:
        self.times = array("d")  # when the count changed
        self.counts = array("d")
        self.areas = array("d")  # ∫ from times[0] to times[i]
        self.seen = 0.0  # the latest scrape

    def add(self, at: float, running: float) -> None:
        times, counts, areas = self.times, self.counts, self.areas
        if at <= self.seen:
            return  # another replica's scrape of a time already known
        self.seen = at
        if times:
            if running == counts[-1]:
                return
            areas.append(areas[-1] + (at - times[-1]) / max(1.0, counts[-1]))
        else:
            areas.append(0.0)
        times.append(at)
        counts.append(running)

    def trim(self, before: float) -> None:
        """Forget what changed before `before`, keeping the count in force then."""
        old = bisect.bisect_left(self.times, before) - 1
        if old > 0:
            del self.times[:old], self.counts[:old], self.areas[:old]

    def area(self, at: float) -> float:
        """∫ from times[0] to `at` (negative before it: the first count held back)."""
        i = max(bisect.bisect_right(self.times, at) - 1, 0)
        return self.areas[i] + (at - self.times[i]) / max(1.0, self.counts[i])


class Batches:
    """Each pod's running requests over the last `history_s`, from the routers' scrapes."""

    def __init__(
        self,
        history_s: float = 900.0,
        max_pods: int = 1024,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.history_s = history_s
        self.max_pods = max_pods
        self.clock = clock
        self._pods: dict[str, PodSeries] = {}

    def observe(self, batches: PodBatches) -> None:
        now = self.clock()
        for pod, scrapes in batches.pods.items():
            series = self._pods.get(pod)
            if series is None:
                if len(self._pods) >= self.max_pods:
                    continue
                series = self._pods[pod] = PodSeries()
            for at, running in scrapes:
                if at <= now + FUTURE_S:
                    series.add(at, running)
        cutoff = now - self.history_s
        for pod in list(self._pods):
            series = self._pods[pod]
            series.trim(cutoff)
            if series.seen < cutoff:  # gone from the fleet
                del self._pods[pod]

    def gpu_seconds(self, pod: str, start: float, end: float) -> float | None:
        """The GPU time of a request on `pod` from `start` to `end` (Unix seconds)."""
        series = self._pods.get(pod)
        if series is None:
            return None
        return max(series.area(end) - series.area(start), 0.0)


async def follow(redis: RedisLink, batches: Batches, interval_s: float) -> None:
    """Read the routers' stream from its oldest entry kept, then what each adds, every
    `interval_s` until cancelled; a failed read is retried at the next (the stream keeps the
    entries), an entry that breaks the contract is skipped."""
    last = "0-0"
    while True:
        try:
            async with asyncio.timeout(interval_s):
                client = await redis.get()
                while True:
                    entries = _entries(
                        await client.call(
                            "XREAD", "COUNT", str(_READ_COUNT), "STREAMS",
                            wire.POD_BATCHES_KEY, last,
                        )
                    )  # fmt: skip
                    for entry_id, payload in entries:
                        last = entry_id
                        _observe(batches, payload)
                    if len(entries) < _READ_COUNT:
                        break
        except (TimeoutError, ConnectionError, OSError, RespError) as exc:
            log.debug("pod batches not read", extra={"error": repr(exc)})
        await asyncio.sleep(interval_s)


def _entries(reply: Reply) -> list[tuple[str, bytes]]:
    """XREAD's reply for one stream: (entry ID, its payload) in order; [] when none."""
    if not isinstance(reply, list) or not reply or not isinstance(reply[0], list):
        return []
    stream = reply[0]
    found = stream[1] if len(stream) > 1 and isinstance(stream[1], list) else []
    entries = []
    for entry in found:
        if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], bytes):
            fields = entry[1]
            payload = fields[1] if isinstance(fields, list) and len(fields) > 1 else b""
            entries.append((entry[0].decode(), payload if isinstance(payload, bytes) else b""))
    return entries


def _observe(batches: Batches, payload: bytes) -> None:
    try:
        batches.observe(PodBatches.model_validate_json(payload))
    except ValidationError as exc:
        log.debug("pod batches entry refused", extra={"error": repr(exc)})
