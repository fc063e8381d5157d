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

from sim.types import SimSettings

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# request_latency buckets: e2e, queue, inference, prefill and decode times share them.
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

LABELS = ["model_name", "engine"]
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")  # v1/engine FinishReason


class Histogram:
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] | tuple[int, ...]) -> None:
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
        self.prompt_tokens_cached = 0
        self.success = dict.fromkeys(FINISHED_REASONS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.queue_time = Histogram(E2E_BUCKETS)
        self.prefill_time = Histogram(E2E_BUCKETS)
        self.decode_time = Histogram(E2E_BUCKETS)
        self.inference_time = Histogram(E2E_BUCKETS)
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)


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
        # Every waiting request here waits for capacity; nothing defers one (no LoRA budget,
        # no KV transfer), so 'deferred' stays 0.
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            labels=[*LABELS, "reason"],
        )
        by_reason.add_metric([*labels, "capacity"], waiting)
        by_reason.add_metric([*labels, "deferred"], 0)
        yield by_reason
        yield self._cache_config()
        for name, doc, count in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
             "tokens.", s.prefix_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             s.prefix_hits),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             s.preemptions),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens),
            ("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
             s.prompt_tokens_cached),
            ("vllm:generation_tokens", "Number of generation tokens processed.",
             s.generation_tokens),
        ):  # fmt: skip
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            counter.add_metric(labels, count)
            yield counter
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*LABELS, "finished_reason"],
        )
        for reason, count in s.success.items():
            success.add_metric([*labels, reason], count)
        yield success
        for name, doc, hist in (
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
             s.ttft),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
             s.itl),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
             s.e2e),
            ("vllm:request_queue_time_seconds",
             "Histogram of time spent in WAITING phase for request.", s.queue_time),
            ("vllm:request_inference_time_seconds",
             "Histogram of time spent in RUNNING phase for request.", s.inference_time),
            ("vllm:request_prefill_time_seconds",
             "Histogram of time spent in PREFILL phase for request.", s.prefill_time),
            ("vllm:request_decode_time_seconds",
             "Histogram of time spent in DECODE phase for request.", s.decode_time),
            ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
             s.iteration_tokens),
        ):  # fmt: skip
            family = HistogramMetricFamily(name, doc, labels=LABELS)
            family.add_metric(labels, hist.cumulative(), hist.total)
            yield family

    def _cache_config(self) -> Metric:
        # vLLM 0.32 labels the info gauge with every CacheConfig field (str() of its value, in
        # declaration order, config/cache.py) plus `engine`, and no `model_name`.
        st = self.settings
        tokens = st.num_gpu_blocks * st.block_size
        info: dict[str, object] = {
            "block_size": st.block_size,
            "user_specified_block_size": False,
            "kv_cache_layout": None,
            "prefix_match_unit": None,
            "gpu_memory_utilization": 0.92,
            "cache_dtype": "auto",
            "is_attention_free": False,
            "num_gpu_blocks_override": None,
            "sliding_window": None,
            "enable_prefix_caching": True,
            "prefix_caching_hash_algo": "sha256",
            "prefix_cache_retention_interval": 0,
            "kv_cache_dtype_skip_layers": [],
            "mamba_page_size_padded": None,
            "skip_page_size_padded": None,
            "mamba_block_size": None,
            "mamba_cache_dtype": "auto",
            "mamba_ssm_cache_dtype": "auto",
            "mamba_cache_mode": "none",
            "enable_mamba_shared_prefix_checkpoint": False,
            "replayssm_buffer_len": 16,
            "use_replayssm": False,
            "use_kda_recoverssm": False,
            "num_gpu_blocks": st.num_gpu_blocks,
            "num_cpu_blocks": None,
            "effective_attention_block_size": st.block_size,
            "kv_cache_size_tokens": tokens,
            "kv_cache_max_concurrency": round(tokens / st.max_model_len, 2),
            # Set in the engine's process; the API server's copy, which vLLM exports, keeps None.
            "hash_block_size": None,
            "cache_hit_alignment_tokens": None,
            "kv_sharing_fast_prefill": False,
            "swa_bounded_replay": True,
            "kv_cache_memory_bytes": None,
            "kv_offloading_size": None,
            "kv_offloading_backend": "native",
            "_block_size_resolved": True,
            "engine": "0",
        }
        values = [str(v) for v in info.values()]
        gauge = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info)
        )
        gauge.add_metric(values, 1.0)
        return gauge


def registry(collector: Collector) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg
