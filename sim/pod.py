"""One simulated vLLM pod: the engine, its metrics and the HTTP server, in the current loop.

async with SimPod(SimSettings(port=0, time_scale=0.01)) as pod:
    ...  # pod.url
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from types import TracebackType

from aiohttp import web

from llmgw.config import ConfigError
from sim.engine import Engine
from sim.faults import FaultState
from sim.kvevents import KvEventPublisher
from sim.metrics import Collector, Stats, registry
from sim.profile import PROFILES
from sim.service import Service
from sim.types import SimSettings

log = logging.getLogger(__name__)


def crash() -> None:
    """The `die` fault: exit at once with code 1, like a pod whose engine crashed."""
    os._exit(1)


class SimPod:
    def __init__(self, settings: SimSettings, die: Callable[[], None] = crash) -> None:
        if settings.profile not in PROFILES:
            known = ", ".join(sorted(PROFILES))
            raise ConfigError(f"profile: unknown {settings.profile!r} (known: {known})")
        # Like vLLM, the context length cannot exceed what the KV cache holds.
        capacity = settings.num_gpu_blocks * settings.block_size
        self.settings = settings.model_copy(
            update={"max_model_len": min(settings.max_model_len, capacity)}
        )
        self.stats = Stats()
        self.engine = Engine(self.settings, PROFILES[settings.profile], self.stats)
        self.faults = FaultState(settings.seed)
        collector = Collector(self.settings, self.stats, self.engine.gauges)
        self.service = Service(self.settings, self.engine, registry(collector), self.faults, die)
        self.kv_events: KvEventPublisher | None = None
        self._runner: web.AppRunner | None = None
        self.port = settings.port

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    async def start(self) -> SimPod:
        runner = web.AppRunner(
            self.service.app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await runner.setup()
        self._runner = runner
        site = web.TCPSite(runner, self.settings.host, self.settings.port)
        await site.start()
        self.port = int(runner.addresses[0][1])
        config = self.settings.kv_events_config
        if config.publishes:
            self.kv_events = KvEventPublisher(config, self.faults)
            self.kv_events.start()
            self.engine.publish = self.kv_events.publish
        self.engine.start()
        log.info("sim pod serving", extra={"url": self.url, "model": self.settings.model})
        return self

    async def close(self) -> None:
        self.service.closing.set()
        await self.engine.stop()
        if self.kv_events is not None:
            await self.kv_events.close()
            self.kv_events = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> SimPod:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
