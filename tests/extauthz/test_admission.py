"""The rate limiter inside extauthz (settings `admit`): a real redis-server, real gRPC."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.service.auth.v3 import external_auth_pb2
from google.protobuf import json_format
from google.rpc import code_pb2
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from extauthz import answers, metrics, tenants
from extauthz.__main__ import admitting as limiter_settings
from extauthz.__main__ import cli as service_cli
from extauthz.__main__ import held_limiter
from extauthz.__main__ import settings as extauthz_settings
from extauthz.context import RequestContext, Timings
from extauthz.director import Director
from extauthz.service import register
from extauthz.store import tenants_store
from extauthz.types import Allow
from llmgw import wire
from llmgw.redisconf import RedisSettings
from ratelimit.runtime import RateLimiter
from ratelimit.settings import FailoverSettings, Settings
from router.runtime import Router
from router.types import PodMetrics
from tests.extauthz.conftest import Keys, make_decider
from tests.extauthz.test_service import (
    CHAT,
    PODS,
    Stub,
    _settings_file,
    check_request,
    header_map,
    make_router,
)
from tools.procs import free_port

# The custom tier "gold" (globex) at 3 requests a minute: the fourth is refused.
LIMITS = "tiers:\n  gold: {requests: {minute: 3}, tokens: {minute: 900000}}\n"


class Admitting:
    def __init__(
        self,
        stub: Any,
        service: Director,
        limiter: RateLimiter,
        router: Router,
        spans: InMemorySpanExporter,
    ) -> None:
        self.stub = stub
        self.service = service
        self.limiter = limiter
        self.router = router
        self.spans = spans


async def _admitting(
    tmp_path: Path,
    tenants_file: Path,
    tiers_file: Path,
    redis_port: int,
    admit_timeout_s: float = 1.0,
    tiers: str = LIMITS,
) -> AsyncIterator[Admitting]:
    await asyncio.to_thread(tiers_file.write_text, tiers)
    store = tenants_store(tenants_file, tiers_file)
    redis = RedisSettings(port=redis_port, connect_timeout_s=0.2)
    failover = FailoverSettings(deadline_ms=200)
    # As extauthz's `admitting` hands it over: the limiter's tier table is extauthz's. Its reload
    # interval does not apply to a held limiter; one that watched the table on its own would
    # not see a change within a test (the new-tier test below then fails every time).
    held = Settings(tiers_file=tiers_file, reload_interval_s=60, redis=redis, failover=failover)
    limiter = held_limiter(held, store)
    await limiter.start()
    router = make_router()
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracer = provider.get_tracer("test")
    service = Director(
        store,
        make_decider(),
        tracer,
        router=router,
        limiter=limiter,
        admit_timeout_s=admit_timeout_s,
    )
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    register(service)(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Admitting(Stub(channel), service, limiter, router, spans)
    finally:
        await server.stop(0)
        await limiter.stop()


@pytest.fixture
async def admitting(
    tmp_path: Path, tenants_file: Path, tiers_file: Path, keys: Keys, redis: int
) -> AsyncIterator[Admitting]:
    async for a in _admitting(tmp_path, tenants_file, tiers_file, redis):
        yield a


def check(key: str, request_id: str) -> external_auth_pb2.CheckRequest:
    return check_request({"api-key": key, "x-request-id": request_id}, CHAT)


# The same tier with room for every burst below.
ROOMY = "tiers:\n  gold: {requests: {minute: 100000}, tokens: {minute: 900000000}}\n"


@pytest.fixture
async def roomy(
    tmp_path: Path, tenants_file: Path, tiers_file: Path, keys: Keys, redis: int
) -> AsyncIterator[Admitting]:
    async for a in _admitting(tmp_path, tenants_file, tiers_file, redis, tiers=ROOMY):
        yield a


def _headers(key: str, request_id: str) -> dict[str, str]:
    """A chat request's headers as the check reads them (no gRPC: checks run side by side)."""
    return {
        ":method": "POST",
        ":path": "/v1/chat/completions",
        "api-key": key,
        "content-type": "application/json",
        "x-request-id": request_id,
    }


async def _burst(admitting: Admitting, key: str, n: int = 20) -> Counter[str]:
    """n checks at once, all choosing their pod before any admission is answered; how many
    went to each pod first."""
    checks = (admitting.service.check(_headers(key, f"burst-{i}"), CHAT) for i in range(n))
    answers = await asyncio.gather(*checks)
    assert all(a.allowed for a in answers)
    return Counter(str(a.metadata[wire.DESTINATION_ENDPOINT]).split(",")[0] for a in answers)


async def test_checks_answered_together_spread_over_the_pods(roomy: Admitting, keys: Keys) -> None:
    """Each choice counts in flight at once: the checks whose admissions are under way together
    see each other's choices, and do not all go to the pod that looked idlest."""
    busy, idle = PODS
    fleet = roomy.router.fleet
    fleet.snapshots[busy] = PodMetrics(
        busy, fleet.clock(), ok=True, running=2, kv_usage=0.2, models=frozenset({"llama-3-8b"})
    )
    first = await _burst(roomy, keys.globex)
    assert first[idle] <= 15 and first[busy] >= 5, first
    assert fleet.in_flight == first


async def test_a_pod_on_probation_gets_one_check_of_a_burst(roomy: Admitting, keys: Keys) -> None:
    """A pod back from a cooldown takes one pick at a time until one answers well: the checks
    admitted together count as concurrent picks."""
    fleet = roomy.router.fleet
    for _ in range(fleet.settings.error_threshold):
        fleet.report(PODS[0], 503)
    later = fleet.clock() + fleet.settings.error_cooldown + 0.1
    fleet.clock = lambda: later  # its cooldown is over: on probation
    assert fleet.pickable(PODS[0], later)
    first = await _burst(roomy, keys.globex)
    assert first[PODS[0]] <= 1, first


async def test_an_abandoned_check_gives_its_pod_back(
    roomy: Admitting, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Envoy gives up on checks while their admissions are under way: no pod stays held."""
    admit = roomy.limiter.limiter.admit

    async def slow(*args: Any) -> Any:
        verdict = await admit(*args)
        await asyncio.sleep(0.3)
        return verdict

    monkeypatch.setattr(roomy.limiter.limiter, "admit", slow)
    checks = [
        asyncio.ensure_future(roomy.service.check(_headers(keys.globex, f"gone-{i}"), CHAT))
        for i in range(5)
    ]
    await asyncio.sleep(0.1)
    assert sum(roomy.router.fleet.in_flight.values()) == 5  # chosen, counted in flight
    for task in checks:
        task.cancel()
    await asyncio.gather(*checks, return_exceptions=True)
    assert sum(roomy.router.fleet.in_flight.values()) == 0


def _picks() -> float:
    return sum(
        sample.value
        for metric in REGISTRY.collect()
        if metric.name == "llmgw_router_picks"
        for sample in metric.samples
        if sample.name == "llmgw_router_picks_total"
    )


async def test_the_pod_is_chosen_while_the_admission_is_under_way(
    admitting: Admitting, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The admission's round trip to Redis leaves before the pod is chosen, so the choice
    overlaps it (Redis on another core or host works meanwhile); the pod is held after."""
    seen: list[tuple[bool, bool]] = []
    admitting_now = {"started": False, "done": False}
    limiter, router = admitting.limiter.limiter, admitting.router
    admit, choose = limiter.admit, router.choose

    async def timed_admit(*args: Any) -> Any:
        admitting_now["started"] = True
        verdict = await admit(*args)
        admitting_now["done"] = True
        return verdict

    def observed_choose(*args: Any, **kwargs: Any) -> Any:
        seen.append((admitting_now["started"], admitting_now["done"]))
        return choose(*args, **kwargs)

    monkeypatch.setattr(limiter, "admit", timed_admit)
    monkeypatch.setattr(router, "choose", observed_choose)
    reply = await admitting.stub.Check(check(keys.globex, "overlap-1"))
    assert reply.status.code == code_pb2.OK
    assert seen == [(True, False)]  # started, not yet answered
    assert json_format.MessageToDict(reply.dynamic_metadata)[wire.DESTINATION_ENDPOINT]
    assert sum(router.fleet.in_flight.values()) == 1


async def test_the_limiter_inside_admits_refuses_and_picks_only_what_it_admits(
    admitting: Admitting, keys: Keys
) -> None:
    timed = REGISTRY.get_sample_value("llmgw_ratelimit_decision_seconds_count") or 0.0
    picks = _picks()
    replies = await asyncio.gather(
        *(admitting.stub.Check(check(keys.globex, f"r{i}")) for i in range(40))
    )
    assert REGISTRY.get_sample_value("llmgw_ratelimit_decision_seconds_count") == timed + 40
    admitted = [r for r in replies if r.status.code == code_pb2.OK]
    refused = [r for r in replies if r.status.code != code_pb2.OK]
    assert len(admitted) == 3 and len(refused) == 37  # a burst of 40 against 3 a minute

    for reply in admitted:
        rate = header_map(reply.ok_response.response_headers_to_add)
        assert rate["x-ratelimit-limit-requests"] == "3"
        assert int(rate["x-ratelimit-remaining-requests"]) in (0, 1, 2)
        meta = json_format.MessageToDict(reply.dynamic_metadata)
        assert meta[wire.META_DECIDED] is True and meta[wire.DESTINATION_ENDPOINT]
    # Every request's pod is chosen during its admission, but only the admitted hold one in
    # flight and count as picks.
    assert sum(admitting.router.fleet.in_flight.values()) == 3
    assert _picks() == picks + 3

    for reply in refused:
        assert reply.status.code == code_pb2.RESOURCE_EXHAUSTED
        denied = reply.denied_response
        assert denied.status.code == 429
        error = json.loads(denied.body)["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
        headers = header_map(denied.headers)
        assert headers["content-type"] == "application/json"
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert int(headers["retry-after"]) >= 1
        assert headers[wire.HEADER_SESSION].startswith("sess_")  # as every answer carries it
        # The access log still learns whose request it refused (and the ledger releases nothing).
        meta = json_format.MessageToDict(reply.dynamic_metadata)
        assert meta[wire.META_TENANT] == "globex" and meta[wire.META_DECIDED] is True
        assert wire.DESTINATION_ENDPOINT not in meta
    # Each Check's span says how the admission went, with the tenant and session.
    checks = [s for s in admitting.spans.get_finished_spans() if s.name == "extauthz.check"]
    results = sorted(str((s.attributes or {}).get("llmgw.ratelimit.result")) for s in checks)
    assert results == ["ok"] * 3 + ["requests"] * 37
    assert all((s.attributes or {}).get("tenant.id") == "globex" for s in checks)


async def test_the_request_carries_what_each_stage_decided(
    admitting: Admitting, keys: Keys
) -> None:
    """The director's stages fill in one typed request: the admitted one holds its pods, which
    the answer names; a refused one gave them back."""
    director = admitting.service
    requests = []
    for i in range(4):  # gold's 3 a minute: the fourth is refused
        headers = _headers(keys.globex, f"typed-{i}")
        decision = director.decider.decide(director.store.current, headers, CHAT, director.clock())
        assert isinstance(decision, Allow)
        request = RequestContext(decision, Timings(decide=0.0))
        requests.append((request, await director.direct(request)))
    for request, answer in requests[:3]:
        assert answer.allowed and request.verdict is not None and request.verdict.allowed
        assert request.admission is not None and request.admission.tenant == "globex"
        assert request.timings.admit is not None and request.timings.admit > 0
        assert request.chosen is None and request.pods
        assert answer.metadata[wire.DESTINATION_ENDPOINT] == ",".join(request.pods)
    refused, answer = requests[3]
    assert answer.status == 429 and refused.verdict is not None and not refused.verdict.allowed
    assert refused.chosen is None and refused.pods == ()
    assert sum(admitting.router.fleet.in_flight.values()) == 3


async def test_a_tenants_own_limit_reaches_the_limiter_inside(
    admitting: Admitting, keys: Keys
) -> None:
    """acme's rpm override in the tenants file (100) replaces its tier's."""
    reply = await admitting.stub.Check(check(keys.acme, "acme-1"))
    assert reply.status.code == code_pb2.OK
    assert header_map(reply.ok_response.response_headers_to_add)["x-ratelimit-limit-requests"] == (
        "100"
    )


def move_globex_to_a_new_tier(tiers_file: Path, tenants_file: Path) -> None:
    """The tier "diamond" (2 requests a minute) added, then globex moved onto it."""
    tiers_file.write_text(LIMITS + "  diamond: {requests: {minute: 2}, tokens: {minute: 900000}}\n")
    with tenants.editing(tenants_file):
        data = tenants.read(tenants_file)
        moved = tuple(
            t.model_copy(update={"tier": "diamond"}) if t.id == "globex" else t
            for t in data.tenants
        )
        tenants.write(tenants_file, data.model_copy(update={"tenants": moved}))


async def test_a_tenant_moved_onto_a_new_tier_is_limited_by_it_from_its_first_request(
    admitting: Admitting, tiers_file: Path, tenants_file: Path, keys: Keys
) -> None:
    """One load of the tier table in the process: the first check decided once the tenants
    snapshot shows the tenant on a tier just added is limited by that tier. A second watch of
    the same file (the limiter's own, every 0.5 s beside the snapshot's 0.25 s) left it on the
    default tier (free: 600 a minute) until that watch came round."""
    store = admitting.service.store
    await asyncio.to_thread(move_globex_to_a_new_tier, tiers_file, tenants_file)
    assert await store.reload_if_changed()  # the snapshot's watch coming round: one poll
    assert store.current.tenants["globex"].tier == "diamond"
    replies = [await admitting.stub.Check(check(keys.globex, f"moved-{i}")) for i in range(3)]
    assert [r.status.code for r in replies] == [code_pb2.OK] * 2 + [code_pb2.RESOURCE_EXHAUSTED]
    limit = header_map(replies[0].ok_response.response_headers_to_add)["x-ratelimit-limit-requests"]
    assert limit == "2"


async def test_a_limiter_that_raises_costs_the_admission_not_the_request(
    admitting: Admitting, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*_: object) -> None:
        raise RuntimeError("limiter bug")

    monkeypatch.setattr(admitting.limiter.limiter, "admit", broken)
    before = metrics.admit_errors("error")._value.get()
    reply = await admitting.stub.Check(check(keys.globex, "bug-1"))
    assert reply.status.code == code_pb2.OK
    meta = json_format.MessageToDict(reply.dynamic_metadata)
    assert wire.META_DECIDED not in meta  # the ledger sees an admission nobody checked
    assert meta[wire.DESTINATION_ENDPOINT]
    assert metrics.admit_errors("error")._value.get() == before + 1


async def test_a_bug_in_the_limiters_answer_costs_it_not_the_request(
    admitting: Admitting, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object) -> None:
        raise RuntimeError("answer bug")

    monkeypatch.setattr(answers, "rate_headers", broken)
    before = metrics.admit_errors("error")._value.get()
    reply = await admitting.stub.Check(check(keys.globex, "answer-1"))
    assert reply.status.code == code_pb2.OK
    assert json_format.MessageToDict(reply.dynamic_metadata)[wire.DESTINATION_ENDPOINT]
    assert metrics.admit_errors("error")._value.get() == before + 1


async def test_an_admission_over_its_budget_goes_on_unchecked_in_time(
    tmp_path: Path, tenants_file: Path, tiers_file: Path, keys: Keys, redis: int
) -> None:
    """However slow the limiter (Redis answering late on each of a borrowing admission's round
    trips), the Check answers within the budget, far inside Envoy's 2 s wait that fails closed."""
    async for a in _admitting(tmp_path, tenants_file, tiers_file, redis, admit_timeout_s=0.3):

        async def slow(*_: object) -> None:
            await asyncio.sleep(5)  # Redis answering late, round trip after round trip

        a.limiter.limiter.admit = slow  # type: ignore[method-assign,assignment]
        before = metrics.admit_errors("timeout")._value.get()
        started = time.monotonic()
        reply = await a.stub.Check(check(keys.globex, "slow-1"))
        assert time.monotonic() - started < 1.0
        assert reply.status.code == code_pb2.OK
        meta = json_format.MessageToDict(reply.dynamic_metadata)
        assert wire.META_DECIDED not in meta and meta[wire.META_TENANT] == "globex"
        assert metrics.admit_errors("timeout")._value.get() == before + 1


async def test_with_redis_down_the_limiter_inside_still_decides_within_its_deadline(
    tmp_path: Path, tenants_file: Path, tiers_file: Path, keys: Keys
) -> None:
    """No Redis at all: the limiter's degraded mode (in-process counts) decides, within the
    deadline, so extauthz never stalls; the tier's 3 a minute still holds on this replica."""
    async for a in _admitting(tmp_path, tenants_file, tiers_file, free_port()):
        replies = []
        for i in range(6):
            started = time.monotonic()
            replies.append(await a.stub.Check(check(keys.globex, f"d{i}")))
            assert time.monotonic() - started < 1.0  # each inside Envoy's 2 s wait
        codes = [r.status.code for r in replies]
        assert codes == [code_pb2.OK] * 3 + [code_pb2.RESOURCE_EXHAUSTED] * 3
        assert sorted(a.router.fleet.in_flight) == PODS


def test_the_limiter_inside_reads_extauthzs_tier_table(
    tmp_path: Path, tenants_file: Path, keys: Keys
) -> None:
    """One tier table: left unset, the limiter's is extauthz's (else a tenant's custom tier
    would run on the default tier's limits); another one is refused at --check-config."""
    good = _settings_file(tmp_path, tenants_file, 0)
    tiers = Path(yaml.safe_load(good.read_text())["tiers_file"])
    limiter_file = tmp_path / "ratelimit.yaml"
    limiter_file.write_text("{}")
    config = tmp_path / "admitting.yaml"
    settings = {**yaml.safe_load(good.read_text()), "topology": "epp"}
    config.write_text(yaml.safe_dump({**settings, "ratelimit_config": str(limiter_file)}))
    assert service_cli(["--check-config", str(config)]) == 0
    assert limiter_settings(extauthz_settings(config)).tiers_file == tiers
    other = tmp_path / "other-tiers.yaml"
    other.write_text(tiers.read_text())
    limiter_file.write_text(yaml.safe_dump({"tiers_file": str(other)}))
    assert service_cli(["--check-config", str(config)]) == 1
    limiter_file.write_text(yaml.safe_dump({"tiers_file": str(tiers)}))  # the same file
    assert service_cli(["--check-config", str(config)]) == 0
    config.write_text(yaml.safe_dump({**settings, "topology": "rls", "ratelimit_config": "x"}))
    assert service_cli(["--check-config", str(config)]) == 1  # settings nothing would read
