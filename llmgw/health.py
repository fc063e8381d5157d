"""`python -m llmgw.health [HOST:PORT]`: exit 0 when a service answers SERVING on gRPC health.

The image's health check. Without an argument it checks 127.0.0.1 on the plaintext health port
of the one service configured in the environment (`LLMGW_<SERVICE>__SERVE__HEALTH_PORT`, else
its port, `…__SERVE__PORT`, when that is plaintext), so one HEALTHCHECK line serves every
service the image runs. It speaks no TLS: a port with mutual TLS needs a health port beside it.
The admin API serves HTTP, not gRPC (`LLMGW_ADMIN__PORT`, a port at the settings' top level):
there, or with `--http`, it asks `GET /health` for a 200.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping

SUFFIXES = ("__SERVE__HEALTH_PORT", "__SERVE__PORT")  # first found wins
HTTP_PORT = re.compile(r"LLMGW_[A-Z]+__PORT")  # a service whose own port is HTTP (the admin API)


def grpc_serving(target: str, service: str = "") -> Callable[[], bool]:
    def probe() -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            with grpc.insecure_channel(target) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
        except grpc.RpcError:
            return False

    return probe


def http_ok(url: str) -> Callable[[], bool]:
    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    return probe


def default_target(environ: Mapping[str, str]) -> str:
    """The gRPC health target of the service configured in `environ`."""
    for suffix in SUFFIXES:
        ports = [v for k, v in environ.items() if k.startswith("LLMGW_") and k.endswith(suffix)]
        if len(ports) > 1:
            raise ValueError(f"expected one LLMGW_*{suffix} variable, found {len(ports)}")
        if ports:
            return f"127.0.0.1:{ports[0]}"
    raise ValueError(f"no LLMGW_*{SUFFIXES[-1]} variable")


def default_probe(environ: Mapping[str, str]) -> tuple[str, Callable[[], bool]]:
    """The target and probe for the service configured in `environ`: gRPC health, or the HTTP
    `/health` of a service whose own port is HTTP."""
    try:
        target = default_target(environ)
    except ValueError:
        ports = [v for k, v in environ.items() if HTTP_PORT.fullmatch(k)]
        if len(ports) != 1:
            raise
        target = f"127.0.0.1:{ports[0]}"
        return target, http_ok(f"http://{target}/health")
    return target, grpc_serving(target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmgw.health", description=__doc__)
    parser.add_argument("target", nargs="?", help="HOST:PORT (default: see above)")
    parser.add_argument("--service", default="", help="gRPC health service name ('' = server)")
    parser.add_argument("--http", action="store_true", help="with TARGET: GET /health for a 200")
    args = parser.parse_args(argv)
    if args.target:
        target = args.target
        probe = (
            http_ok(f"http://{target}/health") if args.http else grpc_serving(target, args.service)
        )
    else:
        try:
            target, probe = default_probe(os.environ)
        except ValueError as exc:
            print(f"llmgw.health: {exc}", file=sys.stderr)
            return 2
    if probe():
        return 0
    print(f"llmgw.health: {target} is not SERVING", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
