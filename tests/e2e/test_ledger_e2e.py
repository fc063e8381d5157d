"""The ledger through the real stack: Envoy's access log → settlement in Redis → PostgreSQL.

Every request's outcome is read back the way an operator reads it, with `llmgw usage --json`; the
token counters are read from Redis and from the next response's `x-ratelimit-remaining-tokens`.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import pytest

from extauthz.types import PerMinuteLimits
from llmgw import wire
from llmgw.topology import Topology
from tests.e2e.conftest import stack_settings
from tests.e2e.test_ratelimit_e2e import MODEL, add_tenant, auth, counter, reservations
from tests.eventually import eventually
from tests.http import Reply, call
from tools.stack import Stack

LIMITS = """
tiers:
  standard: {requests: {second: 1000}, tokens: {minute: 1000000}}
  free: {requests: {minute: 3}, tokens: {minute: 1000000}}
"""
BORROWING_LIMITS = """
tiers:
  platinum: {requests: {minute: 3}, tokens: {minute: 1000000}, borrow_share: 1.0}
"""


@pytest.fixture(scope="module")
def ledger_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    state = tmp_path_factory.mktemp("ledger-stack")
    (state / "limits.yaml").write_text(LIMITS)
    settings = stack_settings().model_copy(update={"tiers_file": state / "limits.yaml"})
    with Stack(settings, state / "stack") as running:
        yield running


def usage(stack: Stack, *flags: str) -> str:
    """`llmgw usage` as an operator runs it, against the stack's database."""
    assert stack.database_url is not None
    done = subprocess.run(
        [sys.executable, "-m", "llmgw", "usage", "--database-url", stack.database_url, *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def records(stack: Stack, *flags: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in usage(stack, "--json", *flags).splitlines()]


def recorded(stack: Stack, ids: set[str], *flags: str, timeout: float = 20.0) -> dict[str, Any]:
    """The ledger's records of these request IDs, once all are written (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = [r for r in records(stack, *flags) if r["request_id"] in ids]
        if {r["request_id"] for r in rows} >= ids or time.monotonic() > deadline:
            assert {r["request_id"] for r in rows} >= ids, ids - {r["request_id"] for r in rows}
            return {r["request_id"]: r for r in rows}
        time.sleep(0.2)


def chat(
    stack: Stack, key: str, max_tokens: int = 8, content: str = "hi", **extra: object
) -> Reply:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
    return call(
        "POST", f"{stack.base_url}/chat/completions", {**body, "max_tokens": max_tokens}, auth(key)
    )


def aborted_stream(stack: Stack, key: str, events: int, max_tokens: int = 2000) -> tuple[str, int]:
    """A stream the client hangs up on after `events` SSE events: (request ID, events seen)."""
    url = urlsplit(stack.base_url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=30)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a long story"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    conn.request(
        "POST",
        f"{url.path}/chat/completions",
        json.dumps(body),
        {**auth(key), "content-type": "application/json"},
    )
    reply = conn.getresponse()
    assert reply.status == 200
    request_id = reply.headers["x-request-id"]
    seen = 0
    while seen < events:
        line = reply.readline()
        assert line, "the stream ended before the client hung up"
        seen += line.startswith(b"data: {")
    conn.sock.close()  # type: ignore[union-attr]
    conn.close()
    return request_id, seen


def test_every_request_of_a_mixed_run_is_recorded_once(ledger_stack: Stack) -> None:
    key = add_tenant(ledger_stack, "lg-mixed", "standard")
    limited = add_tenant(ledger_stack, "lg-limited", "free")  # 3 a minute: the probe, then 2
    expected: dict[str, tuple[str, int]] = {}  # request ID → (outcome, status)
    usages: dict[str, dict[str, int]] = {}
    for i in range(3):
        reply = chat(ledger_stack, key, max_tokens=5 + i)
        assert reply.status == 200
        expected[reply.headers["x-request-id"]] = ("ok", 200)
        usages[reply.headers["x-request-id"]] = reply.json()["usage"]
    for i in range(3):
        reply = chat(ledger_stack, key, max_tokens=4 + i, stream=True)
        assert reply.status == 200 and reply.body.endswith(b"data: [DONE]\n\n")
        expected[reply.headers["x-request-id"]] = ("ok", 200)
    for events in (3, 6):
        rid, _ = aborted_stream(ledger_stack, key, events)
        expected[rid] = ("aborted", 200)
    unauthenticated = call("POST", f"{ledger_stack.base_url}/chat/completions", {}, auth("sk-x"))
    assert unauthenticated.status == 401
    expected[unauthenticated.headers["x-request-id"]] = ("refused", 401)
    refused = [chat(ledger_stack, limited) for _ in range(3)]
    assert [r.status for r in refused] == [200, 200, 429]
    for r in refused:
        expected[r.headers["x-request-id"]] = ("ok", 200) if r.status == 200 else ("refused", 429)
    faults = {"error_rate": 1.0, "error_status": 500}
    for pod in range(len(ledger_stack.pods)):
        assert call("PUT", f"{ledger_stack.pod_url(pod)}/admin/faults", faults).status == 200
    try:
        broken = chat(ledger_stack, key)
    finally:
        for pod in range(len(ledger_stack.pods)):
            call("DELETE", f"{ledger_stack.pod_url(pod)}/admin/faults")
    assert broken.status == 500
    expected[broken.headers["x-request-id"]] = ("upstream_error", 500)

    rows = recorded(ledger_stack, set(expected))
    all_ids = Counter(r["request_id"] for r in records(ledger_stack))
    assert all(all_ids[rid] == 1 for rid in expected)  # exactly once
    assert {rid: (r["outcome"], r["status"]) for rid, r in rows.items()} == expected
    for rid, used in usages.items():
        row = rows[rid]
        assert (row["prompt_tokens"], row["completion_tokens"]) == (
            used["prompt_tokens"],
            used["completion_tokens"],
        )
        assert row["charged_tokens"] == used["total_tokens"] and row["pod"]
    for rid, (outcome, _) in expected.items():
        if outcome in ("refused", "upstream_error"):
            assert rows[rid]["charged_tokens"] == 0, rows[rid]
    # The operator's views: by tenant, and one session's requests in time order.
    by_tenant = usage(ledger_stack, "--by", "tenant", "--tenant", "lg-mixed")
    assert "lg-mixed" in by_tenant and "lg-limited" not in by_tenant
    session = rows[next(iter(usages))]["session"]
    in_session = records(ledger_stack, "--session", session)
    assert [r["session"] for r in in_session] == [session]


def test_an_aborted_stream_is_charged_its_prompt_and_streamed_tokens(ledger_stack: Stack) -> None:
    key = add_tenant(ledger_stack, "lg-abort", "standard", PerMinuteLimits(tpm=100_000))
    rid, seen = aborted_stream(ledger_stack, key, events=12)
    row = recorded(ledger_stack, {rid})[rid]
    assert row["outcome"] == "aborted" and row["stream"] is True
    # Everything that reached the client is charged (Envoy may have relayed a few more events
    # than the client read before it noticed the hang-up; the first event is the role only);
    # the pod stopped long before 2000.
    assert seen - 1 <= row["completion_tokens"] < 2000
    assert row["prompt_tokens"] > 0
    assert row["charged_tokens"] == row["prompt_tokens"] + row["completion_tokens"]
    eventually(lambda: not reservations(ledger_stack, "lg-abort"), 10.0, "the reservation settled")
    after = chat(ledger_stack, key, max_tokens=1)
    nxt = recorded(ledger_stack, {after.headers["x-request-id"]})[after.headers["x-request-id"]]
    remaining = int(after.headers["x-ratelimit-remaining-tokens"])
    assert remaining == 100_000 - row["charged_tokens"] - nxt["reserved_tokens"]


def test_a_pod_error_is_not_charged(ledger_stack: Stack) -> None:
    key = add_tenant(ledger_stack, "lg-5xx", "standard")
    faults = {"error_rate": 1.0, "error_status": 500}
    for pod in range(len(ledger_stack.pods)):
        assert call("PUT", f"{ledger_stack.pod_url(pod)}/admin/faults", faults).status == 200
    try:
        replies = [chat(ledger_stack, key, max_tokens=300) for _ in range(3)]
    finally:
        for pod in range(len(ledger_stack.pods)):
            call("DELETE", f"{ledger_stack.pod_url(pod)}/admin/faults")
    assert {r.status for r in replies} == {500}
    rows = recorded(ledger_stack, {r.headers["x-request-id"] for r in replies})
    assert {r["outcome"] for r in rows.values()} == {"upstream_error"}
    assert all(r["reserved_tokens"] > 300 for r in rows.values())  # reserved at admission …
    eventually(lambda: not reservations(ledger_stack, "lg-5xx"), 10.0, "reservations released")
    assert counter(ledger_stack, "lg-5xx") == 0  # … and released in full


def test_a_mid_stream_pod_failure_is_an_upstream_error_charged_what_streamed(
    ledger_stack: Stack,
) -> None:
    key = add_tenant(ledger_stack, "lg-midfail", "standard")
    for pod in range(len(ledger_stack.pods)):
        fault = {"error_mid_stream": 1.0}
        assert call("PUT", f"{ledger_stack.pod_url(pod)}/admin/faults", fault).status == 200
    try:
        reply = chat(ledger_stack, key, max_tokens=50, stream=True)
    finally:
        for pod in range(len(ledger_stack.pods)):
            call("DELETE", f"{ledger_stack.pod_url(pod)}/admin/faults")
    assert reply.status == 200 and b'"error"' in reply.body
    rid = reply.headers["x-request-id"]
    row = recorded(ledger_stack, {rid})[rid]
    streamed = reply.body.count(b'"choices":[{') - reply.body.count(b'"role":"assistant"')
    assert row["outcome"] == "upstream_error"
    assert row["completion_tokens"] == streamed < 50
    assert row["charged_tokens"] == row["prompt_tokens"] + streamed


def test_ledger_killed_under_load_settles_every_request_once(
    tmp_path: Any,
) -> None:
    """Every request is settled to its usage once, those whose outcome died with the ledger
    too (recovered from Envoy's file access log); nothing is refunded that was not used."""
    (tmp_path / "limits.yaml").write_text(LIMITS)
    settings = stack_settings().model_copy(update={"tiers_file": tmp_path / "limits.yaml"})
    with Stack(settings, tmp_path / "stack") as stack:
        key = add_tenant(stack, "lg-kill", "standard")
        bodies: dict[str, dict[str, Any]] = {}

        def one(i: int) -> Reply:
            return chat(stack, key, max_tokens=3 + i % 5, content=f"question {i} " * (1 + i % 7))

        with ThreadPoolExecutor(4) as pool:
            before = [pool.submit(one, i) for i in range(120)]
            first = before[0].result().headers["x-request-id"]
            before[40].result()
            # Killed once it has settled some (Envoy's batches leave at least every 0.2 s).
            prefix = wire.tenant_prefix("lg-kill")
            with stack.redis_client() as r:
                eventually(lambda: bool(r.exists(f"{prefix}:done:{first}")), 10.0, "a settlement")
            next(p for p in stack.processes if p.name == "ledger").kill()
            replies = [f.result() for f in before]
        stack.restart("ledger")
        after = [one(1000 + i) for i in range(20)]
        replies += after
        assert {r.status for r in replies} == {200}
        for i, r in enumerate(replies):
            n = i if i < 120 else 1000 + i - 120
            bodies[r.headers["x-request-id"]] = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"question {n} " * (1 + n % 7)}],
                "max_tokens": 3 + n % 5,
            }
        # Every request is recorded: those lost with the ledger are recovered from Envoy's file
        # access log (ledger/reconcile.py), settled against their reservations like the rest.
        recorded(stack, set(bodies), timeout=60.0)
        eventually(lambda: stack_ledger_idle(stack), 10.0, "the ledger settled what it received")
        expected = 0
        with stack.redis_client() as r:
            for reply in replies:
                rid = reply.headers["x-request-id"]
                assert r.exists(f"{prefix}:done:{rid}") and not r.exists(f"{prefix}:res:{rid}")
                expected += reply.json()["usage"]["total_tokens"]
        assert counter(stack, "lg-kill") == expected
        # Outcomes were lost with the ledger, and recovered.
        assert ledger_metric(stack, "llmgw_ledger_reconciled_total") > 0


def test_a_borrowed_admission_is_recorded_as_borrowed(tmp_path: Any) -> None:
    """Requests on base quota until it is used up (nothing to borrow: no fleet signal yet); then,
    the fleet idle, the next runs on its borrowing pool, and the ledger says which was which.
    No router: it would overwrite the fleet signal every second."""
    (tmp_path / "limits.yaml").write_text(BORROWING_LIMITS)
    settings = stack_settings().model_copy(
        update={
            "tiers_file": tmp_path / "limits.yaml",
            "services": ("extauthz", "ratelimit", "ledger"),
        }
    )
    with Stack(settings, tmp_path / "stack") as stack:
        key = add_tenant(stack, "lg-borrow", "platinum")
        replies = [chat(stack, key)]
        while replies[-1].status == 200 and len(replies) < 5:
            replies.append(chat(stack, key))
        base = [r.headers["x-request-id"] for r in replies if r.status == 200]
        assert replies[-1].status == 429 and base, [r.status for r in replies]
        idle = {"load": 0.1, "capacity_tpm": 10_000_000, "capacity_rpm": 100_000}
        deadline = time.monotonic() + 10
        while True:  # until ratelimit's cached fleet signal (0.5 s) shows the idle fleet
            with stack.redis_client() as r:
                r.set(wire.FLEET_LOAD_KEY, json.dumps({**idle, "ts": time.time()}))
            borrowed = chat(stack, key)
            if borrowed.status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert borrowed.status == 200, "never admitted on borrowed quota"
        ids = [*base, borrowed.headers["x-request-id"]]
        rows = recorded(stack, set(ids))
        assert [rows[rid]["borrowed_requests"] for rid in ids] == [0] * len(base) + [1]
        assert {rows[rid]["borrowed_tokens"] for rid in ids} == {0}  # tokens ran on base
        (totals,) = records(stack, "--by", "tenant", "--tenant", "lg-borrow")
        assert totals["borrowed_requests"] == 1
        assert totals["base_tokens"] == totals["charged_tokens"] > 0


def ledger_metrics(stack: Stack) -> str:
    import urllib.request

    with urllib.request.urlopen(stack.metrics["ledger"], timeout=5) as reply:
        return str(reply.read().decode())


def ledger_metric(stack: Stack, name: str) -> float:
    found = [
        line.split()[-1]
        for line in ledger_metrics(stack).splitlines()
        if line.startswith(f"{name} ")
    ]
    return float(found[0]) if found else 0.0


def stack_ledger_idle(stack: Stack) -> bool:
    """The ledger has nothing waiting for settlement (its own gauge)."""
    return "llmgw_ledger_unsettled 0.0" in ledger_metrics(stack)


def test_the_request_path_is_one_exchange(ledger_stack: Stack) -> None:
    """One ext_authz check per request, streams included, over HTTP, which admits and picks
    the pod too (the rate limiter and the router run inside extauthz): no gRPC call, no
    rate-limit call, no ext_proc; everything after the answer travels in the batched access log.
    The admission is there all the same: its x-ratelimit-* headers reach the client."""
    assert ledger_stack.services.topology is Topology.GATEWAY
    key = add_tenant(ledger_stack, "lg-path", "standard")
    names = (
        "http.openai.ext_authz.ok",
        "cluster.extauthz_http.upstream_rq_total",
        "cluster.ratelimit.upstream_rq_total",
        "http.openai.ratelimit.ok",
        "http.openai.ext_proc.streams_started",
        "http.openai.ext_proc.stream_msgs_sent",
    )
    before = ledger_stack.envoy_stats()
    replies = [chat(ledger_stack, key, max_tokens=3, stream=i % 2 == 0) for i in range(6)]
    assert {r.status for r in replies} == {200}
    remaining = [int(r.headers["x-ratelimit-remaining-requests"]) for r in replies]
    assert remaining == sorted(remaining, reverse=True) and len(set(remaining)) == 6
    recorded(ledger_stack, {r.headers["x-request-id"] for r in replies})  # the logs arrived
    after = ledger_stack.envoy_stats()
    assert [after.get(n, 0) - before.get(n, 0) for n in names] == [6, 6, 0, 0, 0, 0]
    # The key asked at the headers is cached per Envoy worker: at most one question a worker.
    keys = "cluster.extauthz_keys.upstream_rq_total"
    assert after[keys] - before.get(keys, 0) <= ledger_stack.settings.envoy.concurrency


def tier_reloads(stack: Stack, service: str = "ledger", config: str = "tiers") -> float:
    """A service's successful reloads of a config (the ledger's tier table by default;
    extauthz reloads its tenants file and the tier table as one config, "tenants")."""
    with urllib.request.urlopen(stack.metrics[service], timeout=5) as r:
        text = r.read().decode()
    found = re.search(
        rf'^llmgw_config_reloads_total\{{config="{config}",result="ok"\}} (\S+)$', text, re.M
    )
    return float(found.group(1)) if found else 0.0


def priced(stack: Stack, prices: str) -> None:
    """The tier table with these prices, once the ledger has reloaded it (bounded)."""
    before = tier_reloads(stack)
    assert stack.settings.tiers_file is not None
    stack.settings.tiers_file.write_text(LIMITS + prices)
    eventually(lambda: tier_reloads(stack) > before, 10.0, "the ledger reloaded the prices")


def test_each_request_is_priced_by_the_table_in_force(ledger_stack: Stack) -> None:
    """Prices reloaded while running apply to the requests recorded after, never before; the
    operator's totals add them up."""
    key = add_tenant(ledger_stack, "lg-cost", "standard")
    try:
        priced(
            ledger_stack,
            f"prices: {{currency: USD, models: {{{MODEL}: {{input: 1.5, output: 4}}}}}}\n",
        )
        first = chat(ledger_stack, key, max_tokens=5)
        # Recorded before the table changes: a record is priced when the ledger records it,
        # and Envoy's access log reaches the ledger a flush later than the reply.
        recorded(ledger_stack, {first.headers["x-request-id"]})
        priced(ledger_stack, "prices: {currency: EUR, default: {input: 10, output: 20}}\n")
        second = chat(ledger_stack, key, max_tokens=7)
        # Recorded before the table is restored, for the same reason.
        recorded(ledger_stack, {second.headers["x-request-id"]})
    finally:
        priced(ledger_stack, "")  # the module's table again, reloaded before the next test
    ids = [first.headers["x-request-id"], second.headers["x-request-id"]]
    rows = recorded(ledger_stack, set(ids))
    a, b = rows[ids[0]], rows[ids[1]]
    # Micro-units: tokens times the price per million, rounded half up once.
    expected_a = math.floor(a["prompt_tokens"] * 1.5 + a["completion_tokens"] * 4 + 0.5)
    assert (a["cost_micros"], a["currency"]) == (expected_a, "USD") and expected_a > 0
    expected_b = b["prompt_tokens"] * 10 + b["completion_tokens"] * 20
    assert (b["cost_micros"], b["currency"]) == (expected_b, "EUR")
    assert a["cost"] == expected_a / 1e6
    # Its share of its pod's time while it ran (the router's published batches): some, and
    # never more than the time it held the pod.
    for row in (a, b):
        assert row["gpu_seconds"] is not None
        assert 0 < row["gpu_seconds"] <= row["duration_ms"] / 1000 + 0.001
    totals = records(ledger_stack, "--by", "tenant", "--tenant", "lg-cost")
    # Two currencies: said so, and no sum of the two.
    assert len(totals) == 1 and totals[0]["currency"] == "EUR,USD" and totals[0]["cost"] is None
    since_b = records(ledger_stack, "--by", "tenant", "--tenant", "lg-cost", "--since", b["ts"])
    assert since_b[0]["cost"] == pytest.approx(expected_b / 1e6)
