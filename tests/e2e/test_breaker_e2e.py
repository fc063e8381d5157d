"""The tenant breaker end to end: real Envoy, extauthz, ratelimit, ledger, Redis, PostgreSQL and
simulated pods whose faults the tests switch on: for one tenant's requests (what it caused), or
for everyone's (the fleet's). The built-in tiers carry the seed's numbers; `fastcb` is a custom
tier with short cool-downs for recovery."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from llmgw.wire import breaker_key
from tests.e2e.conftest import stack_settings
from tests.e2e.test_ledger_e2e import recorded
from tests.e2e.test_ratelimit_e2e import MODEL, add_tenant, auth, chat
from tests.eventually import eventually
from tests.http import Reply, call
from tools import cli, usage
from tools.stack import Stack

LIMITS = """
tiers:
  fastcb:
    requests: {second: 1000}
    breaker: {threshold: 2, cooldown_s: 0.5, cooldown_max_s: 2, step_s: 0.5}
"""


@pytest.fixture(scope="module")
def cb_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    state = tmp_path_factory.mktemp("cb-stack")
    (state / "limits.yaml").write_text(LIMITS)
    settings = stack_settings().model_copy(update={"tiers_file": state / "limits.yaml"})
    with pytest.MonkeyPatch.context() as env:
        # These tests fail one tenant after another on the same two pods, seconds apart: a
        # third within 10 s would be the pod's fault (ledger/blame.py; its own test below, on a
        # stack of its own), where here each is the tenant's.
        env.setenv("LLMGW_LEDGER__BLAME__TENANTS", "1000")
        with Stack(settings, state / "stack") as running:
            yield running


def faults(stack: Stack, on: bool, *tenants: str) -> None:
    """Every pod answers 500 to these tenants' requests (none named: to everyone's), or not."""
    for pod in range(len(stack.pods)):
        url = f"{stack.pod_url(pod)}/admin/faults"
        if on:
            fault = {"error_rate": 1.0, "error_status": 500, "error_tenants": list(tenants)}
            assert call("PUT", url, fault).status == 200
        else:
            assert call("DELETE", url).status == 200


def circuit_open(reply: Reply) -> bool:
    return reply.status == 503 and reply.json()["error"]["code"] == "tenant_circuit_open"


def score(stack: Stack, tenant: str) -> float:
    with stack.redis_client() as r:
        value = r.hget(breaker_key(tenant), "s")
    return float(value) if value is not None else 0.0


def logged(stack: Stack, ids: set[str]) -> dict[str, dict[str, str]]:
    found: dict[str, dict[str, str]] = {}

    def all_there() -> bool:
        for line in stack.access_log.read_text().splitlines():
            entry = json.loads(line)
            if entry["request_id"] in ids:
                found[entry["request_id"]] = entry
        return len(found) == len(ids)

    eventually(all_there, 10.0, "access-log entries")
    return found


def metrics(stack: Stack, service: str) -> str:
    with urllib.request.urlopen(stack.metrics[service], timeout=5) as r:
        return str(r.read().decode())


def events(stack: Stack, tenant: str) -> str:
    assert stack.database_url is not None
    argv = ["usage", "--events", "--json", "--tenant", tenant]
    return asyncio.run(usage.render(stack.database_url, cli.parser().parse_args(argv)))


def test_a_storm_trips_free_at_two_500s_platinum_at_three_and_spares_the_others(
    cb_stack: Stack,
) -> None:
    free = add_tenant(cb_stack, "cb-free", "free")
    platinum = add_tenant(cb_stack, "cb-platinum", "platinum")
    standard = add_tenant(cb_stack, "cb-standard", "standard")
    faults(cb_stack, True, "cb-free", "cb-platinum")
    try:
        # One failure never trips (free's threshold is 2); the second does.
        assert chat(cb_stack, free).status == 500
        eventually(lambda: score(cb_stack, "cb-free") > 0.9, 10.0, "the first 500 fed")
        assert chat(cb_stack, free).status == 500
        failed_at = time.monotonic()
        while not circuit_open(reply := chat(cb_stack, free)):
            assert reply.status == 500
            assert time.monotonic() - failed_at < 1.0, "free tenant not refused within 1 s"
            time.sleep(0.02)
        # The refusal: a 503 in OpenAI's envelope, retry when the cool-down ends.
        error = reply.json()["error"]
        assert (error["type"], error["param"]) == ("server_error", None)
        assert 0 < int(reply.headers["retry-after-ms"]) <= 120_000
        assert int(reply.headers["retry-after"]) <= 120
        assert reply.headers["x-should-retry"] == "true"
        assert not any(h.startswith("x-llmgw") or "circuit" in h for h in reply.headers)
        refused = [chat(cb_stack, free) for _ in range(5)]
        assert all(circuit_open(r) for r in refused)
        # ... and never reached a pod.
        ids = {r.headers["x-request-id"] for r in [reply, *refused]}
        for entry in logged(cb_stack, ids).values():
            # Refused by the rate limiter: inside extauthz (a denial) or behind its own filter.
            flag = "UAEX" if cb_stack.services.limiter_inside else "RL"
            assert entry["upstream"] in (None, "", "-") and flag in entry["flags"]

        # Platinum: two 500s leave it admitted (each request still reaches a pod), the third trips.
        for n in (1, 2):
            assert chat(cb_stack, platinum).status == 500
            eventually(lambda n=n: score(cb_stack, "cb-platinum") > n - 0.1, 10.0, f"500 #{n} fed")
        assert chat(cb_stack, platinum).status == 500
        eventually(lambda: circuit_open(chat(cb_stack, platinum)), 1.0, "platinum open")
    finally:
        faults(cb_stack, False)
    # The others: served (the standard tenant sent nothing that failed); the two stay open.
    assert chat(cb_stack, standard).status == 200
    assert circuit_open(chat(cb_stack, free)) and circuit_open(chat(cb_stack, platinum))
    platinum_open = chat(cb_stack, platinum)
    assert int(platinum_open.headers["retry-after-ms"]) <= 15_000  # half of standard's

    # Seen: metrics, ledger events (`llmgw usage --events`) and platinum's alert.
    trips = 'llmgw_breaker_trips_total{cause="500",reopen="false",tenant="cb-free",tier="free"}'
    eventually(lambda: f"{trips} 1.0" in metrics(cb_stack, "ledger"), 10.0, "trip metric")
    refusals = 'result="circuit_open",shadow="false",tenant="cb-free",tier="free"}'
    assert refusals in metrics(cb_stack, "ratelimit")
    eventually(lambda: "breaker.trip" in events(cb_stack, "cb-free"), 10.0, "free trip event")
    (trip,) = [json.loads(line) for line in events(cb_stack, "cb-free").splitlines()]
    assert trip["kind"] == "breaker.trip" and trip["detail"]["cause"] == "500"
    assert trip["detail"]["cooldown_s"] == 120
    eventually(
        lambda: "alert.platinum_breaker_open" in events(cb_stack, "cb-platinum"), 10.0, "the alert"
    )
    assert "alert." not in events(cb_stack, "cb-free")


def trip(stack: Stack, key: str, tenant: str) -> None:
    """Two 500s from the pods for this tenant, then its breaker open (within 2 s)."""
    faults(stack, True, tenant)
    try:
        assert [chat(stack, key).status for _ in range(2)] == [500, 500]
        eventually(lambda: circuit_open(chat(stack, key)), 2.0, "tripped")
    finally:
        faults(stack, False)


def stream(stack: Stack, key: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A long stream, its first chunk read: in flight on a pod."""
    url = urlsplit(stack.base_url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=30)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a long story"}],
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {**auth(key), "content-type": "application/json"}
    conn.request("POST", f"{url.path}/chat/completions", json.dumps(body), headers)
    reply = conn.getresponse()
    assert reply.status == 200 and reply.readline().startswith(b"data: {")
    return conn, reply


def test_a_stream_in_flight_finishes_when_its_tenant_trips(cb_stack: Stack) -> None:
    key = add_tenant(cb_stack, "cb-stream", "free")
    conn, stream_reply = stream(cb_stack, key)
    trip(cb_stack, key, "cb-stream")
    rest = stream_reply.read()
    assert not rest.startswith(b"data: [DONE]"), "the stream ended before the trip"
    assert rest.endswith(b"data: [DONE]\n\n") and b'"error"' not in rest
    conn.close()


def test_recovery_through_envoy_lets_a_share_through_then_everyone(cb_stack: Stack) -> None:
    key = add_tenant(cb_stack, "cb-fast", "fastcb")
    trip(cb_stack, key, "cb-fast")
    # Cool-down 0.5 s, then 10 %, 30 % and 100 % for 0.5 s each: served again, and recorded.
    eventually(lambda: chat(cb_stack, key).status == 200, 3.0, "half-open")
    time.sleep(1.6)
    assert [chat(cb_stack, key).status for _ in range(5)] == [200] * 5
    eventually(lambda: "breaker.recover" in events(cb_stack, "cb-fast"), 10.0, "recovery event")


# What trips the breaker: only what the tenant caused (the fleet's faults: test_blame_e2e.py).

UNKNOWN = "no-such-model"


def open_breakers(stack: Stack, tenants: list[str]) -> dict[str, dict[bytes, bytes]]:
    """The breakers that are open or recovering (their hash has a cool-down end)."""
    with stack.redis_client() as r:
        states = {t: r.hgetall(breaker_key(t)) for t in tenants}
    return {t: s for t, s in states.items() if b"o" in s}


def test_unknown_models_are_answered_by_the_gateway_and_lock_no_one_out(cb_stack: Stack) -> None:
    key = add_tenant(cb_stack, "cb-typo", "standard")
    replies = [
        call(
            "POST",
            f"{cb_stack.base_url}/chat/completions",
            {"model": UNKNOWN, "messages": [{"role": "user", "content": "hi"}]},
            auth(key),
        )
        for _ in range(10)
    ]
    ids = {r.headers["x-request-id"] for r in replies}
    # vLLM's own answer (its 404 body), from the fleet's model list.
    assert {r.status for r in replies} == {404}
    assert replies[0].json() == {
        "error": {
            "message": f"The model `{UNKNOWN}` does not exist. Valid aliases: {MODEL}.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    recorded(cb_stack, ids)  # in the tenant's usage: fed to its breaker
    statuses = [chat(cb_stack, key).status for _ in range(5)]
    assert statuses == [200] * 5
    assert open_breakers(cb_stack, ["cb-typo"]) == {}
    # No pod was asked.
    assert all(e["upstream"] in (None, "", "-") for e in logged(cb_stack, ids).values())


def test_a_few_bad_requests_do_not_lock_a_tenant_out_a_storm_of_them_does(
    cb_stack: Stack,
) -> None:
    """Client mistakes (the pod's 4xx) count on a threshold of their own: free's 6, at 0.3 per
    400, is 20 of them in a burst (tests/llmgw/test_breaker.py counts them exactly); 6 leave
    the tenant served."""
    key = add_tenant(cb_stack, "cb-bad-stream", "free")
    bad = [chat(cb_stack, key, stream="maybe") for _ in range(6)]
    assert {r.status for r in bad} == {400}
    recorded(cb_stack, {r.headers["x-request-id"] for r in bad})
    assert [chat(cb_stack, key).status for _ in range(5)] == [200] * 5
    assert open_breakers(cb_stack, ["cb-bad-stream"]) == {}
    # A burst of 21 (6.3) trips a free tenant of its own, its 400s the cause.
    storm = add_tenant(cb_stack, "cb-storm", "free")
    assert {chat(cb_stack, storm, stream="maybe").status for _ in range(21)} == {400}
    trips = 'llmgw_breaker_trips_total{cause="400",reopen="false",tenant="cb-storm",tier="free"}'
    eventually(lambda: f"{trips} 1.0" in metrics(cb_stack, "ledger"), 10.0, "the trip, by 400s")
    assert circuit_open(chat(cb_stack, storm))
