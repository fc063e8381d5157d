"""Alert hooks: the rules on a simulated clock (ledger/detectors.py), the webhooks against a real
aiohttp receiver (ledger/webhooks.py), alerts as log lines, metrics and PostgreSQL events
(ledger/alerts.py), and `python -m ledger` sending one end to end."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from prometheus_client import REGISTRY

from ledger.alerts import Alert, Alerts
from ledger.detectors import (
    Backlog,
    Detectors,
    FailOpen,
    Finding,
    Fleet5xx,
    Gap,
    Missing,
    PodErrors,
    QuotaRefusals,
    Rules,
)
from ledger.recorder import Recorder
from ledger.settings import ENV_PREFIX, Settings
from ledger.webhooks import Hook, Webhooks
from llmgw.config import ConfigError, load
from llmgw.link import RedisLink
from llmgw.outcome import Outcome
from tests.eventually import eventually_async
from tests.ledger.conftest import outcome, rows
from tests.ledger.test_entry import entry
from tests.ratelimit.rl_redis import start_redis
from tools import procs

SECRET = b"test-secret-0123456789"
POD_A, POD_B = "10.0.0.1:8000", "10.0.0.2:8000"


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def requests(n: int, start: int = 0, **fields: Any) -> list[Outcome]:
    return [outcome(start + i, **fields) for i in range(n)]


def only(kind: str, found: list[Finding]) -> list[Finding]:
    return [f for f in found if f.kind == kind]


def refused(n: int, start: int = 0, **fields: Any) -> list[Outcome]:
    return requests(n, start, outcome="refused", status=429, **fields)


# The rules, on a simulated clock.


def test_quota_refusals_fire_once_after_five_minutes_and_rearm_when_clear() -> None:
    d = Detectors(Rules())
    found = []
    for now in range(0, 301, 10):  # every 10 s: 7 answered, 3 refused (30 % > 20 %)
        d.observe(now, [*requests(7, pod=POD_A, tier="free"), *refused(3, 7, tier="free")])
        found += [(now, f) for f in d.evaluate(now, {})]
    assert [(now, f.kind, f.tenant, f.tier) for now, f in found] == [
        (300, "quota_refusals", "acme", "free")
    ]
    assert found[0][1].detail == {"refused": 18, "requests": 60, "window_s": 60.0}
    for now in range(310, 800, 10):  # still refused: the same episode, no second alert
        d.observe(now, [*requests(7, pod=POD_A), *refused(3)])
        assert d.evaluate(now, {}) == []
    d.observe(800, requests(100, pod=POD_A))  # 10 %: clear, re-armed
    assert d.evaluate(800, {}) == []
    for now in range(810, 1200, 10):  # 30 % again once the 10 % minute left the window (860)
        d.observe(now, [*requests(7, pod=POD_A), *refused(3)])
        if found := d.evaluate(now, {}):
            break
    assert now == 1160 and [f.kind for f in found] == ["quota_refusals"]


def test_quota_refusals_count_only_the_gateways_429s_with_enough_requests() -> None:
    d = Detectors(Rules(quota_refusals=QuotaRefusals(for_s=0)))
    d.observe(0, [*requests(5, pod=POD_A), *refused(5, 5, pod=POD_A)])  # the pod's own 429s
    d.observe(0, requests(5, 10, tenant="b", outcome="upstream_error", status=503))
    d.observe(0, refused(9, 20, tenant="c"))  # 9 < min_requests (10)
    assert d.evaluate(0, {}) == []
    d.observe(1, refused(1, 30, tenant="c"))
    assert [(f.kind, f.tenant) for f in d.evaluate(1, {})] == [("quota_refusals", "c")]


def test_a_fleet_5xx_burst_needs_the_count_and_the_ratio_and_not_the_gateways_refusals() -> None:
    d = Detectors(Rules(fleet_5xx=Fleet5xx(min_errors=20, ratio=0.05, window_s=30)))
    errors = {"outcome": "upstream_error", "status": 503, "pod": POD_A}
    d.observe(0, [*requests(500, pod=POD_A), *requests(19, 500, **errors)])  # 19 < 20
    d.observe(0, requests(50, 600, outcome="upstream_error", status=503, flags="RL"))
    gateway = {"outcome": "upstream_error", "status": 503, "flags": "UAEX", "quota_checked": True}
    d.observe(0, requests(50, 650, **gateway))  # the limiter inside extauthz refused
    assert d.evaluate(0, {}) == []
    d.observe(1, requests(1, 700, **errors))  # 20 of 570 (3.5 % < 5 %)
    assert d.evaluate(1, {}) == []
    d.observe(40, [*requests(100, pod=POD_A), *requests(25, 800, **errors)])  # the rest expired
    found = d.evaluate(40, {})
    assert [(f.kind, f.detail) for f in found] == [
        ("fleet_5xx", {"errors": 25, "requests": 125, "window_s": 30.0})
    ]
    d.observe(41, requests(25, 900, **errors))
    assert d.evaluate(41, {}) == []  # the same burst
    assert d.evaluate(80, {}) == []  # over: re-armed
    d.observe(81, requests(25, 1000, **errors))
    assert [f.kind for f in d.evaluate(81, {})] == ["fleet_5xx"]


def test_extauthz_failing_is_a_fleet_5xx_burst_not_a_refusal() -> None:
    """Envoy's own 503 when extauthz is down or late carries UAEX like the limiter's refusals,
    but no limiter's answer: everyone refused that way is the gateway failing, alerted."""
    d = Detectors(Rules(fleet_5xx=Fleet5xx(min_errors=20, ratio=0.05, window_s=30)))
    down = {"outcome": "upstream_error", "status": 503, "flags": "UAEX", "tenant": ""}
    d.observe(0, [*requests(100, pod=POD_A), *requests(30, 100, **down)])
    assert [f.kind for f in d.evaluate(0, {})] == ["fleet_5xx"]


def test_pod_errors_name_the_pod_with_most_of_the_fleets_errors() -> None:
    rules = Rules(pod_errors=PodErrors(min_errors=10, share=0.5))
    errors = {"outcome": "upstream_error", "status": 500}
    alone = Detectors(rules)
    alone.observe(0, requests(20, pod=POD_A, **errors))  # one pod: nothing to compare with
    assert only("pod_errors", alone.evaluate(0, {})) == []
    d = Detectors(rules)
    d.observe(0, [*requests(8, pod=POD_A, **errors), *requests(2, 8, pod=POD_B, **errors)])
    d.observe(0, requests(50, 10, pod=POD_B))
    found = only("pod_errors", d.evaluate(0, {}))
    assert [(f.kind, f.detail) for f in found] == [
        ("pod_errors", {"pod": POD_A, "errors": 8, "fleet_errors": 10, "window_s": 60.0})
    ]
    d.observe(1, requests(6, 100, pod=POD_B, **errors))  # 8 of 16: no longer most
    assert only("pod_errors", d.evaluate(1, {})) == []
    # Every pod failing (unevenly, as a real outage does) is the fleet's, not one pod's fault.
    fleet = Detectors(rules)
    fleet.observe(0, [*requests(9, pod=POD_A, **errors), *requests(4, 9, pod=POD_B, **errors)])
    assert only("pod_errors", fleet.evaluate(0, {})) == []


def test_fail_open_admissions_fire_at_the_threshold() -> None:
    d = Detectors(Rules(ratelimit_fail_open=FailOpen(min_admissions=10)))
    for i in range(9):
        d.unchecked(0, outcome(i, tenant="a" if i < 6 else "b"))
    assert d.evaluate(0, {}) == []
    d.unchecked(1, outcome(9, tenant="b"))
    found = d.evaluate(1, {})
    assert [(f.kind, f.detail) for f in found] == [
        ("ratelimit_fail_open", {"admissions": 10, "tenants": ["a", "b"], "window_s": 60.0})
    ]


def test_the_backlog_fires_when_growing_not_when_draining_and_rearms_below_the_floor() -> None:
    d = Detectors(Rules(ledger_backlog=Backlog(min_records=1000, window_s=30)))

    def at(now: int, unsettled: int, unwritten: int = 0) -> list[str]:
        return [f.kind for f in d.evaluate(now, {"unsettled": unsettled, "unwritten": unwritten})]

    assert at(0, 50_000) == []  # large, but growth is not known yet
    assert at(10, 60_000) == []  # growing for 10 s only
    assert at(30, 40_000) == []  # draining
    assert at(60, 40_000, 5_000) == ["ledger_backlog"]  # grew over the last 30 s
    assert at(90, 30_000) == []  # draining, still above: the same episode
    assert at(120, 35_000) == []  # growing again: still the same episode
    assert at(150, 900) == []  # below the floor: re-armed
    assert at(180, 1_500) == ["ledger_backlog"]


def test_missing_outcomes_fire_on_an_old_unconfirmed_record_and_on_each_unrecoverable_one() -> None:
    d = Detectors(Rules(outcomes_missing=Missing(max_age_s=60)))

    def at(now: int, oldest_s: float, missing: int = 0) -> list[str]:
        return [f.detail["cause"] for f in d.evaluate(now, {}, Gap(oldest_s, missing))]

    assert at(0, 59) == []
    assert at(1, 60) == ["unconfirmed"]  # PostgreSQL down a while, or a record it refuses
    assert at(2, 61) == []  # the same episode
    assert at(3, 0) == []  # confirmed: re-armed
    assert at(4, 70) == ["unconfirmed"]
    assert at(5, 0, 2) == ["unrecoverable"]  # e.g. a line cut short
    assert at(6, 0, 2) == []
    assert at(7, 0, 3) == ["unrecoverable"]


# Alerts: a log line, a metric, an event row.


async def test_an_alert_is_a_log_line_a_metric_and_an_event_row(
    db: str, make_ledger: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    ledger = make_ledger(db)
    await ledger.start()
    alerts = Alerts(Detectors(Rules()), ledger, None, backlog=dict)
    before = sample("llmgw_ledger_alerts_total", kind="platinum_breaker_open")
    with caplog.at_level(logging.WARNING, "ledger.alerts"):
        alert = alerts.emit(
            "platinum_breaker_open", tenant="acme", tier="platinum", detail={"score": 3.4}
        )
    assert sample("llmgw_ledger_alerts_total", kind="platinum_breaker_open") == before + 1
    (line,) = [r for r in caplog.records if r.getMessage() == "alert"]
    assert (line.alert, line.alert_id, line.tenant, line.detail) == (
        "platinum_breaker_open",
        alert.id,
        "acme",
        {"score": 3.4},
    )
    await eventually_async(lambda: ledger.metrics.registry.get_sample_value(
        "llmgw_ledger_written_total", {"table": "events"}) == 1, 30.0)  # fmt: skip
    (row,) = await rows(db, "SELECT kind, tenant, detail::text AS d FROM ledger_events")
    assert (row["kind"], row["tenant"]) == ("alert.platinum_breaker_open", "acme")
    assert json.loads(row["d"]) == json.loads(alert.body())  # the webhook body, as sent


async def test_the_recorder_feeds_the_rules_on_arrival_and_its_unchecked_admissions(
    tmp_path: Path,
) -> None:
    redis = start_redis(tmp_path)  # empty: no reservation, each outcome settles as unreserved
    port = int(redis.argv[redis.argv.index("--port") + 1])
    now = [0.0]
    rules = Rules(ratelimit_fail_open=FailOpen(min_admissions=2), fleet_5xx=Fleet5xx(min_errors=2))
    alerts = Alerts(Detectors(rules), None, None, backlog=dict, clock=lambda: now[0])
    recorder = Recorder(
        RedisLink("127.0.0.1", port, 0.5), None, batch_max=10, pending_max=100,
        done_ttl_s=60, timeout_s=1.0, retry_max_s=0.1, watch=alerts,
    )  # fmt: skip
    try:
        recorder.add(requests(2, pod=POD_A, outcome="upstream_error", status=500))
        assert [a.kind for a in alerts.evaluate()] == ["fleet_5xx"]  # before any settlement
        # Decided by the rate limiter, with no reservation (a tier without token windows): not
        # fail-open, though nothing was found to settle.
        recorder.add(requests(4, 20, pod=POD_A, reserved_tokens=100, quota_checked=True))
        recorder.start()
        await eventually_async(lambda: recorder.pending == 0, 30.0, "settled")
        assert [a.kind for a in alerts.evaluate()] == []
        recorder.add(requests(2, 10, pod=POD_A, reserved_tokens=100))  # no decision: fail-open
        await eventually_async(lambda: recorder.pending == 0, 30.0, "settled")
        assert [a.kind for a in alerts.evaluate()] == ["ratelimit_fail_open"]
    finally:
        await recorder.close(1.0)
        redis.stop()


# Webhooks, against a real receiver.


SLOW = "slow"  # act on the alert, but answer after the sender's timeout


class Receiver:
    """A receiver as the README says to write one: check the timestamp and the signature, act
    on each alert id once. `script`: how to answer the first requests (a status: that, without
    acting; SLOW), then normally (act, 204)."""

    def __init__(self, secret: bytes = SECRET, script: Sequence[int | str] = ()) -> None:
        self.secret = secret
        self.script = collections.deque(script)
        self.raw: list[tuple[dict[str, str], bytes]] = []  # every request, as it came
        self.acted: list[dict[str, Any]] = []  # the alerts acted on

    def verified(self, headers: dict[str, str], body: bytes) -> bool:
        ts = headers["X-Llmgw-Timestamp"]
        mac = hmac.new(self.secret, ts.encode() + b"." + body, hashlib.sha256).hexdigest()
        fresh = abs(time.time() - int(ts)) < 300
        return fresh and hmac.compare_digest(headers["X-Llmgw-Signature"], f"v1={mac}")

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = dict(request.headers)
        self.raw.append((headers, body))
        how = self.script.popleft() if self.script else "ok"
        if isinstance(how, int):
            return web.Response(status=how)
        if not self.verified(headers, body):
            return web.Response(status=401)
        alert = json.loads(body)
        assert alert["id"] == headers["X-Llmgw-Alert-Id"]
        if alert["id"] not in {a["id"] for a in self.acted}:
            self.acted.append(alert)
        if how == SLOW:
            await asyncio.sleep(0.6)  # acted, but the sender times out and sends it again
        return web.Response(status=204)


Serve = Callable[[Receiver], Awaitable[str]]


async def moved(_: web.Request) -> web.Response:
    return web.Response(status=307, headers={"Location": "/hook"})


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """serve(receiver) → the URL of its hook on a real HTTP server (also /elsewhere)."""
    runners: list[web.AppRunner] = []

    async def start(receiver: Receiver) -> str:
        app = web.Application()
        app.router.add_post("/hook", receiver.handle)
        app.router.add_post("/moved", moved)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        port = procs.free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


def deliveries(kind: str) -> dict[str, float]:
    results = ("delivered", "retried", "rejected", "failed", "dropped")
    return {r: sample("llmgw_ledger_alert_deliveries_total", kind=kind, result=r) for r in results}


def since(before: dict[str, float], kind: str) -> dict[str, float]:
    return {r: n - before[r] for r, n in deliveries(kind).items() if n != before[r]}


@pytest.fixture
async def webhooks() -> AsyncIterator[Callable[..., Webhooks]]:
    """make(hooks, **options) → started Webhooks (fast retries), all closed at the end."""
    made: list[Webhooks] = []

    def make(hooks: dict[Any, list[Hook]], start: bool = True, **options: Any) -> Webhooks:
        options = {"backoff_s": 0.05, "timeout_s": 0.5, **options}
        w = Webhooks(hooks, **options)
        if start:
            w.start()
        made.append(w)
        return w

    yield make
    for w in made:
        await w.close(0.5)


async def test_a_receiver_gets_each_alert_signed_exactly_once_when_the_first_delivery_fails(
    serve: Serve, webhooks: Callable[..., Webhooks]
) -> None:
    receiver = Receiver(script=[500, "ok", SLOW])  # the 1st alert fails, the 2nd times out
    url = await serve(receiver) + "/hook"
    w = webhooks({"pod_errors": [Hook(url, SECRET)]}, timeout_s=0.3)
    alerts = Alerts(Detectors(Rules()), None, w, backlog=dict)
    before = deliveries("pod_errors")
    sent = [alerts.emit("pod_errors", detail={"pod": POD_A, "n": i}) for i in range(3)]
    await eventually_async(
        lambda: len(receiver.acted) == 3 and len(receiver.raw) == 5, 30.0, "delivered"
    )
    await asyncio.sleep(0.5)  # nothing more comes
    assert [a["id"] for a in receiver.acted] == [a.id for a in sent]  # once each, in order
    assert receiver.acted[0] == {
        "id": sent[0].id,
        "kind": "pod_errors",
        "ts": sent[0].ts.isoformat(),
        "detail": {"pod": POD_A, "n": 0},
    }
    # At least once: the failed and the timed-out deliveries were sent again, byte for byte,
    # under the same id, each attempt signed.
    ids = [h["X-Llmgw-Alert-Id"] for h, _ in receiver.raw]
    assert ids == [sent[0].id, sent[0].id, sent[1].id, sent[1].id, sent[2].id]
    assert receiver.raw[0][1] == receiver.raw[1][1] == sent[0].body()
    assert all(receiver.verified(h, b) for h, b in receiver.raw)
    assert since(before, "pod_errors") == {"delivered": 3, "retried": 2}


async def test_retries_are_bounded_and_a_4xx_or_a_redirect_is_not_retried(
    serve: Serve, webhooks: Callable[..., Webhooks], caplog: pytest.LogCaptureFixture
) -> None:
    down, refusing, moved = Receiver(script=[503] * 10), Receiver(script=[400]), Receiver()
    down_url = await serve(down)
    hooks = {
        "fleet_5xx": [Hook(down_url + "/hook?token=t0ps3cret", SECRET)],
        "ledger_backlog": [Hook(await serve(refusing) + "/hook", SECRET)],
        "quota_refusals": [Hook(await serve(moved) + "/moved", SECRET)],
    }
    w = webhooks(hooks, attempts=3)
    before = {k: deliveries(k) for k in hooks}
    for kind in hooks:
        w.send(Alert(f"id-{kind}", kind, outcome(0).ts))
    await eventually_async(lambda: since(before["fleet_5xx"], "fleet_5xx").get("failed") == 1, 30.0)
    await eventually_async(
        lambda: since(before["quota_refusals"], "quota_refusals").get("rejected") == 1, 30.0
    )
    await eventually_async(
        lambda: since(before["ledger_backlog"], "ledger_backlog").get("rejected") == 1, 30.0
    )
    assert len(down.raw) == 3 and len(refusing.raw) == 1
    assert moved.raw == []  # the redirect's target, though on the same server, got nothing
    assert since(before["fleet_5xx"], "fleet_5xx") == {"retried": 2, "failed": 1}
    (failed,) = [r for r in caplog.records if getattr(r, "result", "") == "failed"]
    assert failed.hook == down_url.removeprefix("http://")  # type: ignore[attr-defined]
    assert "t0ps3cret" not in caplog.text + str(vars(failed))  # a URL's path may hold a token


async def test_what_is_left_at_shutdown_is_counted_dropped(
    serve: Serve, webhooks: Callable[..., Webhooks]
) -> None:
    receiver = Receiver(script=[503] * 100)
    w = webhooks({"pod_errors": [Hook(await serve(receiver) + "/hook", SECRET)]}, backoff_s=10)
    before = deliveries("pod_errors")
    for i in range(3):
        w.send(Alert(f"s{i}", "pod_errors", outcome(0).ts))
    await eventually_async(lambda: len(receiver.raw) == 1, 30.0)  # the first waits for its retry
    await w.close(0.1)
    w.send(Alert("late", "pod_errors", outcome(0).ts))
    assert since(before, "pod_errors") == {"retried": 1, "dropped": 4}


async def test_a_full_queue_drops_the_oldest_and_counts_it(
    serve: Serve, webhooks: Callable[..., Webhooks]
) -> None:
    receiver = Receiver()
    w = webhooks({"ratelimit_fail_open": [Hook(await serve(receiver) + "/hook", SECRET)]},
                 start=False, queue_max=2)  # fmt: skip
    before = deliveries("ratelimit_fail_open")
    for i in range(3):
        w.send(Alert(f"a{i}", "ratelimit_fail_open", outcome(0).ts))
    w.start()
    await eventually_async(lambda: len(receiver.acted) == 2, 30.0)
    assert [a["id"] for a in receiver.acted] == ["a1", "a2"]
    assert since(before, "ratelimit_fail_open") == {"dropped": 1, "delivered": 2}


async def test_each_kind_goes_to_its_own_hooks_only(
    serve: Serve, webhooks: Callable[..., Webhooks]
) -> None:
    support, success = Receiver(), Receiver(secret=b"another-secret-987654")
    support_url, success_url = await serve(support) + "/hook", await serve(success) + "/hook"
    w = webhooks({
        "platinum_breaker_open": [Hook(support_url, SECRET)],
        "quota_refusals": [Hook(support_url, SECRET), Hook(success_url, success.secret)],
    })  # fmt: skip
    for i, kind in enumerate(("platinum_breaker_open", "quota_refusals", "fleet_5xx")):
        w.send(Alert(f"k{i}", kind, outcome(0).ts))
    await eventually_async(lambda: len(support.acted) == 2 and len(success.acted) == 1, 30.0)
    await asyncio.sleep(0.3)
    assert [a["id"] for a in support.acted] == ["k0", "k1"]
    assert [a["id"] for a in success.acted] == ["k1"]  # verified with its own secret


# Settings, and the ledger process end to end.


def test_a_webhook_without_a_secret_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "ledger.yaml"
    config.write_text("alerts:\n  hooks:\n    fleet_5xx: [{url: 'https://ops.example/hook'}]\n")
    with pytest.raises(ConfigError, match=r"hooks\.fleet_5xx\.0: no secret"):
        load(Settings, config, ENV_PREFIX, {})
    env = {f"{ENV_PREFIX}__ALERTS__SECRET": "from-the-environment"}
    assert load(Settings, config, ENV_PREFIX, env).alerts.hooks["fleet_5xx"][0].secret is None
    with pytest.raises(ConfigError, match=r"alerts\.secret: .*at least 16") as short:
        load(Settings, config, ENV_PREFIX, {f"{ENV_PREFIX}__ALERTS__SECRET": "guessable-pass"})
    assert "guessable-pass" not in str(short.value)
    config.write_text("alerts:\n  hooks:\n    fleet_500: [{url: 'https://ops.example/h'}]\n")
    with pytest.raises(ConfigError, match=r"alerts\.hooks\.fleet_500"):
        load(Settings, config, ENV_PREFIX, env)


async def test_a_failing_evaluation_does_not_stop_the_alert_loop() -> None:
    calls = []

    def backlog() -> dict[str, int]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("not yet")
        return {"unwritten": 5}

    alerts = Alerts(Detectors(Rules()), None, None, backlog=backlog, interval_s=0.01)
    alerts.start()
    try:
        await eventually_async(lambda: len(calls) >= 3, 30.0, "evaluations after the failed one")
    finally:
        await alerts.close()


@pytest.fixture
def ledger_process(tmp_path: Path) -> Iterator[Callable[[dict[str, str]], tuple[str, str]]]:
    """start(env) → (access-log address, metrics URL) of `python -m ledger`, stopped after."""
    started: list[procs.Process] = []

    def start(env: dict[str, str]) -> tuple[str, str]:
        port, metrics_port = procs.free_port(), procs.free_port()
        env = {
            **os.environ,
            f"{ENV_PREFIX}__SERVE__PORT": str(port),
            f"{ENV_PREFIX}__SERVE__METRICS_PORT": str(metrics_port),
            f"{ENV_PREFIX}__REDIS__PORT": str(procs.free_port()),  # nobody there
            f"{ENV_PREFIX}__DRAIN_S": "0.5",
            **env,
        }
        address = f"127.0.0.1:{port}"
        proc = procs.Process(
            "ledger", [sys.executable, "-m", "ledger"], procs.grpc_serving(address, "ledger"),
            tmp_path / "ledger.log", env=env,
        )  # fmt: skip
        started.append(proc.start())
        return address, f"http://127.0.0.1:{metrics_port}/metrics"

    yield start
    for proc in started:
        proc.stop()


async def test_python_m_ledger_sends_a_fleet_5xx_alert_to_its_webhook(
    serve: Serve, ledger_process: Callable[[dict[str, str]], tuple[str, str]]
) -> None:
    hook_secret = "per-hook-secret-000"
    receiver = Receiver(secret=hook_secret.encode())
    url = await serve(receiver) + "/hook"
    address, _ = ledger_process({
        f"{ENV_PREFIX}__ALERTS__SECRET": "the-global-one-unused",
        f"{ENV_PREFIX}__ALERTS__HOOKS__FLEET_5XX": f"[{{url: '{url}', secret: {hook_secret}}}]",
        f"{ENV_PREFIX}__ALERTS__RULES__FLEET_5XX__MIN_ERRORS": "5",
        f"{ENV_PREFIX}__ALERTS__INTERVAL_S": "0.1",
    })  # fmt: skip
    message = als_pb2.StreamAccessLogsMessage()
    message.http_logs.log_entry.extend([entry(503, request_id=f"r{i}") for i in range(8)])

    def stream() -> None:
        with grpc.insecure_channel(address) as channel:
            als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs(iter([message]), timeout=5)

    await asyncio.to_thread(stream)
    await eventually_async(lambda: len(receiver.acted) == 1, 15, "the alert")
    await asyncio.sleep(0.5)  # one episode, one alert
    (alert,) = receiver.acted
    assert (alert["kind"], alert["detail"]["errors"]) == ("fleet_5xx", 8)
    assert len(receiver.raw) == 1
