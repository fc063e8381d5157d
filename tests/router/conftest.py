"""Helpers for the router tests: candidates, a fake vLLM /metrics pod, a real redis-server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from router.types import Candidate, PodMetrics
from tools import procs

VLLM_V1 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="{blocks}"}} 1.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.001",model_name="m"}} 0.0
vllm:time_to_first_token_seconds_count{{engine="0",model_name="m"}} 3.0
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{{engine="0",le="0.01",model_name="m"}} 0.0
vllm:inter_token_latency_seconds_sum{{engine="0",model_name="m"}} {itl_seconds}
vllm:inter_token_latency_seconds_count{{engine="0",model_name="m"}} {itl_count}
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} 12.0
"""


def metrics_text(
    running: float = 0,
    waiting: float = 0,
    kv: float = 0.0,
    blocks: int = 1000,
    itl: tuple[float, float] = (0.0, 0.0),
) -> str:
    """`itl`: the inter-token latency histogram's (sum, count)."""
    return VLLM_V1.format(
        running=running,
        waiting=waiting,
        kv=kv,
        blocks=blocks,
        itl_seconds=itl[0],
        itl_count=itl[1],
    )


def cand(
    pod: str,
    running: float = 0,
    waiting: float = 0,
    kv: float = 0.0,
    in_flight: int = 0,
    capacity: float = 10,
    fresh: bool = True,
    healthy: bool = True,
    models: frozenset[str] = frozenset(),
    blocks: int | None = None,
) -> Candidate:
    snap = PodMetrics(
        pod,
        0.0,
        ok=healthy,
        running=running,
        waiting=waiting,
        kv_usage=kv,
        block_size=16 if blocks is not None else None,
        num_gpu_blocks=blocks,
        models=models,
    )
    return Candidate.of(snap, healthy, fresh, in_flight, capacity)


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakePod:
    """A tiny aiohttp app answering /metrics and /v1/models with what the test sets."""

    status: int = 200
    text: str = field(default_factory=metrics_text)
    models: list[str] = field(default_factory=lambda: ["m"])
    contexts: dict[str, int] = field(default_factory=dict)  # max_model_len in /v1/models
    pod: str = ""
    hits: int = 0
    tail: bytes = b""  # raw bytes after the text (not necessarily UTF-8)

    async def metrics(self, _: web.Request) -> web.Response:
        self.hits += 1
        body = self.text.encode() + self.tail
        return web.Response(status=self.status, body=body, content_type="text/plain")

    async def v1_models(self, _: web.Request) -> web.Response:
        cards = [{"id": m} | self._context(m) for m in self.models]
        return web.json_response({"object": "list", "data": cards})

    def _context(self, model: str) -> dict[str, int]:
        return {"max_model_len": self.contexts[model]} if model in self.contexts else {}


@pytest.fixture
async def fake_pods() -> AsyncIterator[list[FakePod]]:
    """Three fake pods on 127.0.0.1 free ports."""
    pods: list[FakePod] = []
    runners: list[web.AppRunner] = []
    for _ in range(3):
        pod = FakePod()
        app = web.Application()
        app.router.add_get("/metrics", pod.metrics)
        app.router.add_get("/v1/models", pod.v1_models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = procs.free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        pod.pod = f"127.0.0.1:{port}"
        pods.append(pod)
        runners.append(runner)
    yield pods
    for runner in runners:
        await runner.cleanup()


@pytest.fixture(scope="session")
def redis_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = procs.free_port()
    log = Path(tmp_path_factory.mktemp("redis")) / "redis.log"
    proc = procs.Process(
        "redis",
        [procs.bin_path("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
        procs.redis_ping("127.0.0.1", port),
        log,
    ).start()
    yield port
    proc.stop()
