"""The fleet's capacity, measured from the pods' own counters, for quota borrowing.

Each scrape gives a pod's cumulative served counters (router/collectors/scrape.py): tokens
(`vllm:prompt_tokens_total` + `vllm:generation_tokens_total`) and finished requests
(`vllm:request_success_total`, every `finished_reason`), and its utilisation
u = max(KV usage, (running + waiting) / max_num_seqs), where KV usage is the share of the pod's
KV cache (num_gpu_blocks × block_size tokens) in use. Over windows of at least `window_s` the
estimator takes each counter's rate r and the mean u over the window's scrapes, and keeps per pod
what it would serve at full utilisation:

- busy window (mean u ≥ `busy`): r / u, the rate extrapolated to full use. Above the estimate it
  replaces it; below, the estimate decays toward it with half-life `half_life_s`, so a pod that
  got slower (longer contexts, a throttled GPU) is noticed, while one slow window is not enough.
- quiet window: r is only a lower bound (served without being busy), so the estimate rises to
  it and never falls. An idle fleet, exactly when there is something to borrow, keeps the
  capacity it last showed.

The fleet's capacity is the sum over the pods the router would pick now, per minute. It is 0,
unknown (nothing to borrow), until pods have served something: after the router starts, and for
pods that export no counters.

Failure modes, each on the side of lending less, except the second:
- A fleet never busy is credited only with its peak observed rate (an underestimate).
- r / u assumes throughput linear in utilisation; batched decoding is concave (each sequence
  slows as the batch grows), so from u = 0.5 the estimate may be up to 2× high. The pool is at
  most 0.8 × (0.7 − load) × capacity and closes at load 0.7, which bounds what that lends.
- A counter that goes back (a restarted pod) starts a new window; the window it ends is lost.
- Tokens and requests are measured separately under the current mix: a shift to long prompts
  lowers requests per minute until busy windows show it (half-life), and prompt tokens served
  from the prefix cache count like any other, as they do in the tenants' token limits.
- Estimates live in this router's memory; replicas measure the same pods and the last one to
  publish wins.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from router.types import PodId, PodMetrics


def utilisation(metrics: PodMetrics, capacity: float) -> float:
    """0-1: the larger of KV-cache usage and sequences (running + waiting) per capacity."""
    return max(metrics.kv_usage, min(1.0, (metrics.running + metrics.waiting) / capacity))


@dataclass(slots=True)
class _Window:
    at: float
    tokens: float
    requests: float
    utilisation: float = 0.0  # summed over the window's scrapes
    scrapes: int = 0


@dataclass(slots=True)
class _Estimate:
    tokens_per_s: float = 0.0
    requests_per_s: float = 0.0


class Capacity:
    def __init__(
        self, window_s: float = 5.0, busy: float = 0.5, half_life_s: float = 600.0
    ) -> None:
        self.window_s = window_s
        self.busy = busy
        self.half_life_s = half_life_s
        self._windows: dict[PodId, _Window] = {}
        self._estimates: dict[PodId, _Estimate] = {}

    def observe(self, metrics: PodMetrics, capacity: float) -> None:
        """One successful scrape of a pod whose max_num_seqs is `capacity`."""
        tokens, requests = metrics.tokens_served, metrics.requests_served
        if tokens is None or requests is None:
            return
        pod, at = metrics.pod, metrics.at
        w = self._windows.get(pod)
        if w is None or tokens < w.tokens or requests < w.requests:
            self._windows[pod] = _Window(at, tokens, requests)
            return
        w.utilisation += utilisation(metrics, capacity)
        w.scrapes += 1
        span = at - w.at
        if span < self.window_s:
            return
        u = w.utilisation / w.scrapes
        decay = 0.5 ** (span / self.half_life_s)
        est = self._estimates.setdefault(pod, _Estimate())
        est.tokens_per_s = self._update(est.tokens_per_s, (tokens - w.tokens) / span, u, decay)
        est.requests_per_s = self._update(
            est.requests_per_s, (requests - w.requests) / span, u, decay
        )
        self._windows[pod] = _Window(at, tokens, requests)

    def _update(self, estimate: float, rate: float, u: float, decay: float) -> float:
        if u < self.busy:
            return max(estimate, rate)
        seen = rate / u
        return seen if seen >= estimate else seen + (estimate - seen) * decay

    def forget(self, pod: PodId) -> None:
        self._windows.pop(pod, None)
        self._estimates.pop(pod, None)

    def per_minute(self, pods: Iterable[PodId]) -> tuple[int, int]:
        """Tokens and requests per minute the given pods serve at full utilisation."""
        tokens = requests = 0.0
        for pod in pods:
            est = self._estimates.get(pod)
            if est is not None:
                tokens += est.tokens_per_s
                requests += est.requests_per_s
        return int(tokens * 60), int(requests * 60)
