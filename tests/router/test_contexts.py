"""The fleet's contexts: each served model's least max_model_len, from the pods' /v1/models."""

from __future__ import annotations

import aiohttp
from prometheus_client import REGISTRY

from router.collectors.scraper import Scraper
from router.fleet import Fleet, FleetSettings
from sim.pod import SimPod
from sim.types import DEFAULT_MODEL, SimSettings
from tests.router.conftest import FakePod


def gauge(model: str) -> float | None:
    return REGISTRY.get_sample_value("llmgw_router_model_context_tokens", {"model": model})


async def test_each_model_gets_the_least_context_of_the_pods_serving_it(
    fake_pods: list[FakePod],
) -> None:
    a, b, c = fake_pods
    a.models, a.contexts = ["ctx-m"], {"ctx-m": 1200}
    b.models, b.contexts = ["ctx-m", "ctx-other"], {"ctx-m": 4096, "ctx-other": 2048}
    c.models = ["ctx-m"]  # publishes no context: it bounds nothing
    fleet = Fleet(FleetSettings(scrape_timeout=1.0))
    fleet.set_pods([a.pod, b.pod, c.pod])
    scraper = Scraper(fleet)
    async with aiohttp.ClientSession() as session:
        await scraper.scrape_once(session)
        assert fleet.contexts.current == {"ctx-m": 1200, "ctx-other": 2048}
        assert (gauge("ctx-m"), gauge("ctx-other")) == (1200, 2048)

        a.status = 500  # a pod failing its scrapes keeps its last models: it may serve again
        await scraper.scrape_once(session)
        assert fleet.contexts.context("ctx-m") == 1200

        fleet.set_pods([b.pod, c.pod])  # a left the fleet
        assert fleet.contexts.context("ctx-m") == 4096 and gauge("ctx-m") == 4096

        fleet.set_pods([c.pod])  # the models no pod publishes a context for: unknown
        assert fleet.contexts.current == {}
        assert fleet.contexts.context("ctx-m") is None
        assert (gauge("ctx-m"), gauge("ctx-other")) == (None, None)


async def test_a_simulated_pod_publishes_its_context() -> None:
    """The simulator's card carries --max-model-len as vLLM's does (tests/sim/test_vllm_fidelity.py
    holds the card to a real pod's)."""
    async with SimPod(SimSettings(port=0, max_model_len=1200)) as pod:
        fleet = Fleet(FleetSettings(scrape_timeout=1.0))
        fleet.set_pods([pod.url.removeprefix("http://")])
        scraper = Scraper(fleet)
        async with scraper.session() as session:
            await scraper.scrape_once(session)
    assert fleet.contexts.current == {DEFAULT_MODEL: 1200}
