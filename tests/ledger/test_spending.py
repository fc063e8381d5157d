"""Money budgets settled by the ledger: each outcome's cost refunds what admission reserved at
its worst case, and the soft limits alert once per window and percentage, however many ledger
replicas settle the tenant's requests."""

from __future__ import annotations

import time
from decimal import Decimal
from pathlib import Path
from typing import Any

from ledger.recorder import Recorder
from ledger.spending import SpendAlerts
from llmgw.link import RedisLink
from llmgw.prices import ModelPrice, Prices
from llmgw.resp import Resp
from llmgw.tiers import Period, PerUnit, Spend, TierSpec, TierTable
from llmgw.wire import tenant_prefix
from ratelimit.fleet import IDLE_UNKNOWN
from ratelimit.limiter import Limiter
from ratelimit.limits import Limits
from ratelimit.redis_store import RedisStore
from ratelimit.types import Admission, Grant
from tests.ledger.conftest import outcome
from tests.ledger.test_cost import Sink, stored
from tests.ratelimit.rl_redis import redis_port, start_redis

TABLE = TierTable(
    tiers={
        "t": TierSpec(
            requests=PerUnit(minute=10_000),
            spend=Spend(day=Decimal("0.01"), alert_at=(50, 80, 100)),  # 10,000 micro-units
        )
    },
    default_tier="t",
    prices=Prices(models={"m": ModelPrice(input=Decimal(2), output=Decimal(10))}),
)


class Emitted:
    def __init__(self) -> None:
        self.alerts: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, kind: str, **fields: Any) -> None:
        self.alerts.append((kind, fields))


def recorder(port: int, sink: Sink, emit: Emitted) -> Recorder:
    return Recorder(
        RedisLink("127.0.0.1", port, 1.0), sink, batch_max=4, pending_max=1000, done_ttl_s=60,
        timeout_s=2.0, retry_max_s=0.1, prices=lambda: TABLE.prices,
        spending=SpendAlerts(lambda: TABLE, emit),
    )  # fmt: skip


async def test_costs_settle_the_money_reserved_and_each_soft_limit_alerts_once(
    tmp_path: Path,
) -> None:
    redis = start_redis(tmp_path)
    port = redis_port(redis)
    client = await Resp.connect("127.0.0.1", port, 2.0)
    limiter = Limiter(Limits(TABLE).policy, RedisStore(client), lambda: IDLE_UNKNOWN, time.time)
    sink = Sink()
    emitted = Emitted()
    # Two ledger replicas settling the same tenant's requests.
    replicas = [recorder(port, sink, emitted), recorder(port, sink, emitted)]
    for r in replicas:
        r.start()
    try:
        # Each request: 100 prompt tokens at 2 and up to 50 output at 10: reserved 700; it
        # used 20 output tokens: costs 400, settled before the next is admitted. The 25th has
        # 400 left: its cap lowered to 20 ((400 − 200) / 10), it costs 400; the 26th is refused.
        outcomes = []
        for i in range(30):
            verdict = await limiter.admit(
                Admission(
                    "acme",
                    "t",
                    request_id=f"req-{i:06d}",
                    token_estimate=150,
                    grant=Grant(100, 1),
                    model="m",
                )
            )
            if not verdict.allowed:
                assert verdict.refusal == "insufficient_quota" and i == 25
                break
            assert verdict.output_cap == (20 if i == 24 else 0)
            outcomes.append(
                outcome(
                    i,
                    tier="t",
                    model="m",
                    prompt_tokens=100,
                    completion_tokens=20,
                    reserved_tokens=150,
                    quota_checked=True,
                )
            )
            replicas[i % 2].add([outcomes[-1]])
            await stored(sink, len(outcomes))
        held = await client.call("KEYS", f"{tenant_prefix('acme')}:spend:day:*")
        assert isinstance(held, list) and len(held) == 1
        spent = await client.call("GET", held[0])
    finally:
        for r in replicas:
            await r.close(1.0)
        await client.close()
        redis.stop()
    assert len(outcomes) == 25 and spent == b"10000"  # exactly the budget, settled
    assert all(r.cost_micros == 400 for r in sink.records)
    # 50 % at 5,200, 80 % at 8,000, 100 % at 10,000: once each, though both replicas saw them.
    assert sorted(a[1]["detail"]["percent"] for a in emitted.alerts) == [50, 80, 100]
    assert {a[0] for a in emitted.alerts} == {"spend_threshold"}
    assert emitted.alerts[-1][1]["detail"] == {
        "period": "day", "percent": 100, "spent": "0.01", "budget": "0.01", "currency": "USD",
    }  # fmt: skip


def test_a_tenants_own_money_budget_alerts_at_its_own_percentages() -> None:
    """The tenant's spec's `spend`, as its request's metadata carried it (Outcome.spend), merged
    over its tier's: a month budget the tier lacks, alerting at its own percentage."""
    alerts = SpendAlerts(lambda: TABLE, Emitted())
    spent = [("spend:day", 1, 2_000), ("spend:month", 7, 5_000)]
    tier_only = outcome(1, tier="t")
    assert alerts.reached(tier_only, spent) == []  # 2,000 of the day's 10,000: under 50 %
    own = outcome(1, tier="t", spend=Spend(month=Decimal("0.02"), alert_at=(25,)))
    assert alerts.reached(own, spent) == [(Period.MONTH, 7, 25, 5_000, Decimal("0.02"))]
