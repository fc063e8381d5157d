"""Each record is priced by the price table in force when it is recorded (the tier table's,
reloaded while the ledger runs), and given its GPU time from its pod's batch."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from ledger.gputime import Batches
from ledger.recorder import Recorder
from llmgw.link import RedisLink
from llmgw.outcome import Outcome
from llmgw.podbatches import PodBatches, Scrape
from llmgw.prices import ModelPrice, Prices
from tests.ledger.conftest import T0, outcome
from tests.ratelimit.rl_redis import redis_port, start_redis

POD = "10.0.0.1:8000"
USED = {
    "pod": POD,
    "prompt_tokens": 100,
    "cached_tokens": 40,
    "completion_tokens": 10,
    "duration_ms": 2000.0,
    "endpoint": "/v1/chat/completions",
}


class Sink:
    def __init__(self) -> None:
        self.records: list[Outcome] = []

    def submit(self, records: Sequence[Outcome]) -> None:
        self.records += records


async def stored(sink: Sink, n: int) -> None:
    """Until `n` records reached the sink (bounded: 10 s)."""
    for _ in range(200):
        if len(sink.records) >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{len(sink.records)} of {n} records stored")


async def test_records_are_priced_by_the_table_in_force(tmp_path: Path) -> None:
    redis = start_redis(tmp_path)
    table = Prices(currency="EUR", models={"m": ModelPrice(input=Decimal(2), output=Decimal(8))})
    sink = Sink()
    batches = Batches(clock=T0.timestamp)
    batches.observe(PodBatches(ts=T0.timestamp(), pods={POD: [Scrape(T0.timestamp(), 4.0)]}))
    recorder = Recorder(
        RedisLink("127.0.0.1", redis_port(redis), 1.0), sink, batch_max=10, pending_max=1000,
        done_ttl_s=60, timeout_s=2.0, retry_max_s=0.1, prices=lambda: table, batches=batches,
    )  # fmt: skip
    recorder.start()
    try:
        recorder.add([outcome(1, model="m", **USED), outcome(2, model="unpriced", **USED)])
        await stored(sink, 2)
        # Reloaded: what is recorded from now on; nothing recorded before is priced again.
        table = Prices(default=ModelPrice(input=Decimal(1), output=Decimal("0.5")))
        recorder.add(
            [
                outcome(3, model="m", queue_ms=1500.0, **USED),
                outcome(4, model="m", status=429),
                outcome(5, **{**USED, "endpoint": "/v1/models"}),
            ]
        )
        await stored(sink, 5)
    finally:
        await recorder.close(1.0)
        redis.stop()
    priced = {r.request_id: (r.cost_micros, r.currency) for r in sink.records}
    # Its pod's time shared with a batch of 4 for 2 s; none without a pod.
    gpu = {r.request_id: r.gpu_seconds for r in sink.records}
    assert gpu["req-000001"] == pytest.approx(0.5) and gpu["req-000004"] is None
    assert gpu["req-000005"] is None  # a pod's model list is no GPU time
    # Held 1.5 s of its 2 in flow control's queue: on its pod for 0.5 s only.
    assert gpu["req-000003"] == pytest.approx(0.5 / 4)
    spent = REGISTRY.get_sample_value(
        "llmgw_ledger_cost_micros_total", {"tenant": "acme", "model": "m", "currency": "EUR"}
    )
    assert spent is not None and spent >= 280  # the metric counts it too
    assert priced == {
        "req-000001": (60 * 2 + 40 * 2 + 10 * 8, "EUR"),  # no cached price: the input's
        "req-000002": (0, ""),  # its model has no price
        "req-000003": (100 * 1 + 10 * 0.5, "USD"),  # the new table's default
        "req-000004": (0, "USD"),  # refused: no tokens, no cost
        "req-000005": (105, "USD"),
    }
