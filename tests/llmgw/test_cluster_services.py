"""The services' own Redis clients with the cluster switch on, against the real 3-master Redis
Cluster of tests/llmgw/test_redis_cluster.py; and the switch in the deployments, alike for every
service that talks to Redis."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from datetime import UTC, datetime

from ledger.recorder import Recorder
from llmgw.cluster import Cluster, key_slot
from llmgw.link import RedisLink
from llmgw.outcome import Outcome
from llmgw.wire import FLEET_LOAD_KEY, tenant_prefix
from ratelimit import fleet as ratelimit_fleet
from ratelimit.failover import Failover
from ratelimit.redis_store import RedisStore
from ratelimit.types import Check, Window
from router import publisher
from router.fleet import Fleet, FleetSettings
from tests.deploy import test_k8s
from tests.e2e import test_compose
from tests.llmgw.test_redis_cluster import HOST, PASSWORD, RedisCluster, cluster, redis_cluster

__all__ = ["cluster", "redis_cluster"]  # the fixtures, shared with test_redis_cluster.py

MINUTE = Window(60_000, 10_000)
# Every Redis client of the deployments: its service and the name of its cluster switch
# (extauthz holds two: the rate limiter's counters, the router's fleet load).
SWITCHES = (
    ("ledger", "LLMGW_LEDGER__REDIS__CLUSTER"),
    ("extauthz", "LLMGW_RATELIMIT__REDIS__CLUSTER"),
    ("extauthz", "LLMGW_ROUTER__REDIS__CLUSTER"),
)


class Collected:
    def __init__(self) -> None:
        self.records: list[Outcome] = []

    def submit(self, records: Sequence[Outcome]) -> None:
        self.records.extend(records)


def tokens(cost: int) -> list[Check]:
    return [Check("tokens:minute", MINUTE, limit=10**9, cost=cost, reserve=True)]


async def held(store: RedisStore, tenant: str) -> int:
    """Tokens in the tenant's minute buckets (a zero-cost admission reads them)."""
    outcome = await store.admit(tenant_prefix(tenant), tokens(0), 0)
    return sum(sum(c) for c in outcome.counts)


def served(tenant: str, reserved: int, used: int) -> Outcome:
    return Outcome(
        request_id=f"r-{tenant}", ts=datetime.now(UTC), tenant=tenant, status=200, outcome="ok",
        prompt_tokens=used // 2, completion_tokens=used - used // 2, reserved_tokens=reserved,
    )  # fmt: skip


def not_home_of(client: Cluster, key: str) -> int:
    """A master's port that does not serve `key`: a single-node client seeded there fails."""
    home = client.node_of(key_slot(key.encode()))
    return next(port for _, port in client.masters if (HOST, port) != home)


async def test_the_ledger_settles_many_tenants_on_every_master_exactly(
    cluster: Cluster, redis_cluster: RedisCluster
) -> None:
    """`redis.cluster: true`: the Recorder settles one batch of 60 tenants' outcomes against
    the reservations admit.lua made on the cluster; each tenant's window then holds exactly
    the tokens used, and no reservation is left."""
    tenants = [f"payer-{i}" for i in range(60)]
    assert {cluster.node_of(key_slot(tenant_prefix(t).encode())) for t in tenants} == set(
        cluster.masters
    )
    rng = random.Random(8)
    reserved = [rng.randrange(200, 2_000) for _ in tenants]
    used = [rng.randrange(0, r + 300) for r in reserved]  # some above their reservation
    store = RedisStore(cluster)
    admitted = await asyncio.gather(
        *(
            store.admit(tenant_prefix(t), tokens(r), 0, reservation=f"r-{t}", ttl_ms=60_000)
            for t, r in zip(tenants, reserved, strict=True)
        )
    )
    assert all(o.admitted for o in admitted)
    sink = Collected()
    link = RedisLink(HOST, redis_cluster.live()[0], 2.0, PASSWORD, cluster=True)
    recorder = Recorder(
        link, sink, batch_max=1_000, pending_max=1_000, done_ttl_s=60, timeout_s=5,
        retry_max_s=0.1,
    )  # fmt: skip
    recorder.start()
    recorder.add([served(t, r, u) for t, r, u in zip(tenants, reserved, used, strict=True)])
    for _ in range(200):  # bounded: one batch, one round trip per master
        if len(sink.records) == len(tenants):
            break
        await asyncio.sleep(0.02)
    await recorder.close(drain_s=1.0)
    assert {r.request_id: r.charged_tokens for r in sink.records} == {
        f"r-{t}": u for t, u in zip(tenants, used, strict=True)
    }
    assert [await held(store, t) for t in tenants] == used
    for port in redis_cluster.masters():
        assert redis_cluster.command(port, "KEYS", "llmgw:rl:*:res:*") == []


async def test_the_router_publishes_the_fleet_key_that_ratelimit_reads(
    cluster: Cluster, redis_cluster: RedisCluster
) -> None:
    """The router's publisher with `redis: {cluster: true}`, seeded with a master that does not
    hold the fleet key: ratelimit's Failover(cluster=True) reads what it wrote."""
    fleet = Fleet(FleetSettings(publish_interval=0.05, publish_ttl=5))
    fleet.set_pods(["10.0.0.1:8000", "10.0.0.2:8000"])
    link = RedisLink(HOST, not_home_of(cluster, FLEET_LOAD_KEY), 1.0, PASSWORD, cluster=True)
    publishing = asyncio.create_task(publisher.run(fleet, link))
    store = Failover(HOST, redis_cluster.live()[0], deadline_s=2.0, password=PASSWORD, cluster=True)
    await store.start()
    try:
        raw = None
        for _ in range(100):
            raw = await store.get_fleet(FLEET_LOAD_KEY)
            if raw is not None:
                break
            await asyncio.sleep(0.02)
        assert isinstance(raw, bytes)
        signal = ratelimit_fleet.parse(raw)
        assert signal.load == 1.0 and signal.ts > 0  # unscraped pods count as saturated
        assert not store.degraded
    finally:
        publishing.cancel()
        await asyncio.gather(publishing, return_exceptions=True)
        await link.close()
        await store.close()


def test_one_variable_switches_every_redis_client_of_compose_to_the_cluster() -> None:
    """A service left on single-node mode against a cluster would get MOVED for most keys."""
    services = test_compose.compose()["services"]
    for given, expected in (({}, "false"), ({"REDIS_CLUSTER": "true"}, "true")):
        variables = {**test_compose.INTERPOLATION, **given}
        switches = {
            var: test_compose.interpolate(services[name]["environment"][var], variables)
            for name, var in SWITCHES
        }
        assert switches == {var: expected for _, var in SWITCHES}


def test_every_redis_client_of_k8s_has_the_cluster_switch_set_alike() -> None:
    switches = {
        var: next(v["value"] for v in test_k8s.container(name)["env"] if v["name"] == var)
        for name, var in SWITCHES
    }
    assert switches == {var: "false" for _, var in SWITCHES}
