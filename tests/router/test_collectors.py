"""The collectors: parsing and scraping the pods' pages, resolving the pods."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from envoy.data.accesslog.v3 import accesslog_pb2

from router.collectors import outcomes, scrape
from router.collectors.resolver import Resolver
from router.collectors.scrape import parse_metrics
from router.collectors.scraper import Scraper
from router.fleet import DnsTarget, Fleet, FleetSettings
from sim.pod import SimPod
from sim.types import DEFAULT_MODEL, SimSettings
from tests.router.conftest import Clock, FakePod, metrics_text


def test_parse_v1_names_and_cache_config() -> None:
    p = parse_metrics(metrics_text(running=3, waiting=2, kv=0.25, blocks=777, itl=(1.5, 100)))
    assert (p.running, p.waiting, p.kv_usage) == (3.0, 2.0, 0.25)
    assert (p.block_size, p.num_gpu_blocks) == (16, 777)
    assert (p.itl_seconds, p.itl_count) == (1.5, 100.0)


def test_parse_older_gpu_cache_name_and_several_engines() -> None:
    text = (
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 3.0\n'
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.2\n'
        'vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.4\n'
        "vllm:num_requests_waiting 1\n"
        "vllm:num_requests_waiting_by_reason 9\n"
    )
    p = parse_metrics(text)
    assert (p.running, p.waiting) == (5.0, 1.0)
    assert p.kv_usage == pytest.approx(0.3)
    assert p.block_size is None


def test_parse_prefers_v1_kv_name_and_ignores_garbage() -> None:
    text = (
        "vllm:kv_cache_usage_perc 0.5\nvllm:gpu_cache_usage_perc 0.9\nvllm:num_requests_running x\n"
    )
    p = parse_metrics(text)
    assert p.kv_usage == 0.5 and p.running == 0.0


async def test_scrape_reads_metrics_and_models(fake_pods: list[FakePod]) -> None:
    a, b, c = fake_pods
    a.text = metrics_text(running=4, waiting=1, kv=0.5, blocks=2048)
    b.models = ["other"]
    fleet = Fleet(FleetSettings(scrape_timeout=1.0))
    fleet.set_pods([a.pod, b.pod, c.pod])
    scraper = Scraper(fleet)
    async with aiohttp.ClientSession() as session:
        await scraper.scrape_once(session)
    snap = fleet.snapshots[a.pod]
    assert snap.ok and (snap.running, snap.waiting, snap.kv_usage) == (4, 1, 0.5)
    assert snap.kv_tokens == 2048 * 16 and snap.models == frozenset({"m"})
    assert fleet.snapshots[b.pod].models == frozenset({"other"})
    assert all(c.healthy and c.fresh for c in fleet.candidates())


async def test_the_scrapes_send_the_pods_key() -> None:
    """A pod run with vLLM's --api-key answers /v1/models only with it: without the key the
    router would know none of its models."""
    key = "9f2c41e8a7b3d6055f1e2a9c0b7d64e3"
    async with SimPod(SimSettings(port=0, api_key=key)) as pod:
        address = pod.url.removeprefix("http://")
        for given, models in ((None, frozenset()), (key, frozenset({DEFAULT_MODEL}))):
            fleet = Fleet(FleetSettings(scrape_timeout=1.0, pod_api_key=given))
            fleet.set_pods([address])
            scraper = Scraper(fleet)
            async with scraper.session() as session:
                await scraper.scrape_once(session)
            assert fleet.snapshots[address].models == models, given


async def test_candidates_carry_each_pods_speed_from_its_inter_token_latency(
    fake_pods: list[FakePod],
) -> None:
    clock = Clock()
    fleet = Fleet(FleetSettings(scrape_timeout=1.0), clock=clock)
    fleet.set_pods([p.pod for p in fake_pods])
    scraper = Scraper(fleet)
    fast, slow, idle = fake_pods
    async with aiohttp.ClientSession() as session:
        await scraper.scrape_once(session)
        fast.text = metrics_text(itl=(1.0, 100))  # 10 ms a token
        slow.text = metrics_text(itl=(2.0, 100))  # 20 ms: half as fast
        clock.now += 1
        await scraper.scrape_once(session)
    speeds = {c.pod: c.speed for c in fleet.candidates()}
    assert speeds == {fast.pod: 1.0, slow.pod: 0.5, idle.pod: 1.0}  # no tokens yet: full speed


async def test_failed_scrape_makes_pod_unpickable_until_it_recovers(
    fake_pods: list[FakePod],
) -> None:
    a, b, _ = fake_pods
    fleet = Fleet(FleetSettings(scrape_timeout=1.0))
    fleet.set_pods([a.pod, b.pod])
    scraper = Scraper(fleet)
    a.status = 500
    async with aiohttp.ClientSession() as session:
        await scraper.scrape_once(session)
        healthy = {c.pod: c.healthy for c in fleet.candidates()}
        assert healthy == {a.pod: False, b.pod: True}
        a.status = 200
        await scraper.scrape_once(session)
    assert all(c.healthy for c in fleet.candidates())


async def test_unreachable_pod_is_unpickable() -> None:
    fleet = Fleet(FleetSettings(scrape_timeout=0.2))
    fleet.set_pods(["127.0.0.1:1"])
    scraper = Scraper(fleet)
    async with aiohttp.ClientSession() as session:
        await scraper.scrape_once(session)
    assert not fleet.candidates()[0].healthy


async def test_resolve_static_and_dns_targets() -> None:
    fleet = Fleet(
        FleetSettings(pods=["127.0.0.1:8001"], dns=DnsTarget(name="localhost", port=8002))
    )
    found = await Resolver(fleet).resolve()
    assert "127.0.0.1:8001" in found and "127.0.0.1:8002" in found
    fleet.set_pods(found)
    fleet.set_pods(["127.0.0.1:8001"])
    assert list(fleet.snapshots) == ["127.0.0.1:8001"]


async def test_one_pods_unreadable_page_stops_no_scrape(
    fake_pods: list[FakePod], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stray non-UTF-8 byte on a page is read past; a scrape that fails in a way no page
    should cause counts as that pod's failed scrape, and the others' scrapes go on (one pod's
    page once ended the scrape loop, and every pod went stale for good)."""
    a, b, c = fake_pods
    a.tail = b"# \xff\xfe\n"
    fleet = Fleet(FleetSettings(pods=[p.pod for p in fake_pods], scrape_timeout=1.0))
    fleet.set_pods(await Resolver(fleet).resolve())
    scraper = Scraper(fleet)
    real = scrape.scrape_metrics

    async def broken(session: Any, pod: str, *args: Any) -> Any:
        if pod == b.pod:
            raise RuntimeError("a bug")
        return await real(session, pod, *args)

    monkeypatch.setattr("router.collectors.scraper.scrape_metrics", broken)
    async with aiohttp.ClientSession() as session:
        await scraper.scrape_once(session)
    assert {p: s.ok for p, s in fleet.snapshots.items()} == {a.pod: True, b.pod: False, c.pod: True}


def test_an_outcome_says_when_the_pods_last_byte_arrived_on_the_fleets_clock() -> None:
    entry = accesslog_pb2.HTTPAccessLogEntry()
    assert outcomes.ended_at(entry, 0.0) is None  # no answer from a pod: not known
    common = entry.common_properties
    common.start_time.FromNanoseconds(1_700_000_000_250_000_000)
    common.time_to_last_upstream_rx_byte.FromMilliseconds(1500)
    found = outcomes.ended_at(entry, -1_699_999_000.0)  # Envoy's wall clock → the fleet's
    assert found == pytest.approx(1001.75)


def test_a_brace_in_a_quoted_label_value_and_an_exemplar_are_read_as_vllm_means_them() -> None:
    p = parse_metrics(
        'vllm:num_requests_running{model_name="a} b",x="q\\"} "} 3\n'
        'vllm:num_requests_waiting{model_name="m"} 2 # {trace_id="ab"} 1.0\n'
        'vllm:cache_config_info{block_size="16",x="}",num_gpu_blocks="9"} 1\n'
    )
    assert (p.running, p.waiting, p.block_size, p.num_gpu_blocks) == (3, 2, 16, 9)
