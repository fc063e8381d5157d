"""The speed estimate: recent mean inter-token latency relative to the fastest pod."""

from __future__ import annotations

import pytest

from router.speed import Speeds
from router.types import PodMetrics


def itl(pod: str, at: float, seconds: float, count: float) -> PodMetrics:
    return PodMetrics(pod, at, ok=True, itl_seconds=seconds, itl_count=count)


def feed(speeds: Speeds, at: float, per_pod: dict[str, tuple[float, float]]) -> None:
    for pod, (seconds, count) in per_pod.items():
        speeds.observe(itl(pod, at, seconds, count))


def test_a_half_speed_pod_is_at_half_and_pods_without_tokens_are_left_out() -> None:
    speeds = Speeds(min_tokens=50)
    feed(speeds, 0.0, {"a": (0.0, 0), "b": (0.0, 0), "c": (0.0, 0)})
    feed(speeds, 1.0, {"a": (1.0, 100), "b": (2.0, 100), "c": (0.1, 10)})
    assert speeds.current == {"a": 1.0, "b": 0.5}  # c: 10 tokens are not enough to tell


def test_recent_latency_counts_more_than_old() -> None:
    speeds = Speeds(half_life_s=1.0)
    feed(speeds, 0.0, {"a": (0.0, 0), "b": (0.0, 0)})
    feed(speeds, 1.0, {"a": (1.0, 100), "b": (2.0, 100)})
    assert speeds.current["b"] == 0.5
    # b recovers: ten half-lives of b at a's speed outweigh its slow past.
    feed(speeds, 11.0, {"a": (11.0, 1100), "b": (12.0, 1100)})
    assert speeds.current["b"] == 1.0


def test_a_speed_moves_only_by_whole_steps() -> None:
    speeds = Speeds(half_life_s=1e9, step=0.1)
    feed(speeds, 0.0, {"a": (0.0, 0), "b": (0.0, 0)})
    feed(speeds, 1.0, {"a": (1.0, 100), "b": (2.0, 100)})
    assert speeds.current["b"] == 0.5
    feed(speeds, 2.0, {"a": (2.0, 200), "b": (3.8, 200)})  # b's mean now 19 ms: 0.53
    assert speeds.current["b"] == 0.5
    feed(speeds, 3.0, {"a": (3.0, 300), "b": (4.8, 300)})  # 16 ms: 0.625, a step away
    assert speeds.current["b"] == pytest.approx(0.6)


def test_a_restarted_pod_starts_over() -> None:
    speeds = Speeds()
    feed(speeds, 0.0, {"a": (0.0, 0), "b": (0.0, 0)})
    feed(speeds, 1.0, {"a": (1.0, 100), "b": (2.0, 100)})
    feed(speeds, 2.0, {"b": (0.0, 0)})  # restarted: its counters went back
    assert speeds.current == {"a": 1.0}  # left out (full speed) until it has tokens again
    feed(speeds, 3.0, {"a": (2.0, 200), "b": (1.0, 100)})  # now as fast as a, from zero
    assert speeds.current["b"] == 1.0
    speeds.forget("b")
    assert speeds.current == {"a": 1.0}
