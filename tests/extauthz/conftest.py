"""Shared fixtures of the extauthz tests: a tenants file with keys in every state, a decider,
a service reading every body in its pool."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider

from extauthz import tenants
from extauthz.bodypool import BodyPool
from extauthz.decision import Decider
from extauthz.director import Director
from extauthz.sessions import SessionCodec, Sessions
from extauthz.settings import DecisionSettings
from extauthz.store import tenants_store
from extauthz.types import PerMinuteLimits, Tenant, TenantsFile
from llmgw.fleetload import ModelContexts
from llmgw.tiers import PerUnit, TierSpec, TierTable
from tools.procs import Process, bin_path, free_port, redis_ping

SECRET = b"9f2c41e8a7b3d6055f1e2a9c0b7d64e3"  # varied: settings refuse "ssss…"
NOW = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
NOW_S = NOW.timestamp()
# The tier table beside the tenants file: the built-in tiers and a custom one.
TIERS = TierTable(
    tiers={"gold": TierSpec(requests=PerUnit(minute=600), tokens=PerUnit(minute=900_000))}
)
TIERS_YAML = "tiers:\n  gold: {requests: {minute: 600}, tokens: {minute: 900000}}\n"


@dataclass
class Keys:
    acme: str  # standard tier, two models, an rpm override
    globex: str  # custom tier "gold", every model
    expired: str
    revoked: str
    acme_key_id: str


def write_tenants(path: Path) -> Keys:
    acme, acme_rec = tenants.new_key(NOW - timedelta(days=1))
    globex, globex_rec = tenants.new_key(NOW - timedelta(days=1))
    expired, expired_rec = tenants.new_key(NOW - timedelta(days=2), NOW - timedelta(seconds=1))
    revoked, revoked_rec = tenants.new_key(NOW - timedelta(days=1))
    data = TenantsFile(
        tenants=(
            Tenant(
                id="acme",
                name="Acme",
                tier="standard",
                priority=5,
                models=("llama-3-8b", "mistral-7b"),
                limits=PerMinuteLimits(rpm=100),
                keys=(acme_rec, expired_rec, revoked_rec.model_copy(update={"revoked": True})),
            ),
            Tenant(
                id="globex", name="Globex", tier="gold", priority=8, models="*", keys=(globex_rec,)
            ),
        ),
    )
    tenants.write(path, data)
    return Keys(acme, globex, expired, revoked, acme_rec.id)


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    return tmp_path / "tenants.yaml"


@pytest.fixture
def tiers_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiers.yaml"
    path.write_text(TIERS_YAML)
    return path


@pytest.fixture
def keys(tenants_file: Path) -> Keys:
    return write_tenants(tenants_file)


def make_decider(contexts: ModelContexts | None = None, **settings: object) -> Decider:
    codec = SessionCodec(SECRET, max_age_ms=3_600_000)
    return Decider(
        DecisionSettings(**settings),  # type: ignore[arg-type]
        Sessions(codec, worker_id=1),
        contexts=contexts,
    )


@pytest.fixture
def decider() -> Decider:
    return make_decider(max_body_bytes=10_000)


@pytest.fixture
async def pooled(
    tenants_file: Path, tiers_file: Path, keys: Keys
) -> AsyncIterator[tuple[Director, BodyPool]]:
    """The service with every body read in the pool, its worker started."""
    decider = make_decider()
    pool = BodyPool(decider, from_bytes=1)
    await pool.start()
    store = tenants_store(tenants_file, tiers_file)
    service = Director(store, decider, TracerProvider().get_tracer("t"), bodies=pool)
    try:
        yield service, pool
    finally:
        await pool.close()


def kill_worker(pool: BodyPool) -> None:
    """SIGKILL the pool's worker (as the OOM killer would) and wait until its executor knows.

    Waiting for the executor, not only the process: a body submitted while CPython 3.11's
    management thread is failing the pool's pending work can be added to the dict it iterates
    (terminate_broken), which kills that thread and leaves the body unanswered."""
    executor = pool._pool
    assert executor is not None and executor._processes
    (pid,) = executor._processes
    os.kill(pid, signal.SIGKILL)
    for _ in range(2000):  # a bound against a hang, not a speed
        if executor._broken:
            return
        time.sleep(0.01)
    raise AssertionError("the executor never saw its worker die")


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[int]:
    """A redis-server of the test's own: its port."""
    port = free_port()
    argv = [bin_path("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    argv += ["--appendonly", "no", "--dir", str(tmp_path)]
    proc = Process("redis", argv, redis_ping("127.0.0.1", port), tmp_path / "redis.log").start()
    yield port
    proc.stop()
