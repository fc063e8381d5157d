"""The check's latency and CPU with the router's collectors on the check's event loop (`inline`)
and in a process of their own (`process`, router/collectors/process.py), at 16 and 256 pods.

A farm of fake vLLM pods (one uvloop process, a listening socket per pod, each answering
`/metrics` with the simulator's vLLM page and `/v1/models`) is scraped by `python -m extauthz`
in the rls topology (the router inside, the check over gRPC) at the router's default interval
(75 ms); a client sends checks at a fixed rate, one at a time, and times each. Per arm: the
check's p50/p99/max, and CPU as a share of one core over the run for extauthz itself and for its
collectors' child. One run, all arms interleaved in rounds (the machine's noise spreads over all).

Then the KV events' delay to two replicas: a ZMQ publisher here sends KV-event batches as a pod
does, one at a time, to two routers' collectors (each its own datastore, as two extauthz
replicas; their collectors inline on this process's loop, or each in its own process), and
times from the send until each replica's index holds the batch's block (polled every 0.2 ms).

    python -m bench.collectors [--seconds 15] [--rate 50] [--rounds 2] [--batches 300]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import cast

import grpc
import numpy as np
import uvloop
import yaml
import zmq
import zmq.asyncio
from envoy.service.auth.v3 import attribute_context_pb2, external_auth_pb2, external_auth_pb2_grpc
from prometheus_client import generate_latest

from bench.extauthz_decision import BODY, SECRET, headers_for
from extauthz.demo import seed_demo
from llmgw import kvevents
from router.collectors import kvevents as kv_collector
from router.collectors.process import CollectorProcess
from router.fleet import Fleet, FleetSettings, KvEndpoint, KvEventSettings
from sim.metrics import Collector, Stats, registry
from sim.types import SimSettings
from tools.procs import Process, grpc_serving

MODEL = "llama-3-8b"
ARMS = [(16, "inline"), (16, "process"), (256, "inline"), (256, "process")]


def page() -> bytes:
    stats = Stats()
    for i in range(500):  # histograms with counts in most buckets, as a pod that has served
        stats.ttft.observe(0.01 * (i % 50))
        stats.itl.observe(0.001 * (i % 80))
    return generate_latest(
        registry(Collector(SimSettings(model=MODEL), stats, lambda: (3, 1, 0.4)))
    )


SCRAPES = [0]  # the farm's /metrics answers


class _Pod(asyncio.Protocol):
    def __init__(self, metrics: bytes, models: bytes) -> None:
        self.metrics, self.models, self.buf = metrics, models, b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, _, self.buf = self.buf.partition(b"\r\n\r\n")
            scrape = head.startswith(b"GET /metrics")
            SCRAPES[0] += scrape
            body = self.metrics if scrape else self.models
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body)
            )


async def farm(count: int, ports_file: Path) -> None:
    loop = asyncio.get_running_loop()
    metrics = page()
    models = b'{"object":"list","data":[{"id":"%s","max_model_len":8192}]}' % MODEL.encode()
    ports = []
    for _ in range(count):
        server = await loop.create_server(lambda: _Pod(metrics, models), "127.0.0.1", 0)
        ports.append(server.sockets[0].getsockname()[1])
    ports_file.write_text(" ".join(map(str, ports)))  # noqa: ASYNC240 (once, before serving)
    hits = ports_file.with_suffix(".hits")
    while True:  # the scrapes answered so far, for the parent to read (write, then rename)
        hits.with_suffix(".tmp").write_text(str(SCRAPES[0]))
        hits.with_suffix(".tmp").replace(hits)
        await asyncio.sleep(0.1)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def run_arm(
    tmp: Path, ports: list[int], count: int, mode: str, seconds: float, rate: float
) -> dict[str, float]:
    hits_file = tmp / "ports.hits"
    tenants = tmp / "tenants.yaml"
    key = seed_demo(tenants)[1]["api_key"]
    router = tmp / f"router-{count}-{mode}.yaml"
    pods = [f"127.0.0.1:{p}" for p in ports[:count]]
    router.write_text(yaml.safe_dump({"fleet": {"pods": pods, "collectors": mode}}))
    port = _free()
    config = tmp / f"extauthz-{count}-{mode}.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "serve": {"port": port},
                "topology": "rls",
                "router_config": str(router),
                "tenants_file": str(tenants),
                "sessions": {"secret": SECRET},
                "log_level": "warning",
            }
        )
    )
    target = f"127.0.0.1:{port}"
    proc = Process(
        "extauthz",
        [sys.executable, "-m", "extauthz", "--config", str(config)],
        grpc_serving(target),
        tmp / f"extauthz-{count}-{mode}.log",
    ).start()
    try:
        with grpc.insecure_channel(target) as channel:
            check = external_auth_pb2_grpc.AuthorizationStub(channel).Check
            http = attribute_context_pb2.AttributeContext.HttpRequest(
                headers=headers_for(key), raw_body=BODY, size=len(BODY)
            )
            request = external_auth_pb2.CheckRequest(
                attributes=attribute_context_pb2.AttributeContext(
                    request=attribute_context_pb2.AttributeContext.Request(http=http)
                )
            )
            time.sleep(3.0)  # the child started and every pod scraped a few times
            for _ in range(50):
                check(request)
            pid = proc.pid
            assert pid is not None
            kids = children(pid)
            cpu0 = cpu_seconds(pid), sum(cpu_seconds(k) for k in kids)
            hits0 = int(hits_file.read_text())
            samples, start = [], time.perf_counter()
            n = int(seconds * rate)
            for i in range(n):
                delay = start + i / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                t0 = time.perf_counter()
                reply = check(request)
                samples.append(time.perf_counter() - t0)
                assert reply.status.code == 0, reply
            wall = time.perf_counter() - start
            cpu1 = cpu_seconds(pid), sum(cpu_seconds(k) for k in kids)
            hits1 = int(hits_file.read_text())
    finally:
        proc.stop()
    ms = np.array(samples) * 1e3
    return {
        "p50": float(np.percentile(ms, 50)),
        "p99": float(np.percentile(ms, 99)),
        "max": float(ms.max()),
        "cpu": (cpu1[0] - cpu0[0]) / wall,
        "child": (cpu1[1] - cpu0[1]) / wall,
        "scrapes": (hits1 - hits0) / wall,
    }


async def kv_delays(mode: str, replicas: int, batches: int) -> list[float]:
    """Per batch and replica, the seconds from its send until the replica's index holds it."""
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    settings = KvEventSettings(endpoints={"p:1": KvEndpoint(publish=f"tcp://127.0.0.1:{port}")})
    fleets = [Fleet(FleetSettings(kv_events=settings, collectors=mode)) for _ in range(replicas)]
    tasks = []
    for fleet in fleets:
        fleet.set_pods(["p:1"])
        run = CollectorProcess(fleet).run() if mode == "process" else kv_collector.run(fleet)
        tasks.append(asyncio.create_task(run))
    seq = 0
    rng = random.Random(0)

    async def send() -> int:
        nonlocal seq
        block = rng.getrandbits(63)
        stored = kvevents.BlockStored([block], None, [], 16, medium="GPU")
        payload = kvevents.encode(kvevents.EventBatch(time.time(), [stored]))
        await pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        seq += 1
        return block

    try:
        for _ in range(600):  # until every replica is subscribed (ZMQ drops before that)
            block = await send()
            await asyncio.sleep(0.05)
            if all(f.kv.match((block,), 16) for f in fleets):
                break
        delays: list[float] = []
        for _ in range(batches):
            started = time.perf_counter()
            block = await send()
            waiting = list(fleets)
            while waiting and time.perf_counter() - started < 5.0:
                await asyncio.sleep(0.0002)
                now = time.perf_counter()
                for fleet in [f for f in waiting if f.kv.match((block,), 16)]:
                    delays.append(now - started)
                    waiting.remove(fleet)
            delays.extend(5.0 for _ in waiting)  # (never: counted as 5 s)
            await asyncio.sleep(0.01)
        return delays
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        pub.close(linger=0)
        ctx.term()


def _free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--farm", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ports-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.farm:
        uvloop.run(farm(args.farm, args.ports_file))
        return
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        ports_file = tmp / "ports"
        most = max(n for n, _ in ARMS)
        pods = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.collectors",
                "--farm",
                str(most),
                "--ports-file",
                str(ports_file),
            ]
        )
        try:
            for _ in range(300):
                if ports_file.exists() and ports_file.read_text():
                    break
                time.sleep(0.05)
            ports = [int(p) for p in ports_file.read_text().split()]
            results: dict[tuple[int, str], list[dict[str, float]]] = {arm: [] for arm in ARMS}
            for _ in range(args.rounds):
                for count, mode in ARMS:
                    results[(count, mode)].append(
                        run_arm(tmp, ports, count, mode, args.seconds, args.rate)
                    )
        finally:
            pods.kill()
            pods.wait()
    print(f"checks: {args.rate:.0f}/s for {args.seconds:.0f} s per arm, {args.rounds} rounds")
    print(f"/metrics page: {len(page()) / 1024:.1f} KiB; scrape interval 75 ms (the default)\n")
    print("| pods | collectors | check p50 ms | check p99 ms | check max ms "
          "| extauthz CPU | collectors' process CPU | scrapes/s (wanted) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for count, mode in ARMS:
        rows = results[(count, mode)]
        mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
        child = f"{mean['child']:.0%}" if mode == "process" else "–"
        print(
            f"| {count} | {mode} | {mean['p50']:.2f} | {mean['p99']:.2f} | {mean['max']:.1f} "
            f"| {mean['cpu']:.0%} | {child} | {mean['scrapes']:,.0f} ({count / 0.075:,.0f}) |"
        )
    p99 = {arm: float(np.mean([r["p99"] for r in results[arm]])) for arm in ARMS}
    ratio = {mode: p99[(256, mode)] / p99[(16, mode)] for mode in ("inline", "process")}
    print(
        f"\ncheck p99 at 256 pods / at 16 pods: inline {ratio['inline']:.2f}×, "
        f"process {ratio['process']:.2f}×"
    )
    print(f"\nKV events to 2 replicas, {args.batches} batches one at a time:\n")
    print("| collectors | delay p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|")
    for mode in ("inline", "process"):
        ms = np.array(uvloop.run(kv_delays(mode, 2, args.batches))) * 1e3
        p50, p99_ = np.percentile(ms, [50, 99])
        print(f"| {mode} | {p50:.2f} | {p99_:.2f} | {ms.max():.1f} |")


if __name__ == "__main__":
    main()
