"""The capacity estimate from sequences of scraped counters (router/capacity.py)."""

from __future__ import annotations

import pytest

from router.capacity import Capacity
from router.collectors.scrape import parse_metrics
from router.types import PodMetrics

CAP = 10.0  # max_num_seqs


def scrape(
    at: float, tokens: float, requests: float, running: float = 0, kv: float = 0.0
) -> PodMetrics:
    return PodMetrics(
        "a:1",
        at,
        ok=True,
        running=running,
        kv_usage=kv,
        tokens_served=tokens,
        requests_served=requests,
    )


def serve(
    est: Capacity,
    seconds: int,
    tokens_per_s: float,
    requests_per_s: float,
    running: float,
    start: tuple[float, float, float] = (0.0, 0.0, 0.0),
) -> tuple[float, float, float]:
    """One scrape a second at steady rates; the (time, tokens, requests) reached."""
    at, tokens, requests = start
    for _ in range(seconds):
        at, tokens, requests = at + 1, tokens + tokens_per_s, requests + requests_per_s
        est.observe(scrape(at, tokens, requests, running), CAP)
    return at, tokens, requests


def test_a_busy_pod_is_extrapolated_to_full_utilisation() -> None:
    est = Capacity(window_s=5)
    est.observe(scrape(0, 0, 0), CAP)
    serve(est, 5, tokens_per_s=1000, requests_per_s=2, running=8)  # u = 0.8
    assert est.per_minute(["a:1"]) == (75_000, 150)  # 1000 / 0.8 × 60, 2 / 0.8 × 60


def test_kv_usage_counts_as_utilisation() -> None:
    est = Capacity(window_s=5)
    est.observe(scrape(0, 0, 0), CAP)
    for at in range(1, 6):  # few sequences, but a full KV cache: busy at u = 1
        est.observe(scrape(at, at * 500, at, running=1, kv=1.0), CAP)
    assert est.per_minute(["a:1"]) == (30_000, 60)


def test_a_quiet_pod_only_raises_the_estimate() -> None:
    est = Capacity(window_s=5)
    est.observe(scrape(0, 0, 0), CAP)
    point = serve(est, 5, tokens_per_s=100, requests_per_s=1, running=1)  # u = 0.1: lower bound
    assert est.per_minute(["a:1"]) == (6_000, 60)
    point = serve(est, 5, 200, 1, running=2, start=point)
    assert est.per_minute(["a:1"]) == (12_000, 60)
    serve(est, 50, 0, 0, running=0, start=point)  # idle: the fleet keeps what it showed
    assert est.per_minute(["a:1"]) == (12_000, 60)


def test_busy_windows_below_the_estimate_decay_toward_them() -> None:
    est = Capacity(window_s=5, half_life_s=5)
    est.observe(scrape(0, 0, 0), CAP)
    point = serve(est, 5, 1000, 4, running=10)  # u = 1: 1000 tokens/s
    point = serve(est, 5, 600, 4, running=10, start=point)  # slower now, one half-life
    assert est.per_minute(["a:1"])[0] == pytest.approx((600 + 400 / 2) * 60, abs=1)
    for _ in range(10):
        point = serve(est, 5, 600, 4, running=10, start=point)
    assert est.per_minute(["a:1"])[0] == pytest.approx(600 * 60, rel=0.01)


def test_a_counter_reset_starts_a_new_window() -> None:
    est = Capacity(window_s=5)
    est.observe(scrape(0, 0, 0), CAP)
    serve(est, 5, 100, 1, running=1)
    est.observe(scrape(6, 10, 0), CAP)  # the pod restarted: counters back near 0
    serve(est, 5, 100, 1, running=1, start=(6, 10, 0))
    assert est.per_minute(["a:1"]) == (6_000, 60)  # never a negative or huge rate


def test_unknown_until_served_and_only_for_the_pods_asked() -> None:
    est = Capacity(window_s=5)
    assert est.per_minute(["a:1"]) == (0, 0)
    est.observe(PodMetrics("a:1", 0, ok=True), CAP)  # a pod that exports no counters
    est.observe(PodMetrics("a:1", 9, ok=True), CAP)
    assert est.per_minute(["a:1"]) == (0, 0)
    est.observe(scrape(10, 0, 0), CAP)
    serve(est, 5, 100, 1, running=1, start=(10, 0, 0))
    assert est.per_minute([]) == (0, 0)
    est.forget("a:1")
    assert est.per_minute(["a:1"]) == (0, 0)


def test_parse_served_counters_of_the_simulated_pod() -> None:
    text = (
        'vllm:prompt_tokens_total{engine="0",model_name="m"} 700.0\n'
        'vllm:generation_tokens_total{engine="0",model_name="m"} 300.0\n'
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 4.0\n'
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 1.0\n'
        'vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 2.0\n'
    )
    p = parse_metrics(text)
    assert (p.tokens_served, p.requests_served) == (1000.0, 7.0)
    none = parse_metrics('vllm:num_requests_running{engine="0"} 1\n')
    assert (none.tokens_served, none.requests_served) == (None, None)
