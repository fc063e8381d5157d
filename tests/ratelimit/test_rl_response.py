"""Headers and 429 bodies, as the OpenAI SDK reads them."""

from __future__ import annotations

import json

import pytest

from ratelimit.response import go_duration, rate_headers, refusal
from ratelimit.types import KindState, Unit, Verdict


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0s"),
        (120, "120ms"),
        (1000, "1s"),
        (1500, "1.5s"),
        (360_000, "6m0s"),
        (61_250, "1m1.25s"),
        (3_723_000, "1h2m3s"),
    ],
)
def test_go_duration(ms: int, text: str) -> None:
    assert go_duration(ms) == text


REQ = KindState("requests", 60, Unit.MINUTE, 0, 6_000, 60, 1)
TOK = KindState("tokens", 150_000, Unit.MINUTE, 149_984, 360_000, 16, 385)


def verdict(**kw: object) -> Verdict:
    base: dict[str, object] = dict(
        tenant="acme",
        tier="free",
        refusal=None,
        refused=None,
        requests=REQ,
        tokens=TOK,
        retry_after_ms=0,
        shadow=False,
    )
    return Verdict(**(base | kw))  # type: ignore[arg-type]


def test_rate_headers_on_every_response() -> None:
    assert dict(rate_headers(verdict())) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "6s",
        "x-ratelimit-limit-tokens": "150000",
        "x-ratelimit-remaining-tokens": "149984",
        "x-ratelimit-reset-tokens": "6m0s",
    }
    assert rate_headers(verdict(shadow=True)) == []


def test_rate_limit_429() -> None:
    headers, body = refusal(verdict(refusal="requests", refused=REQ, retry_after_ms=1644))
    assert dict(headers) == {
        "content-type": "application/json",
        "retry-after": "2",
        "retry-after-ms": "1644",
    }
    error = json.loads(body)["error"]
    assert error["type"] == "requests" and error["code"] == "rate_limit_exceeded"
    assert error["param"] is None
    assert error["message"] == (
        "Rate limit reached for tenant acme on requests per minute: Limit 60, Used 60, "
        "Requested 1. Please try again in 1.644s."
    )


def test_insufficient_quota_429() -> None:
    budget = KindState("tokens", 1000, Unit.DAY, 0, 0, 990, 385)
    headers, body = refusal(verdict(refusal="insufficient_quota", refused=budget))
    assert ("x-should-retry", "false") in headers
    assert not any(name.startswith("retry-after") for name, _ in headers)
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
    assert "990" in error["message"] and "1000" in error["message"]
