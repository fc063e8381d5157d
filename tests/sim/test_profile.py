"""The default profile matches the issue's published H100 figures for an 8B model."""

from __future__ import annotations

import pytest

from llmgw.sim.profile import PROFILES, Profile, itl_seconds, step_seconds

H100 = PROFILES["h100-llama-8b"]


@pytest.mark.parametrize(("batch", "itl_ms"), [(1, 6.5), (16, 11.0), (64, 47.0)])
def test_itl_matches_published_figures(batch: int, itl_ms: float) -> None:
    assert itl_seconds(H100, batch) * 1e3 == pytest.approx(itl_ms, rel=0.15)


def test_itl_grows_with_batch_and_extrapolates() -> None:
    times = [itl_seconds(H100, b) for b in (1, 2, 8, 16, 32, 64, 128, 256)]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert itl_seconds(H100, 128) == pytest.approx(0.047 + 64 * 0.00075)


@pytest.mark.parametrize("prompt", [1, 100, 1000])
def test_ttft_is_25_to_40_ms_plus_a_cost_per_prompt_token(prompt: int) -> None:
    ttft = H100.request_overhead_ms / 1e3 + step_seconds(H100, 1, prompt - 1)
    low, high = 0.025 + 0.00015 * prompt, 0.040 + 0.0003 * prompt
    assert low <= ttft <= high


def test_profiles_reject_bad_points() -> None:
    with pytest.raises(ValueError, match="increasing batch sizes"):
        Profile(itl_ms=((2, 1.0), (1, 2.0)), prefill_ms_per_token=0.1, request_overhead_ms=1)
