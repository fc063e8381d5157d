"""The datastore: the pods the router knows and their state (each pod's latest metrics, its
requests in flight, its health, speed, measured capacity and models' contexts), and the
candidates a pick reads.

The collectors (router/collectors/) write it: the pods from the resolver, their metrics and
models from the scraper, their replies from the outcome feed; the pick (router/lifecycle.py),
the fleet-load publisher (router/publisher.py) and extauthz's output cap (router/contexts.py)
read it. Pod IDs are `ip:port`, what Envoy's override_host matches. A pod is pickable only when
its last scrape succeeded and its health allows it (router/health.py); metrics older than
`stale_after` count as fully loaded.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Literal

from pydantic import Field, field_validator

from llmgw.config import Strict
from llmgw.secret import Secret
from router import metrics
from router.capacity import Capacity
from router.contexts import Contexts
from router.health import Health
from router.kvindex import KvIndex
from router.speed import Speeds
from router.types import Candidate, PodId, PodMetrics


def split_hostport(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"pod {target!r} is not host:port")
    return host.strip("[]"), int(port)


class DnsTarget(Strict):
    name: str
    port: int


class KvEndpoint(Strict):
    # ZMQ addresses: tcp://host:port, ipc:///path
    publish: str = Field(pattern=r"^(tcp://[^\s]+:\d+|ipc:///.+)$")
    replay: str | None = Field(default=None, pattern=r"^(tcp://[^\s]+:\d+|ipc:///.+)$")


class KvEventSettings(Strict):
    """Where the pods publish their KV events (vLLM's `--kv-events-config`; the router connects,
    the pods bind): on every pod's own host at `port` (and `replay_port`), as in Kubernetes and
    compose, or per pod ID at `endpoints` (a local stack's pods, each on paths of its own)."""

    port: int | None = Field(default=None, ge=1, le=65535)
    replay_port: int | None = Field(default=None, ge=1, le=65535)
    endpoints: dict[str, KvEndpoint] = Field(default_factory=dict)
    topic: str = ""
    # How long a replay of missed batches may take; past it the pod's entries are dropped.
    replay_timeout: float = Field(default=1.0, gt=0)
    # A pod reporting more blocks than this is forgotten (an H100 serving an 8B model holds
    # ~28,000; ~100 bytes each in the index).
    max_blocks_per_pod: int = Field(default=1 << 20, ge=1)
    # The most bytes one message may have (a step's batch: ~10 bytes a prompt token); a larger
    # one ends the connection (ZMQ), which drops the pod's entries.
    max_message_bytes: int = Field(default=16 << 20, ge=1024)
    # The most a replay may bring (vLLM buffers 10,000 batches); past it, what came is used.
    max_replay_bytes: int = Field(default=64 << 20, ge=1024)

    def endpoint(self, pod: str) -> KvEndpoint | None:
        found = self.endpoints.get(pod)
        if found is not None or self.port is None:
            return found
        host, _ = split_hostport(pod)
        host = f"[{host}]" if ":" in host else host
        replay = None if self.replay_port is None else f"tcp://{host}:{self.replay_port}"
        return KvEndpoint(publish=f"tcp://{host}:{self.port}", replay=replay)


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
    # A pick reaches a pod's counts (running, waiting) this long after it is made, at most
    # (Envoy, the pod's API server): a scrape that started later shows it. Until then flow
    # control counts it on top of the scrape (`unseen`), so that the seats one scrape shows
    # free are not given out again at every check until the next. Sooner when a scrape shows
    # that requests arrived since the one before (running + waiting grew by more than the
    # requests that finished): that many of the oldest picks made before it are seen.
    dispatch_lag: float = Field(default=0.1, ge=0)
    # An outcome that does not say when its request ended (ext_proc's) reaches the router at
    # most this long after: one that arrives sooner after a scrape may be shown by it already,
    # and frees no seat before the next (else that seat counts twice).
    outcome_lag: float = Field(default=0.03, ge=0)
    # The pods' vLLM --api-key, sent with every scrape: /v1/models needs it (/metrics does not).
    pod_api_key: Secret | None = None
    # The pods' KV events (router/collectors/kvevents.py); None: the approximate map only.
    kv_events: KvEventSettings | None = None
    # Where the scraper and the KV-event subscriber run: in a process of their own (the pick's
    # event loop never waits for them; router/collectors/process.py), or on the pick's loop.
    collectors: Literal["process", "inline"] = "process"

    @field_validator("pods")
    @classmethod
    def _host_ports(cls, pods: list[str]) -> list[str]:
        for pod in pods:  # refused here, not when the fleet first resolves (a crash at start)
            split_hostport(pod)
        return pods


# The speeds are recomputed when a pick reads them after a scrape changed them, and at least
# this often for the gauge (a router that picks nothing still shows them).
SPEEDS_SHOWN_EVERY = 1.0


class Fleet:
    def __init__(
        self, settings: FleetSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.snapshots: dict[PodId, PodMetrics] = {}
        cap = settings.kv_events.max_blocks_per_pod if settings.kv_events else 1
        self.kv = KvIndex(cap)  # what each pod's KV events say it holds
        self.in_flight: dict[PodId, int] = {}
        self._flights: OrderedDict[str, tuple[PodId, float]] = OrderedDict()  # by request ID
        self.health = Health(settings.error_threshold, settings.error_cooldown)
        self.capacity = Capacity()
        self.speeds = Speeds()
        self.speeds.changed = _show_speeds
        self._speeds_shown = float("-inf")  # when the scrapes last refreshed the speeds' gauge
        self._served: frozenset[str] | None = None
        self._served_known = False  # _served is current (the pods' model lists did not change)
        self.contexts = Contexts()
        # Each pod's picks made too recently for its latest scrape to show (pick times).
        self._unseen: dict[PodId, deque[float]] = {}
        # Each pod's requests that ended after its latest scrape started (their end times).
        self._ended: dict[PodId, deque[float]] = {}
        # Told the pod of every scrape stored (flow control: seats may have freed).
        self.listeners: list[Callable[[PodId], None]] = []

    def set_pods(self, pods: Iterable[PodId]) -> None:
        wanted = set(pods)
        for pod in set(self.snapshots) - wanted:
            del self.snapshots[pod]
            self.in_flight.pop(pod, None)
            self._unseen.pop(pod, None)
            self._ended.pop(pod, None)
            self.health.forget(pod)
            self.capacity.forget(pod)
            self.speeds.forget(pod)
            self.contexts.forget(pod)
            self.kv.drop(pod)
        for pod in wanted - set(self.snapshots):
            metrics.SPEED.labels(pod).set(1.0)  # until its latency says otherwise
            self.snapshots[pod] = PodMetrics(pod, float("-inf"), ok=False)
            self.in_flight[pod] = 0
            self._unseen[pod] = deque()
            self._ended[pod] = deque()
        self._served_known = False

    def store(self, snap: PodMetrics) -> None:
        """A pod's latest scrape (dropped if the pod left meanwhile); a good one also feeds the
        pod's capacity and speed estimates."""
        pod = snap.pod
        old = self.snapshots.get(pod)
        if old is None:
            return
        self.snapshots[pod] = snap
        if snap.models != old.models:
            self._served_known = False
        self.contexts.observe(pod, snap.contexts)
        if snap.ok:
            self.capacity.observe(snap, self.capacity_of(pod))
            self.speeds.observe(snap)
            if snap.at - self._speeds_shown >= SPEEDS_SHOWN_EVERY:  # picks or not
                self._speeds_shown = snap.at
                _ = self.speeds.current
            unseen, seen_before = self._unseen[pod], snap.at - self.settings.dispatch_lag
            arrived = _arrivals(old, snap)
            while unseen and (unseen[0] < seen_before or (arrived > 0 and unseen[0] < snap.at)):
                unseen.popleft()
                arrived -= 1
            ended = self._ended[pod]
            if ended:  # those that ended before this scrape started: it shows them
                self._ended[pod] = deque(t for t in ended if t >= snap.at)
        metrics.PICKABLE.labels(pod).set(1.0 if self.pickable(pod, self.clock()) else 0.0)
        for listener in self.listeners:
            listener(pod)

    def capacity_of(self, pod: PodId) -> float:
        """The sequences the pod runs at once (its max_num_seqs, as configured): its seats."""
        return self.settings.capacities.get(pod, self.settings.capacity)

    def unseen(self, pod: PodId) -> int:
        """The pod's picks its latest scrape may not show yet, less the requests that ended
        there since (their outcomes arrived after it): the seats that scrape shows taken
        wrongly, negative when more ended than it can show."""
        found, ended = self._unseen.get(pod), self._ended.get(pod)
        return (0 if found is None else len(found)) - (0 if ended is None else len(ended))

    def ended(self, pod: PodId, at: float | None = None) -> None:
        """A request this pod ran has ended (its outcome), `at` then on this clock (None: not
        known): its seat is free until a scrape that started later shows it. A scrape that
        started after the end shows it already; without `at`, one that started within
        `outcome_lag` before the outcome arrived may."""
        ended, snap, now = self._ended.get(pod), self.snapshots.get(pod), self.clock()
        if ended is None or snap is None or not snap.ok:
            return
        if at is None:
            at = now - self.settings.outcome_lag
        # At most a pod's seats (its scrapes may stop while it still answers).
        if snap.at < at and len(ended) < self.capacity_of(pod):
            ended.append(min(at, now))

    def report(self, pod: PodId, status: int) -> None:
        """A reply of a known pod, for its health."""
        if pod in self.snapshots:
            self.health.report(pod, status, self.clock())

    def served_models(self) -> frozenset[str] | None:
        """The models the fleet serves (each pod's /v1/models); None while any pod's list is
        not known (a pod not yet read could serve anything). Computed when a list changes."""
        if not self._served_known:
            lists = [snap.models for snap in self.snapshots.values()]
            known = bool(lists) and all(lists)
            self._served = frozenset().union(*lists) if known else None
            self._served_known = True
        return self._served

    # The pick's view.

    def pickable(self, pod: PodId, now: float) -> bool:
        snap = self.snapshots.get(pod)
        return snap is not None and snap.ok and self._usable(pod, now)

    def _usable(self, pod: PodId, now: float) -> bool:
        return self.health.usable(pod, now, self.in_flight.get(pod, 0))

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
            self.capacity_of(pod),
            self.speeds.current.get(pod, 1.0),
        )

    # Requests in flight.

    def acquire(self, pod: PodId, request_id: str | None = None) -> None:
        """Count a pick in flight; with a request ID, until `finish(request_id)` (or the TTL)."""
        if pod not in self.in_flight:
            return
        self.in_flight[pod] += 1
        metrics.in_flight(pod).inc()
        now = self.clock()
        self._unseen[pod].append(now)
        self.health.picked(pod, now)
        if request_id:
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

    def withdraw(self, pod: PodId) -> None:
        """A pick given back before it went to the pod: it will never show in its counts."""
        unseen = self._unseen.get(pod)
        if unseen:
            unseen.pop()

    def release(self, pod: PodId) -> None:
        if self.in_flight.get(pod, 0) > 0:
            self.in_flight[pod] -= 1
            metrics.in_flight(pod).dec()


def _show_speeds(speeds: dict[PodId, float]) -> None:
    for pod, speed in speeds.items():
        metrics.SPEED.labels(pod).set(speed)


def _arrivals(old: PodMetrics, new: PodMetrics) -> int:
    """Requests that reached the pod between two scrapes: its running and waiting counts' growth
    plus the requests it finished; 0 where unknown (no earlier scrape, no finished counter)."""
    if not old.ok or old.requests_served is None or new.requests_served is None:
        return 0
    finished = new.requests_served - old.requests_served
    if finished < 0:  # its counters restarted
        return 0
    return int(new.running + new.waiting - old.running - old.waiting + finished)
