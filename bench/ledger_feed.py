"""The ledger process under a sustained access-log feed: nothing lost, and its cost per record.

    .venv/bin/python -m bench.ledger_feed [--seconds 10] [--rates 500,2000]

Starts Redis, PostgreSQL and `python -m ledger`, then plays Envoy: one gRPC access-log stream,
a message every 200 ms (Envoy's flush interval) carrying the entries of that interval. Every
request first gets a reservation through ratelimit's own script, so settlement does real work.
Per rate: entries sent, records in PostgreSQL after the drain (lost = sent − stored), the
ledger's CPU per record (utime + stime from /proc), and settlement round trips.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import grpc
from envoy.config.core.v3 import address_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from llmgw import facts, wire
from llmgw.resp import Resp
from ratelimit.redis_store import RedisStore
from ratelimit.types import Check, Unit
from ratelimit.windows import SLIDING
from tools.postgres import Postgres
from tools.procs import Process, bin_path, free_port, grpc_serving, redis_ping

TICK_S = 0.2
TENANTS = 20


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def entry(rid: str, tenant: str) -> accesslog_pb2.HTTPAccessLogEntry:
    e = accesslog_pb2.HTTPAccessLogEntry()
    common = e.common_properties
    request_facts = facts.RequestFacts(model="m", stream=True, max_output=200, prompt_tokens=300)
    common.metadata.filter_metadata[wire.EXTAUTHZ_NAMESPACE].update(
        {
            wire.META_TENANT: tenant,
            wire.META_TIER: "standard",
            wire.META_SESSION: "sess_bench",
            wire.META_REQUEST_ID: rid,
            **request_facts.to_metadata(),
        }
    )
    common.metadata.filter_metadata[wire.USAGE_NAMESPACE].update(
        {wire.META_PROMPT_TOKENS: 310, wire.META_COMPLETION_TOKENS: 150}
    )
    common.upstream_remote_address.CopyFrom(
        address_pb2.Address(
            socket_address=address_pb2.SocketAddress(address="127.0.0.1", port_value=9000)
        )
    )
    common.start_time.GetCurrentTime()
    common.time_to_first_downstream_tx_byte.FromMilliseconds(40)
    common.duration.FromMilliseconds(900)
    e.request.path = "/v1/chat/completions"
    e.response.response_code.value = 200
    return e


async def reserve(client: Resp, rids: list[str]) -> None:
    store = RedisStore(client)
    now = int(time.time() * 1000)
    check = [Check("tokens:minute", SLIDING[Unit.MINUTE], 10**12, 500, True)]
    await asyncio.gather(
        *(
            store.admit(
                wire.tenant_prefix(f"t{i % TENANTS}"), check, now, reservation=rid, ttl_ms=600_000
            )
            for i, rid in enumerate(rids)
        )
    )


async def feed(port: int, redis_port: int, rate: int, seconds: float, tag: str) -> int:
    per_tick = max(1, round(rate * TICK_S))
    ticks = round(seconds / TICK_S)
    client = await Resp.connect("127.0.0.1", redis_port, 2.0)
    sent = 0

    async def messages() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
        nonlocal sent
        start = time.monotonic()
        for tick in range(ticks):
            rids = [f"{tag}-{tick}-{j}" for j in range(per_tick)]
            await reserve(client, rids)
            msg = als_pb2.StreamAccessLogsMessage()
            msg.http_logs.log_entry.extend(
                entry(rid, f"t{j % TENANTS}") for j, rid in enumerate(rids)
            )
            sent += len(rids)
            yield msg
            await asyncio.sleep(max(0.0, start + (tick + 1) * TICK_S - time.monotonic()))

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs(messages())
    await client.close()
    return sent


async def stored(url: str, tag: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM outcomes WHERE request_id LIKE $1", f"{tag}-%"
            )
        )
    finally:
        await conn.close()


async def drained(url: str, tag: str, sent: int, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    n = 0
    while time.monotonic() < deadline:
        n = await stored(url, tag)
        if n >= sent:
            break
        await asyncio.sleep(0.2)
    return n


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ledger_feed")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rates", default="500,2000")
    args = parser.parse_args()
    rates = [int(r) for r in args.rates.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        redis_port = free_port()
        redis = Process(
            "redis",
            [bin_path("redis-server"), "--port", str(redis_port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", tmp],
            redis_ping("127.0.0.1", redis_port),
            state / "redis.log",
        ).start()  # fmt: skip
        pg = Postgres(state / "postgres", state / "postgres.log")
        pg.start(60)
        port = free_port()
        env = {
            **os.environ,
            "LLMGW_LEDGER__SERVE__PORT": str(port),
            "LLMGW_LEDGER__REDIS__PORT": str(redis_port),
            "LLMGW_LEDGER__DATABASE_URL": pg.url,
        }
        ledger = Process(
            "ledger",
            [sys.executable, "-m", "ledger"],
            grpc_serving(f"127.0.0.1:{port}", "ledger"),
            state / "ledger.log",
            env=env,
        ).start()
        try:
            assert ledger.pid is not None and redis.pid is not None
            print(
                "| entries/s | sent | stored | lost | ledger CPU µs/record | Redis CPU µs/record |"
            )
            print("|---|---|---|---|---|---|")
            for rate in rates:
                tag = f"r{rate}"
                cpu0, rcpu0 = cpu_seconds(ledger.pid), cpu_seconds(redis.pid)
                sent = asyncio.run(feed(port, redis_port, rate, args.seconds, tag))
                n = asyncio.run(drained(pg.url, tag, sent))
                cpu = (cpu_seconds(ledger.pid) - cpu0) / sent * 1e6
                rcpu = (cpu_seconds(redis.pid) - rcpu0) / sent * 1e6
                print(f"| {rate} | {sent} | {n} | {sent - n} | {cpu:.0f} | {rcpu:.0f} |")
            print("\nRedis CPU includes the bench's own reservations (one admission per record).")
        finally:
            ledger.stop()
            pg.stop()
            redis.stop()


if __name__ == "__main__":
    main()
