"""Rate limits through the real stack: Envoy, extauthz, ratelimit, Redis and simulated pods.

One stack with small limits (tests/… limits below) serves the module; each test adds a tenant of
its own to the tenants file, so counters never mix. Redis is read directly to check counters.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import openai
import pytest

from extauthz import tenants
from extauthz.types import PerMinuteLimits, Tenant, TenantsFile
from tests.e2e.conftest import api_key, stack_settings
from tests.eventually import eventually
from tests.http import Reply, call
from tools.stack import Stack

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LIMITS = """
tiers:
  free: {requests: {second: 2}, tokens: {minute: 1000000}, retry_base_s: 0.5}
  standard: {requests: {second: 1000}, tokens: {minute: 1000000}}
  capped: {requests: {second: 1000}, tokens: {minute: 1000000}, budget: {tokens: 60, per: day}}
"""
RATE_HEADERS = [
    f"x-ratelimit-{what}-{kind}"
    for kind in ("requests", "tokens")
    for what in ("limit", "remaining", "reset")
]


@pytest.fixture(scope="module")
def rl_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    state = tmp_path_factory.mktemp("rl-stack")
    (state / "limits-src.yaml").write_text(LIMITS)
    settings = stack_settings().model_copy(
        update={
            "tiers_file": state / "limits-src.yaml",
        }
    )
    with Stack(settings, state / "stack") as running:
        yield running


def add_tenant(
    stack: Stack, tenant_id: str, tier: str, limits: PerMinuteLimits | None = None
) -> str:
    """A tenant with one fresh key, once extauthz has reloaded the file (bounded wait)."""
    with tenants.editing(stack.tenants_file):
        data = tenants.read(stack.tenants_file)
        key, record = tenants.new_key(datetime.now(UTC).replace(microsecond=0))
        limits = limits or PerMinuteLimits()
        tenant = Tenant(
            id=tenant_id, name=tenant_id, tier=tier, priority=5, models="*", limits=limits,
            keys=(record,),
        )  # fmt: skip
        tenants.write(stack.tenants_file, TenantsFile(tenants=(*data.tenants, tenant)))
    loaded = lambda: call("GET", f"{stack.base_url}/models", headers=auth(key)).status != 401  # noqa: E731
    eventually(loaded, 10, "extauthz did not load the new tenant")
    return key


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def chat(stack: Stack, key: str, max_tokens: int | None = 8, **extra: object) -> Reply:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    return call(
        "POST", f"{stack.base_url}/chat/completions", {**body, "max_tokens": max_tokens}, auth(key)
    )


def counter(stack: Stack, tenant: str, check: str = "tokens:minute") -> int:
    with stack.redis_client() as r:
        keys = r.keys(f"llmgw:rl:{{{tenant}}}:{check}:*")
        return sum(int(v) for v in r.mget(keys) if v is not None) if keys else 0


def reservations(stack: Stack, tenant: str) -> list[bytes]:
    with stack.redis_client() as r:
        return list(r.keys(f"llmgw:rl:{{{tenant}}}:res:*"))


def logged_tokens(stack: Stack, tenant: str, requests: int) -> list[int | None]:
    """Each access-log line's usage for the tenant, once `requests` lines are there (bounded)."""
    deadline = time.monotonic() + 10
    while True:
        lines = [json.loads(line) for line in stack.access_log.read_text().splitlines()]
        mine = [
            line
            for line in lines
            if line["tenant"] == tenant and line["path"].endswith("/completions")
        ]
        if len(mine) >= requests or time.monotonic() > deadline:
            return [_tokens(line) for line in mine]
        time.sleep(0.05)


def _tokens(line: dict[str, str]) -> int | None:
    """The pod's usage as the access log shows it (prompt + completion); None when absent."""
    if line["prompt_tokens"] is None or line["completion_tokens"] is None:
        return None
    return int(line["prompt_tokens"]) + int(line["completion_tokens"])


def reloads(stack: Stack, result: str) -> float:
    """The count of tier-table reloads with this result where the limiter runs: inside extauthz,
    the tenants snapshot's (the process's one load of the table: the limiter reads it there)."""
    with urllib.request.urlopen(stack.metrics["ratelimit"], timeout=5) as r:
        text = r.read().decode()
    line = f'llmgw_config_reloads_total{{config="tenants",result="{result}"}} '
    return sum(float(x[len(line) :]) for x in text.splitlines() if x.startswith(line))


def test_tokens_are_reserved_at_admission_and_settled_to_the_json_usage(rl_stack: Stack) -> None:
    key = add_tenant(rl_stack, "rl-json", "standard")
    reply = chat(rl_stack, key, max_tokens=20)
    assert reply.status == 200
    usage = reply.json()["usage"]["total_tokens"]
    # The reservation (extauthz's estimate, a string in metadata) was counted before the pod ran.
    estimate = 1_000_000 - int(reply.headers["x-ratelimit-remaining-tokens"])
    assert estimate > 0 and estimate != usage
    eventually(lambda: counter(rl_stack, "rl-json") == usage, 10.0, "settled to the actual usage")
    assert reservations(rl_stack, "rl-json") == []


async def test_streams_settle_to_their_actual_usage_and_hide_forced_usage(rl_stack: Stack) -> None:
    key = add_tenant(rl_stack, "rl-stream", "standard")
    client = openai.AsyncOpenAI(base_url=rl_stack.base_url, api_key=key, max_retries=0)

    async def stream(i: int) -> tuple[bool, list[openai.types.chat.ChatCompletionChunk]]:
        asked = i % 2 == 0
        options = {"stream_options": {"include_usage": True}} if asked else {}
        chunks = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"tell me {i}" * (i + 1)}],
            max_tokens=5 + 3 * i,
            stream=True,
            extra_body={"ignore_eos": True},
            **options,  # type: ignore[arg-type]
        )
        return asked, [chunk async for chunk in chunks]

    async with client:
        results = await asyncio.gather(*(stream(i) for i in range(8)))
    for asked, chunks in results:
        with_usage = [c for c in chunks if c.usage is not None]
        assert len(with_usage) == (1 if asked else 0)  # no extra chunk for those who did not ask
        assert all(c.choices for c in chunks if c.usage is None)
    logged = logged_tokens(rl_stack, "rl-stream", 8)
    assert len(logged) == 8 and all(isinstance(t, int) and t > 0 for t in logged)  # usage known
    reported = sorted(chunks[-1].usage.total_tokens for asked, chunks in results if asked)  # type: ignore[union-attr]
    assert set(reported) <= set(logged)
    eventually(lambda: counter(rl_stack, "rl-stream") == sum(logged), 10.0, "sum of actual usage")  # type: ignore[arg-type]
    assert reservations(rl_stack, "rl-stream") == []


def test_sdk_gets_rate_limit_error_then_retries_after_retry_after(rl_stack: Stack) -> None:
    key = add_tenant(rl_stack, "rl-sdk", "free")  # 2 requests per second
    bare = openai.OpenAI(base_url=rl_stack.base_url, api_key=key, max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    with bare, pytest.raises(openai.RateLimitError) as refused:
        for _ in range(4):
            bare.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    response = refused.value.response
    assert response.headers["content-type"] == "application/json"
    assert 1 <= int(response.headers["retry-after"]) <= 2
    assert int(response.headers["retry-after-ms"]) >= 1000
    assert all(name in response.headers for name in RATE_HEADERS)
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert "rl-sdk" in error["message"] and "Limit 2" in error["message"]

    # Fill the second again until a request is refused: the window is full right now (however
    # slow the machine), so the next one is refused, waited for and served.
    bare = openai.OpenAI(base_url=rl_stack.base_url, api_key=key, max_retries=0)
    with bare, pytest.raises(openai.RateLimitError):
        for _ in range(10):
            bare.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    started = time.monotonic()
    # The SDK's defaults.
    with openai.OpenAI(base_url=rl_stack.base_url, api_key=key) as retrying:
        raw = retrying.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages,
            max_tokens=2,  # type: ignore[arg-type]
        )
    assert raw.http_response.status_code == 200
    assert raw.retries_taken >= 1
    assert time.monotonic() - started >= 0.9  # it waited what retry-after-ms said


def test_a_request_that_can_never_fit_is_too_large_and_the_sdk_does_not_retry(
    rl_stack: Stack,
) -> None:
    key = add_tenant(rl_stack, "rl-large", "standard", PerMinuteLimits(tpm=1000))
    client = openai.OpenAI(base_url=rl_stack.base_url, api_key=key)  # the SDK's 2 retries
    long = [{"role": "user", "content": "word " * 1000}]  # ~1,250 tokens: above 1,000 a minute
    with client, pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=MODEL, messages=long)  # type: ignore[arg-type]
    response = refused.value.response
    assert response.headers["x-should-retry"] == "false"
    error = response.json()["error"]
    assert error["message"].startswith("Request too large") and "Limit 1000" in error["message"]
    logged_tokens(rl_stack, "rl-large", 1)
    time.sleep(1.5)  # Envoy's file log flushes at least every second: any retry would be there
    assert logged_tokens(rl_stack, "rl-large", 1) == [None]  # one attempt, never retried
    # An SDK-default request (no max_tokens) still fits: the gateway's cap stays within 1,000.
    short = chat(rl_stack, key, max_tokens=None)
    assert short.status == 200, short.body


def test_exhausted_budget_is_insufficient_quota_and_not_retried(rl_stack: Stack) -> None:
    key = add_tenant(rl_stack, "rl-capped", "capped")  # a budget of 60 tokens a day
    # The cap the pod gets fits the budget (estimated prompt + output ≤ 60), so the first
    # request is served, cut at that cap; settling its real usage spends the budget.
    first = chat(rl_stack, key, max_tokens=50)
    assert first.status == 200, first.body
    assert first.json()["usage"]["completion_tokens"] < 50
    assert first.json()["choices"][0]["finish_reason"] == "length"
    reply = chat(rl_stack, key, max_tokens=50)
    assert reply.status == 429
    assert reply.headers["content-type"] == "application/json"
    assert reply.headers["x-should-retry"] == "false"
    error = reply.json()["error"]
    assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")


def test_tenant_limits_from_the_tenants_file_reach_the_limiter(rl_stack: Stack) -> None:
    # add_tenant's readiness probe is the first of 4 requests a minute.
    key = add_tenant(rl_stack, "rl-own", "standard", PerMinuteLimits(rpm=4, tpm=5000))
    replies = [chat(rl_stack, key) for _ in range(4)]
    assert [r.status for r in replies] == [200, 200, 200, 429]
    assert replies[0].headers["x-ratelimit-limit-requests"] == "4"
    assert replies[0].headers["x-ratelimit-limit-tokens"] == "5000"
    assert replies[3].json()["error"]["type"] == "requests"


def test_the_tier_table_reloads_in_every_service_and_a_broken_one_is_refused(
    rl_stack: Stack,
) -> None:
    table = rl_stack.tiers_file
    assert table is not None and table == rl_stack.settings.tiers_file  # not a copy
    original = table.read_text()
    try:
        # extauthz refuses a tenants file naming a tier the table lacks: add the tier first.
        ok, failed = reloads(rl_stack, "ok"), reloads(rl_stack, "failed")
        table.write_text(original + "  late: {requests: {minute: 3}, tokens: {minute: 100000}}\n")
        eventually(lambda: reloads(rl_stack, "ok") > ok, 10.0, "extauthz did not reload the tiers")
        key = add_tenant(rl_stack, "rl-late", "late")  # waits for extauthz to take it
        assert [chat(rl_stack, key).status for _ in range(3)] == [200, 200, 429]  # probe + 2
        table.write_text("tiers: {late: {requests: {minute: nope}}}")  # refused by both
        eventually(
            lambda: reloads(rl_stack, "failed") > failed, 10.0, "the broken table went unseen"
        )
        assert chat(rl_stack, key).status == 429  # the last good table is still in force
        table.write_text(original + "  late: {requests: {minute: 5}, tokens: {minute: 100000}}\n")
        eventually(lambda: chat(rl_stack, key).status == 200, 10.0, "ratelimit kept the old limit")
    finally:  # rl-late stays in the tenants file, so its tier stays in the table
        table.write_text(original + "  late: {requests: {minute: 5}, tokens: {minute: 100000}}\n")


def test_every_response_carries_the_rate_limit_headers(rl_stack: Stack) -> None:
    key = add_tenant(
        rl_stack, "rl-headers", "standard", PerMinuteLimits(rpm=3)
    )  # the probe, then 2
    replies = [
        chat(rl_stack, key),
        chat(rl_stack, key, stream=True),
        chat(rl_stack, key, stream=True, stream_options={"include_usage": True}),
    ]
    assert [r.status for r in replies] == [200, 200, 429]
    for reply in replies:
        assert all(name in reply.headers for name in RATE_HEADERS), reply.headers
    assert b"data: [DONE]" in replies[1].body and b'"usage"' not in replies[1].body


def test_redis_killed_during_load_fails_no_request(tmp_path: Path) -> None:
    with Stack(stack_settings(), tmp_path / "stack") as stack:
        key = api_key(stack, "platinum")
        with ThreadPoolExecutor(6) as pool:
            sent = [pool.submit(lambda: chat(stack, key, max_tokens=4)) for _ in range(180)]
            sent[59].result()
            assert counter(stack, "demo-platinum", "requests:minute") >= 60  # counted in Redis
            next(p for p in stack.processes if p.name == "redis").kill()
            replies = [f.result() for f in sent]
        assert {r.status for r in replies} == {200}
        assert all(name in replies[-1].headers for name in RATE_HEADERS)  # from local counters
