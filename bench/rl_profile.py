"""CPU per ShouldRateLimit of the ratelimit process alone, with a real redis-server; for profiling.

Starts redis-server and `python -m ratelimit` (pinned to one core), then sends the two
descriptors Envoy sends for a request (kind=requests and kind=tokens, bench/trivial.py's facts)
from a grpc.aio client on the other core, `--concurrency` calls in flight over one channel (as
Envoy does), and prints the service's utime+stime per call. `--py-spy FILE` records a flame graph
(py-spy, a dev tool: `.venv/bin/pip install py-spy`) of the service during the measured load;
collapsed stacks instead when FILE ends in `.txt`.

    python -m bench.rl_profile [--requests 5000] [--concurrency 16] [--py-spy /tmp/rl.svg]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import uvloop
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from llmgw import wire
from tools.procs import Process, bin_path, free_port, grpc_serving, redis_ping

REPO = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
Entry = ratelimit_pb2.RateLimitDescriptor.Entry


def request(i: int) -> rls_pb2.RateLimitRequest:
    common = [
        Entry(key=wire.META_TENANT, value="bench"),
        Entry(key=wire.META_TIER, value="platinum"),
    ]
    return rls_pb2.RateLimitRequest(
        domain=wire.RATELIMIT_DOMAIN,
        descriptors=[
            ratelimit_pb2.RateLimitDescriptor(
                entries=[
                    Entry(key="kind", value="requests"),
                    *common,
                    Entry(key=wire.META_SESSION, value="sess_bench"),
                ]
            ),
            ratelimit_pb2.RateLimitDescriptor(
                entries=[
                    Entry(key="kind", value="tokens"),
                    *common,
                    Entry(key=wire.META_REQUEST_ID, value=f"req-{i}"),
                    Entry(key=wire.META_TOKEN_ESTIMATE, value="28"),
                ]
            ),
        ],
    )


def cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rpartition(b")")[2].split()
    return sum(int(x) for x in fields[11:15]) / TICK


async def load(port: int, n: int, concurrency: int, offset: int) -> float:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        todo = iter(range(offset, offset + n))

        async def worker() -> None:
            for i in todo:
                reply = await stub.ShouldRateLimit(request(i), timeout=5)
                assert reply.overall_code == rls_pb2.RateLimitResponse.OK, reply

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--py-spy", metavar="FILE", help="record a flame graph of the service")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    server_cores, client_cores = {cores[0]}, set(cores[1:] or cores)
    with tempfile.TemporaryDirectory() as tmp:
        limits = Path(tmp) / "limits.yaml"
        limits.write_text(
            "tiers:\n  platinum:\n    requests: {second: 10000000, minute: 100000000}\n"
            "    tokens: {minute: 1000000000}\n"
        )
        rport, port = free_port(), free_port()
        os.sched_setaffinity(0, server_cores)
        redis = Process(
            "redis",
            [bin_path("redis-server"), "--port", str(rport), "--save", "", "--dir", tmp],
            redis_ping("127.0.0.1", rport),
            Path(tmp) / "redis.log",
        ).start()
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "LLMGW_RATELIMIT__REDIS__PORT": str(rport),
            "LLMGW_RATELIMIT__SERVE__PORT": str(port),
            "LLMGW_RATELIMIT__LIMITS_FILE": str(limits),
        }
        service = Process(
            "ratelimit",
            [sys.executable, "-m", "ratelimit"],
            grpc_serving(f"127.0.0.1:{port}"),
            Path(tmp) / "ratelimit.log",
            env,
        ).start()
        os.sched_setaffinity(0, client_cores)
        try:
            assert service.pid is not None
            runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
            runner.run(load(port, 500, args.concurrency, 0))  # warm-up
            spy = None
            if args.py_spy:
                spy = subprocess.Popen(
                    [
                        *(str(Path(sys.executable).parent / "py-spy"), "record", "--native"),
                        *("--rate", "200", "--threads", "--pid", str(service.pid)),
                        *("-o", args.py_spy),
                        *(("--format", "raw") if args.py_spy.endswith(".txt") else ()),
                    ],
                    stdout=subprocess.DEVNULL,
                )
                time.sleep(1.0)
            before = cpu(service.pid)
            elapsed = runner.run(load(port, args.requests, args.concurrency, 1000))
            used = cpu(service.pid) - before
            if spy is not None:
                spy.send_signal(2)
                spy.wait(30)
            runner.close()
            print(
                f"ratelimit: {used / args.requests * 1e6:,.0f} µs CPU per call, "
                f"{args.requests / elapsed:,.0f} calls/s ({args.requests} calls, "
                f"c={args.concurrency})"
            )
        finally:
            service.stop()
            redis.stop()


if __name__ == "__main__":
    main()
