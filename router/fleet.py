"""The fleet as the router sees it: pods, their latest metrics, in-flight counts, fleet load.

Pods come from config: a static list of `host:port` and/or a DNS name resolving to every pod,
both re-resolved every `resolve_seconds` (pod IDs are `ip:port`, what Envoy's override_host
matches). Every pod's `/metrics` is scraped concurrently every `scrape_interval` with a short
timeout; each scrape replaces the pod's immutable `PodMetrics` and feeds the pod's speed estimate
(router/speed.py), which every candidate carries. A pod is pickable only when its
last scrape succeeded and it has not answered `error_threshold` requests in a row with 5xx (then
it is out for `error_cooldown` seconds, doubled each time it fails again before answering well,
up to 16x). A pick that Envoy had to retry on another pod (the `upstream.address` Envoy reports
with the response headers is not the pick) counts as a 5xx of the picked pod. Metrics older than
`stale_after` count as fully loaded.

The fleet load (llmgw/fleetload.py) is published to Redis every `publish_interval` seconds, with
a TTL of `publish_ttl` seconds, for the rate limiter's borrowing pool.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

import aiohttp
from pydantic import Field, field_validator

from llmgw import wire
from llmgw.config import Strict
from llmgw.fleetload import FleetLoad
from llmgw.link import RedisLink
from llmgw.resp import RespError
from llmgw.secret import Secret
from router import metrics
from router.capacity import Capacity, utilisation
from router.scrape import fetch_models, scrape_metrics
from router.speed import Speeds
from router.types import Candidate, PodId, PodMetrics

log = logging.getLogger(__name__)
MAX_COOLDOWN_DOUBLINGS = 4


def split_hostport(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"pod {target!r} is not host:port")
    return host.strip("[]"), int(port)


class DnsTarget(Strict):
    name: str
    port: int


class FleetSettings(Strict):
    pods: list[str] = Field(default_factory=list)  # "host:port"
    dns: DnsTarget | None = None
    resolve_seconds: float = Field(default=5.0, gt=0)
    scrape_interval: float = Field(default=0.075, gt=0)
    scrape_timeout: float = Field(default=0.05, gt=0)
    models_interval: float = Field(default=5.0, gt=0)
    stale_after: float = Field(default=0.5, gt=0)
    capacity: float = Field(
        default=32.0, gt=0
    )  # concurrent sequences a pod runs well (max_num_seqs)
    capacities: dict[str, float] = Field(default_factory=dict)  # per pod ID override
    error_threshold: int = Field(default=3, ge=1)
    error_cooldown: float = Field(default=2.0, gt=0)
    publish_interval: float = Field(default=1.0, gt=0)
    publish_ttl: float = Field(default=10.0, gt=0)
    # A pick counts as in flight until its outcome arrives, or for this long: it only has to
    # cover the time until the pod's own counts (running, waiting; scraped every
    # `scrape_interval`) show the request, and past that it counts twice. The bound matters
    # with several replicas: Check calls are spread over them, but each Envoy worker's
    # access-log stream goes to one, so most outcomes reach a replica that did not pick.
    in_flight_ttl: float = Field(default=10.0, gt=0)
    # The pods' vLLM --api-key, sent with every scrape: /v1/models needs it (/metrics does not).
    pod_api_key: Secret | None = None

    @field_validator("pods")
    @classmethod
    def _host_ports(cls, pods: list[str]) -> list[str]:
        for pod in pods:  # refused here, not when the fleet first resolves (a crash at start)
            split_hostport(pod)
        return pods


class Fleet:
    def __init__(
        self, settings: FleetSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.snapshots: dict[PodId, PodMetrics] = {}
        self.in_flight: dict[PodId, int] = {}
        self._errors: dict[PodId, int] = {}
        self._trips: dict[PodId, int] = {}  # times taken out since the pod last answered well
        self._down_until: dict[PodId, float] = {}
        self._models_at: dict[PodId, float] = {}
        self._flights: OrderedDict[str, tuple[PodId, float]] = OrderedDict()  # by request ID
        self._probed_at: dict[PodId, float] = {}  # last pick of a pod on probation
        self.capacity = Capacity()
        self.speeds = Speeds()

    # Membership.

    def set_pods(self, pods: Iterable[PodId]) -> None:
        wanted = set(pods)
        for pod in set(self.snapshots) - wanted:
            del self.snapshots[pod]
            tables = (
                self.in_flight,
                self._errors,
                self._trips,
                self._down_until,
                self._models_at,
                self._probed_at,
            )
            for table in tables:
                table.pop(pod, None)
            self.capacity.forget(pod)
            self.speeds.forget(pod)
        for pod in wanted - set(self.snapshots):
            self.snapshots[pod] = PodMetrics(pod, float("-inf"), ok=False)
            self.in_flight[pod] = 0

    async def resolve(self) -> set[PodId]:
        targets = [split_hostport(t) for t in self.settings.pods]
        if self.settings.dns is not None:
            targets.append((self.settings.dns.name, self.settings.dns.port))
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

    # The pick's view.

    def pickable(self, pod: PodId, now: float) -> bool:
        snap = self.snapshots.get(pod)
        return snap is not None and snap.ok and self._usable(pod, now)

    def _usable(self, pod: PodId, now: float) -> bool:
        """Not in a cooldown; and after one, on probation: one pick at a time until a pick
        answers well (outcomes come late, batched: without this, every pick made while the
        probe's answer is on its way would go to a pod that may still be failing)."""
        if self._down_until.get(pod, 0.0) > now:
            return False
        if not self._trips.get(pod) or self.in_flight.get(pod, 0) == 0:
            return True
        # A probe whose outcome is lost must not keep the pod out: one more per base cooldown.
        return now - self._probed_at.get(pod, float("-inf")) >= self.settings.error_cooldown

    def candidates(self) -> list[Candidate]:
        now = self.clock()
        stale_after = self.settings.stale_after
        caps = self.settings.capacities
        default_cap = self.settings.capacity
        flight = self.in_flight
        speeds = self.speeds.current
        return [
            Candidate.of(
                snap,
                snap.ok and self._usable(pod, now),
                snap.ok and now - snap.at <= stale_after,
                flight[pod],
                caps.get(pod, default_cap),
                speeds.get(pod, 1.0),
            )
            for pod, snap in self.snapshots.items()
        ]

    def candidate(self, pod: PodId) -> Candidate | None:
        """One pod as `candidates()` shows it; None if it is not in the fleet."""
        snap = self.snapshots.get(pod)
        if snap is None:
            return None
        now = self.clock()
        return Candidate.of(
            snap,
            snap.ok and self._usable(pod, now),
            snap.ok and now - snap.at <= self.settings.stale_after,
            self.in_flight[pod],
            self.settings.capacities.get(pod, self.settings.capacity),
            self.speeds.current.get(pod, 1.0),
        )

    def acquire(self, pod: PodId, request_id: str | None = None) -> None:
        """Count a pick in flight; with a request ID, until `finish(request_id)` (or the TTL)."""
        if pod not in self.in_flight:
            return
        self.in_flight[pod] += 1
        metrics.in_flight(pod).inc()
        if self._trips.get(pod):
            self._probed_at[pod] = self.clock()
        if request_id:
            now = self.clock()
            self._flights[request_id] = (pod, now)
            self._expire(now)

    def finish(self, request_id: str) -> PodId | None:
        """The request's outcome arrived: release its pick; the pod it was sent to, if known."""
        flight = self._flights.pop(request_id, None)
        if flight is None:
            return None
        self.release(flight[0])
        return flight[0]

    def _expire(self, now: float) -> None:
        while self._flights:
            request_id, (pod, at) = next(iter(self._flights.items()))
            if now - at < self.settings.in_flight_ttl:
                return
            del self._flights[request_id]
            self.release(pod)

    def release(self, pod: PodId) -> None:
        if self.in_flight.get(pod, 0) > 0:
            self.in_flight[pod] -= 1
            metrics.in_flight(pod).dec()

    def report(self, pod: PodId, status: int) -> None:
        """An upstream reply seen by the router: consecutive 5xx take the pod out for a while."""
        if pod not in self.snapshots:
            return
        if status < 500:
            self._errors[pod] = 0
            self._trips[pod] = 0
            return
        if self.clock() < self._down_until.get(pod, float("-inf")):
            # Already out: these are picks made before it was taken out (their outcomes come
            # late, from the access log), not new evidence. They must not lengthen its penalty.
            return
        self._errors[pod] = self._errors.get(pod, 0) + 1
        on_probation = self._trips.get(pod, 0) > 0  # one failed probe is enough
        if on_probation or self._errors[pod] >= self.settings.error_threshold:
            trips = self._trips.get(pod, 0)
            cooldown = self.settings.error_cooldown * 2 ** min(trips, MAX_COOLDOWN_DOUBLINGS)
            self._down_until[pod] = self.clock() + cooldown
            self._trips[pod] = trips + 1
            self._errors[pod] = 0

    # Scraping.

    async def scrape_once(self, session: aiohttp.ClientSession) -> None:
        """Every pod once. A scrape that fails in a way no pod should cause is logged and counts
        as a failed scrape of that pod: one pod's page never stops the others' scrapes."""
        pods = list(self.snapshots)
        results = await asyncio.gather(
            *(self._scrape(session, pod) for pod in pods), return_exceptions=True
        )
        for pod, result in zip(pods, results, strict=True):
            if isinstance(result, Exception):
                log.error("scrape failed", extra={"pod": pod, "error": repr(result)})
                metrics.SCRAPE_ERRORS.labels(pod).inc()

    async def _scrape(self, session: aiohttp.ClientSession, pod: PodId) -> None:
        s = self.settings
        started = self.clock()
        old = self.snapshots.get(pod)
        models = old.models if old is not None else frozenset()
        if started - self._models_at.get(pod, float("-inf")) >= s.models_interval or not models:
            fetched = await fetch_models(session, pod, s.scrape_timeout * 4)
            if fetched is not None:
                models = fetched
                self._models_at[pod] = started
        snap = await scrape_metrics(session, pod, s.scrape_timeout, started, models)
        if pod not in self.snapshots:  # removed while scraping
            return
        if snap.ok:
            self.snapshots[pod] = snap
            self.capacity.observe(snap, s.capacities.get(pod, s.capacity))
            self.speeds.observe(snap)
            metrics.SPEED.labels(pod).set(self.speeds.current.get(pod, 1.0))
        else:
            metrics.SCRAPE_ERRORS.labels(pod).inc()
            self.snapshots[pod] = PodMetrics(pod, started, ok=False, models=models)
        metrics.PICKABLE.labels(pod).set(1.0 if self.pickable(pod, self.clock()) else 0.0)

    def scrape_session(self) -> aiohttp.ClientSession:
        """A session for the scrapes, sending the pods' key when they ask for one."""
        key = self.settings.pod_api_key
        headers = {} if key is None else {"authorization": f"Bearer {key.get_secret_value()}"}
        return aiohttp.ClientSession(headers=headers)

    async def run_scrapes(self) -> None:
        interval = self.settings.scrape_interval
        async with self.scrape_session() as session:
            while True:
                started = self.clock()
                await self.scrape_once(session)
                await asyncio.sleep(max(0.0, interval - (self.clock() - started)))

    async def run_resolver(self) -> None:
        while True:
            found = await self.resolve()
            if found or not self.snapshots:
                self.set_pods(found)
            await asyncio.sleep(self.settings.resolve_seconds)

    # Fleet load.

    def load(self) -> FleetLoad:
        now = self.clock()
        utils: list[float] = []
        pickable: list[PodId] = []
        for c in self.candidates():
            if c.healthy and c.fresh:
                pickable.append(c.pod)
                utils.append(utilisation(c.metrics, c.capacity))
            else:
                utils.append(1.0)
            age = now - c.metrics.at
            metrics.SCRAPE_AGE.labels(c.pod).set(age if age != float("inf") else -1.0)
        load = sum(utils) / len(utils) if utils else 1.0
        metrics.FLEET_LOAD.set(load)
        tpm, rpm = self.capacity.per_minute(pickable)
        return FleetLoad(
            load=round(load, 4), capacity_tpm=tpm, capacity_rpm=rpm, ts=round(time.time(), 3)
        )

    async def run_publisher(self, redis: RedisLink) -> None:
        """Write `load()` to Redis every `publish_interval`; Redis errors are logged, not fatal
        (the next round connects again)."""
        s = self.settings
        while True:
            payload = self.load().model_dump_json()
            try:
                async with asyncio.timeout(s.publish_interval):  # connecting included
                    client = await redis.get()
                    await client.call(
                        "SET", wire.FLEET_LOAD_KEY, payload, "PX", int(s.publish_ttl * 1000)
                    )
            except (TimeoutError, ConnectionError, OSError, RespError) as exc:
                log.warning("fleet load publish failed", extra={"error": repr(exc)})
            await asyncio.sleep(s.publish_interval)
