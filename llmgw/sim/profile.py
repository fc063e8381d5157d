"""Step-time profiles: how long one engine step takes on a given GPU, in simulated seconds.

A step decodes one token for every running sequence and prefills the scheduled prompt
chunks. Its time is the inter-token latency at that batch size (piecewise linear through
published figures, extrapolated with the last slope) plus a cost per uncached prompt token.
"""

from __future__ import annotations

from bisect import bisect_right

from pydantic import model_validator

from llmgw.config import Strict


class Profile(Strict):
    # (batch size, inter-token latency in ms), batch sizes increasing from 1.
    itl_ms: tuple[tuple[int, float], ...]
    prefill_ms_per_token: float
    # API-server work before the engine sees a request (parsing, templating, tokenising).
    request_overhead_ms: float

    @model_validator(mode="after")
    def _increasing(self) -> Profile:
        sizes = [b for b, _ in self.itl_ms]
        if len(sizes) < 2 or sizes[0] != 1 or sizes != sorted(set(sizes)):
            raise ValueError("itl_ms needs >= 2 points with increasing batch sizes from 1")
        return self


PROFILES: dict[str, Profile] = {
    # Llama-3.1-8B on one H100 80 GB (issue 2): ITL 6.5 / 11 / 47 ms at batch 1 / 16 / 64,
    # TTFT ~25-40 ms + 0.15-0.3 ms per uncached prompt token.
    "h100-llama-8b": Profile(
        itl_ms=((1, 6.5), (16, 11.0), (64, 47.0)),
        prefill_ms_per_token=0.2,
        request_overhead_ms=22.0,
    ),
    # The same model on an A100 80 GB: roughly 1.6x the H100's times.
    "a100-llama-8b": Profile(
        itl_ms=((1, 10.5), (16, 17.5), (64, 75.0)),
        prefill_ms_per_token=0.35,
        request_overhead_ms=22.0,
    ),
}


def itl_seconds(profile: Profile, batch: int) -> float:
    """Decode step time for `batch` running sequences (batch >= 1)."""
    points = profile.itl_ms
    i = min(max(bisect_right(points, (batch, float("inf"))) - 1, 0), len(points) - 2)
    (b0, t0), (b1, t1) = points[i], points[i + 1]
    return (t0 + (t1 - t0) * (batch - b0) / (b1 - b0)) / 1000.0


def step_seconds(profile: Profile, batch: int, prefill_tokens: int) -> float:
    """One engine step: `batch` sequences scheduled, `prefill_tokens` of them uncached prompt."""
    return itl_seconds(profile, max(batch, 1)) + prefill_tokens * profile.prefill_ms_per_token / 1e3
