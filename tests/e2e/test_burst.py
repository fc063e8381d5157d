"""Bursts far above a tenant's limit admit exactly the limit, through real Envoy.

Fail-open (admitting unchecked when the limiter fails) may mean only that it is down, never that
it is busy: every burst below is asserted to have made zero failed rate-limit calls, and the
ledger's count of admissions without a rate-limit decision stays 0 (the limiter runs inside
extauthz, as the stack runs it by default). With `python -m ratelimit` apart and killed, requests
keep being served, and each such admission is counted.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator

import aiohttp
import pytest

from extauthz.types import PerMinuteLimits
from llmgw.topology import Topology
from tests.e2e.conftest import stack_settings
from tests.e2e.test_ratelimit_e2e import MODEL, add_tenant, auth, counter
from tests.eventually import eventually
from tests.http import call
from tools.stack import Stack

LIMIT = 40


@pytest.fixture(scope="module")
def burst_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(stack_settings(), tmp_path_factory.mktemp("burst")) as running:
        yield running


def rl_failures(stack: Stack) -> float:
    """Admissions that failed open: rate-limit calls that failed (timeout, error, overflow) as
    Envoy counts them, and admissions the limiter inside extauthz gave up (it raised or ran over
    its budget). A check that fails fails closed: its 503 (with retry-after) is counted by
    `burst`, not here."""
    stats = stack.envoy_stats()
    failed: float = sum(
        v for k, v in stats.items() if k.endswith((".ratelimit.error", ".failure_mode_allowed"))
    )
    with urllib.request.urlopen(stack.metrics["extauthz"], timeout=5) as r:
        text = r.read().decode()
    given_up = re.findall(r"^llmgw_extauthz_admit_errors_total\{[^}]*\} (\S+)$", text, re.M)
    return failed + sum(float(v) for v in given_up)


def unchecked(stack: Stack, tenant: str) -> float:
    """The ledger's count of the tenant's requests admitted without a rate-limit decision."""
    with urllib.request.urlopen(stack.metrics["ledger"], timeout=5) as r:
        text = r.read().decode()
    pattern = rf'^llmgw_ledger_unchecked_admissions_total{{tenant="{re.escape(tenant)}"}} (\S+)$'
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


async def burst(stack: Stack, key: str, size: int) -> Counter[int]:
    """`size` chat requests at once (one connection each); the statuses they got. A 503 must be
    a check extauthz shed for overload (it waited past shed_after_ms since Envoy had its body),
    with retry-after: a busy machine queues the checks past that. Envoy's own timeout of a check
    (authorization_unavailable) is not a decision, and fails the test, as anything else does
    (with what Envoy's access log says of its 503s)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    start = asyncio.Event()

    async def one(session: aiohttp.ClientSession) -> tuple[int, str | None]:
        await start.wait()
        async with session.post(f"{stack.base_url}/chat/completions", json=body) as resp:
            reply = await resp.json(content_type=None)
            if resp.status != 503:
                return resp.status, None
            if "retry-after" not in resp.headers:
                return resp.status, f"no retry-after: {dict(resp.headers)}"
            if reply["error"]["code"] != "overloaded":
                return resp.status, f"{reply} ({resp.headers.get('x-request-id')})"
            return resp.status, None

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(
        headers=auth(key), connector=connector, timeout=timeout
    ) as session:
        tasks = [asyncio.create_task(one(session)) for _ in range(size)]
        await asyncio.sleep(0.2)  # every task is waiting on the event
        start.set()
        replies = await asyncio.gather(*tasks)
    wrong = [why for _, why in replies if why is not None]
    assert not wrong, (len(wrong), wrong[:3], envoy_said(stack, 503))
    return Counter(status for status, _ in replies)


def envoy_said(stack: Stack, status: int) -> list[str]:
    """Envoy's flags and details of its `status` answers (the access log), for a failure."""
    said: Counter[str] = Counter()
    for line in stack.access_log.read_text().splitlines():
        entry = json.loads(line)
        if str(entry.get("status")) == str(status):
            said[f"{entry.get('flags')} {entry.get('details')}"] += 1
    return [f"{n}× {what}" for what, n in said.most_common()]


def admitted_exactly(statuses: Counter[int], room: int, size: int) -> None:
    """The limiter admitted exactly what the window had room for, of what reached it: a check
    shed under load (503, before the limiter) never does. If the limiter refused any (429), it
    was reached by more than `room`, which it must then have admitted exactly; a machine busy
    enough to shed all but a few leaves fewer than `room` to admit."""
    assert statuses[200] + statuses[429] + statuses[503] == size, statuses
    if statuses[429]:
        assert statuses[200] == room, statuses
    else:
        assert 0 < statuses[200] <= room, statuses


def settled(stack: Stack, tenant: str, requests: int) -> None:
    """Wait (bounded) until the ledger has seen `requests` of the tenant's requests."""
    deadline = time.monotonic() + 20
    while True:
        lines = stack.access_log.read_text().count(f'"tenant":"{tenant}"')
        if lines >= requests or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    time.sleep(0.5)  # one more access-log flush to the ledger


@pytest.mark.parametrize("size", [50, 200, 1000])
def test_a_burst_admits_exactly_the_limit_and_never_fails_open(
    burst_stack: Stack, size: int
) -> None:
    tenant = f"burst-{size}"
    key = add_tenant(burst_stack, tenant, "free", PerMinuteLimits(rpm=LIMIT, tpm=10_000_000))
    room = LIMIT - counter(burst_stack, tenant, "requests:minute")  # add_tenant's probe counts
    failures = rl_failures(burst_stack)
    statuses = asyncio.run(burst(burst_stack, key, size))
    assert rl_failures(burst_stack) - failures == 0, statuses
    admitted_exactly(statuses, room, size)
    settled(burst_stack, tenant, size)
    assert unchecked(burst_stack, tenant) == 0


@pytest.fixture(scope="module")
def apart_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The rate limiter apart: `python -m ratelimit` behind Envoy's rate-limit filter."""
    apart = stack_settings().model_copy(update={"topology": Topology.RLS})
    with Stack(apart, tmp_path_factory.mktemp("apart")) as running:
        yield running


def test_apart_a_burst_admits_exactly_the_limit_too(apart_stack: Stack) -> None:
    """Envoy builds the descriptors from extauthz's metadata (the tenant's own limit as their
    override) and the service decides them as the limiter inside extauthz would."""
    assert not apart_stack.services.limiter_inside
    assert any(p.name == "ratelimit" for p in apart_stack.processes)
    key = add_tenant(apart_stack, "apart-burst", "free", PerMinuteLimits(rpm=LIMIT, tpm=10_000_000))
    room = LIMIT - counter(apart_stack, "apart-burst", "requests:minute")
    failures = rl_failures(apart_stack)
    statuses = asyncio.run(burst(apart_stack, key, 200))
    assert rl_failures(apart_stack) - failures == 0, statuses
    admitted_exactly(statuses, room, 200)
    settled(apart_stack, "apart-burst", 200)
    assert unchecked(apart_stack, "apart-burst") == 0


def test_with_the_service_killed_fail_open_serves_and_is_counted(apart_stack: Stack) -> None:
    """Apart and killed, Envoy admits unchecked. Inside extauthz the limiter cannot die alone;
    Redis down is its degraded mode. (Last in this module: it kills the service.)"""
    stack = apart_stack
    key = add_tenant(stack, "down", "free", PerMinuteLimits(rpm=5))
    next(p for p in stack.processes if p.name == "ratelimit").kill()
    replies = [
        call(
            "POST",
            f"{stack.base_url}/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
            auth(key),
        )
        for _ in range(10)
    ]
    assert [r.status for r in replies] == [200] * 10  # over the limit of 5: unchecked
    assert rl_failures(stack) >= 10
    what = "the ledger did not count the fail-open admissions"
    eventually(lambda: unchecked(stack, "down") >= 10, 10, what, every_s=0.1)
