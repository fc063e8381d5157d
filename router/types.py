"""The router's nouns: pod metrics snapshots, per-pick candidates and pick requests."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

PodId = str  # "ip:port", exactly what Envoy's override_host matches


@dataclass(frozen=True, slots=True)
class PodMetrics:
    """One scrape of one pod, immutable. `at` is a monotonic timestamp; `ok` is False when the
    scrape failed or the pod answered with an error (the pod is then unpickable)."""

    pod: PodId
    at: float
    ok: bool
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    # Cumulative counters: prompt + generation tokens, finished requests (None: not exported).
    tokens_served: float | None = None
    requests_served: float | None = None
    # Cumulative inter-token latency histogram sum (seconds) and count: the pod's speed.
    itl_seconds: float | None = None
    itl_count: float | None = None
    models: frozenset[str] = frozenset()
    # Each model's max_model_len as /v1/models gives it (a model without one: not here).
    contexts: Mapping[str, int] = field(default_factory=dict)

    def fresh(self, threshold: float, now: float) -> bool:
        return self.ok and now - self.at <= threshold

    @property
    def kv_tokens(self) -> int | None:
        if self.block_size is None or self.num_gpu_blocks is None:
            return None
        return self.block_size * self.num_gpu_blocks


@dataclass(slots=True)
class Candidate:
    """A pod as a pick sees it: its snapshot plus the router's own in-flight count.

    Stale metrics count as fully loaded: `kv` 1, `queue` at capacity, `load` at least 1.
    `speed` is the pod's decode speed relative to the fastest pod (router/speed.py), 0-1.
    """

    pod: PodId
    metrics: PodMetrics
    healthy: bool  # scrape ok and no recent error replies
    fresh: bool
    in_flight: int
    capacity: float  # concurrent sequences the pod runs well (config)
    kv: float
    queue: float
    load: float  # (running + in flight) / capacity
    speed: float = 1.0
    # The request's leading KV blocks the pod holds, per its KV events (router/kvindex.py);
    # None: the pod publishes none in the request's block size (the approximate map decides).
    kv_held: int | None = None

    @classmethod
    def of(
        cls,
        metrics: PodMetrics,
        healthy: bool,
        fresh: bool,
        in_flight: int,
        capacity: float,
        speed: float = 1.0,
    ) -> Candidate:
        if fresh:
            kv = metrics.kv_usage
            queue = metrics.waiting
            load = (metrics.running + in_flight) / capacity
        else:
            kv, queue, load = 1.0, capacity, 1.0 + in_flight / capacity
        return cls(
            metrics.pod, metrics, healthy, fresh, in_flight, capacity, kv, queue, load, speed
        )


@dataclass(frozen=True, slots=True)
class PickRequest:
    """What a pick knows about the request: tenant context from extauthz, model, prompt blocks."""

    model: str | None = None
    tenant: str | None = None
    priority: int | None = None  # 1-10, 10 highest (extauthz)
    session: str | None = None
    request_id: str | None = None
    prefix_blocks: tuple[int, ...] = field(default=())  # chained hashes of the leading blocks
    prompt_tokens: int = 0  # the whole prompt (estimate): its KV is more than the hashed blocks
    # The pods' own hashes of its leading blocks of kv_block_size tokens (llmgw/kvblocks.py):
    # looked up in what each pod's KV events say it holds (router/kvindex.py).
    kv_blocks: tuple[int, ...] = field(default=())
    kv_block_size: int = 0
    # The body is known and carries no earlier turn (no assistant message): no pod holds this
    # session's KV yet, so session affinity has nothing to keep.
    first_turn: bool = False


@dataclass(frozen=True, slots=True)
class Pick:
    """The answer: pods best first, and why the first was chosen ("best" or "explore")."""

    pods: tuple[PodId, ...]
    reason: str


def endpoints(pods: tuple[PodId, ...]) -> str:
    """The pick as the endpoint picker protocol writes it: "ip:port,ip:port", best first."""
    return ",".join(pods)
