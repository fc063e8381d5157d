"""vLLM V1's Prometheus metrics, rendered from the engine's plain counters at scrape time.

Names, labels (`model_name`, `engine`) and histogram buckets are vLLM's. Times are simulated
seconds: what the profiled GPU would show, whatever the pod's time scale.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from llmgw.sim.types import SimSettings

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

LABELS = ["model_name", "engine"]


class Histogram:
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += count
            out.append((bound, float(running)))
        return out


class Stats:
    """What the engine counts; read only when /metrics is scraped."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)


# (running, waiting, kv usage 0-1), read from the engine at scrape time.
Gauges = Callable[[], tuple[int, int, float]]


class Collector:
    def __init__(self, settings: SimSettings, stats: Stats, gauges: Gauges) -> None:
        self.settings = settings
        self.stats = stats
        self.gauges = gauges
        self.labels = [settings.model, "0"]

    def collect(self) -> Iterator[Metric]:
        s, labels = self.stats, self.labels
        running, waiting, usage = self.gauges()
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(name, doc, labels=LABELS)
            gauge.add_metric(labels, value)
            yield gauge
        yield self._cache_config()
        for name, doc, count in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
             "tokens.", s.prefix_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             s.prefix_hits),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             s.preemptions),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.",
             s.generation_tokens),
        ):  # fmt: skip
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            counter.add_metric(labels, count)
            yield counter
        for name, doc, hist in (
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
             s.ttft),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
             s.itl),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
             s.e2e),
        ):  # fmt: skip
            family = HistogramMetricFamily(name, doc, labels=LABELS)
            family.add_metric(labels, hist.cumulative(), hist.total)
            yield family

    def _cache_config(self) -> Metric:
        # vLLM's info gauge carries CacheConfig fields and `engine`, but no `model_name`.
        info = {
            "block_size": str(self.settings.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "gpu_memory_utilization": "0.9",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(self.settings.num_gpu_blocks),
            "engine": "0",
        }
        gauge = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info)
        )
        gauge.add_metric(list(info.values()), 1.0)
        return gauge


def registry(collector: Collector) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg
