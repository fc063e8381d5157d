"""`python -m llmgw.health [HOST:PORT]`: exit 0 when a service answers SERVING on gRPC health.

The image's health check. Without an argument it checks 127.0.0.1 on the plaintext health port
of the one service configured in the environment (`LLMGW_<SERVICE>__SERVE__HEALTH_PORT`, else
its port, `…__SERVE__PORT`, when that is plaintext), so one HEALTHCHECK line serves every
service the image runs. It speaks no TLS: a port with mutual TLS needs a health port beside it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping

SUFFIXES = ("__SERVE__HEALTH_PORT", "__SERVE__PORT")  # first found wins


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


def default_target(environ: Mapping[str, str]) -> str:
    for suffix in SUFFIXES:
        ports = [v for k, v in environ.items() if k.startswith("LLMGW_") and k.endswith(suffix)]
        if len(ports) > 1:
            raise ValueError(f"expected one LLMGW_*{suffix} variable, found {len(ports)}")
        if ports:
            return f"127.0.0.1:{ports[0]}"
    raise ValueError(f"no LLMGW_*{SUFFIXES[-1]} variable")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmgw.health", description=__doc__)
    parser.add_argument("target", nargs="?", help="HOST:PORT (default: see above)")
    parser.add_argument("--service", default="", help="gRPC health service name ('' = server)")
    args = parser.parse_args(argv)
    try:
        target = args.target or default_target(os.environ)
    except ValueError as exc:
        print(f"llmgw.health: {exc}", file=sys.stderr)
        return 2
    if grpc_serving(target, args.service)():
        return 0
    print(f"llmgw.health: {target} is not SERVING", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
