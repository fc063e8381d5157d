"""What one round trip to another process costs when that process was idle, and when it was busy.

At a low request rate every callout finds its service asleep, and each thread that must wake on
the way costs the machine's wake-up latency (on a small VM, a sizeable fraction of a millisecond).
A raw asyncio echo server wakes one thread per message; a grpc.aio server (as every llmgw service
is, llmgw/serve.py) passes a unary call through several (gRPC's poller, the completion-queue
thread, the event loop, and back). This prints both, after an idle gap and back to back, so the
floor of a gRPC callout's added latency on this machine is a measured number. The gRPC client
here is grpc.aio too, so its row counts both ends; Envoy as the client pays the server's share
(bench/cpu.py's latency tables: the trivial-handler row).

    python -m bench.wakeups [--calls 200] [--gap-ms 50]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import uvloop
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from google.rpc import code_pb2, status_pb2

from tools.procs import Process, free_port, tcp_open


class _Auth(external_auth_pb2_grpc.AuthorizationServicer):  # type: ignore[misc]
    REPLY = external_auth_pb2.CheckResponse(status=status_pb2.Status(code=code_pb2.OK))

    async def Check(self, request: Any, context: Any) -> external_auth_pb2.CheckResponse:
        return self.REPLY


async def _serve(kind: str, port: int) -> None:
    if kind == "echo":

        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(100):
                writer.write(data)

        server = await asyncio.start_server(echo, "127.0.0.1", port)
        await server.serve_forever()
    grpc_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    external_auth_pb2_grpc.add_AuthorizationServicer_to_server(_Auth(), grpc_server)
    grpc_server.add_insecure_port(f"127.0.0.1:{port}")
    await grpc_server.start()
    await grpc_server.wait_for_termination()


async def _times(call: Callable[[], Awaitable[object]], calls: int, gap_s: float) -> list[float]:
    for _ in range(20):  # connected and warm
        await call()
    out = []
    for _ in range(calls):
        await asyncio.sleep(gap_s)
        started = time.perf_counter()
        await call()
        out.append(time.perf_counter() - started)
    return out


async def _measure(kind: str, port: int, calls: int, gaps: list[float]) -> list[list[float]]:
    if kind == "echo":
        reader, writer = await asyncio.open_connection("127.0.0.1", port)

        async def ping() -> object:
            writer.write(b"x")
            return await reader.read(100)

        out = [await _times(ping, calls, gap) for gap in gaps]
        writer.close()
        return out
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        check = external_auth_pb2_grpc.AuthorizationStub(channel).Check
        request = external_auth_pb2.CheckRequest()
        return [await _times(lambda: check(request), calls, gap) for gap in gaps]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=50.0, help="idle time before each call")
    parser.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        uvloop.run(_serve(args.serve[0], int(args.serve[1])))
        return
    gaps = [args.gap_ms / 1e3, 0.0]
    print(
        f"| server (another process, loopback) | p50 after {args.gap_ms:g} ms idle | "
        "p50 back to back | idle penalty |"
    )
    print("|---|---|---|---|")
    servers = (("echo", "raw asyncio echo"), ("grpc", "grpc.aio unary call, trivial"))
    with tempfile.TemporaryDirectory() as tmp:
        for kind, label in servers:
            port = free_port()
            argv = [sys.executable, "-m", "bench.wakeups", "--serve", kind, str(port)]
            log = Path(tmp) / f"{kind}.log"
            server = Process(kind, argv, tcp_open("127.0.0.1", port), log).start()
            try:
                idle, busy = uvloop.run(_measure(kind, port, args.calls, gaps))
            finally:
                server.stop()
            row(label, idle, busy)


def row(label: str, idle: list[float], busy: list[float]) -> None:
    p_idle, p_busy = (float(np.percentile(x, 50)) * 1e3 for x in (idle, busy))
    print(f"| {label} | {p_idle:.2f} ms | {p_busy:.2f} ms | {p_idle - p_busy:+.2f} ms |")


if __name__ == "__main__":
    main()
