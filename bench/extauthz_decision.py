"""extauthz cost: the decision function alone, and a check over gRPC and over HTTP.

    .venv/bin/python bench/extauthz_decision.py [--decisions 50000] [--checks 3000]

The decision runs in this process on one core. The check goes to `python -m extauthz` started as a
child (grpc.aio on uvloop; its HTTP check port, extauthz/httpserver.py) from a synchronous client,
one request at a time, the HTTP one on a kept-alive socket as Envoy's client does.
Target: decision p50 < 0.2 ms.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import yaml
from envoy.service.auth.v3 import attribute_context_pb2, external_auth_pb2, external_auth_pb2_grpc

from extauthz import tenants
from extauthz.decision import Decider
from extauthz.demo import seed_demo
from extauthz.sessions import SessionCodec, Sessions
from extauthz.settings import DecisionSettings
from extauthz.types import Allow
from llmgw.tiers import TierTable
from tools.procs import Process, free_port, grpc_serving

SECRET = "bench-secret-bench-secret-bench-secret"
BODY = json.dumps(
    {
        "model": "llama-3-8b",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant. " * 8},
            {"role": "user", "content": "Summarise the following text. " + "lorem ipsum " * 60},
        ],
        "max_tokens": 256,
        "stream": True,
    }
).encode()


def headers_for(api_key: str, session: str | None = None) -> dict[str, str]:
    out = {
        ":method": "POST",
        ":path": "/v1/chat/completions",
        ":authority": "gateway",
        "content-type": "application/json",
        "content-length": str(len(BODY)),
        "authorization": f"Bearer {api_key}",
        "user-agent": "OpenAI/Python 1.50.0",
        "x-request-id": "2f1c6a4e-4b1f-4c36-9d59-3f5b0b1b2d77",
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    }
    if session is not None:
        out["x-session-id"] = session
    return out


def http_request(headers: dict[str, str]) -> bytes:
    """The check as Envoy's ext_authz `http_service` sends it."""
    lines = [f"{headers[':method']} {headers[':path']} HTTP/1.1"]
    lines += [f"{k}: {v}" for k, v in headers.items() if not k.startswith(":")]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + BODY


def read_http(sock: socket.socket) -> int:
    """One response's status, its head and body read whole."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split(b" ", 2)[1])


def timed(n: int, call: Callable[[], object]) -> tuple[np.ndarray, float]:
    samples = np.empty(n)
    started = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter_ns()
        call()
        samples[i] = time.perf_counter_ns() - t0
    return samples / 1e6, time.perf_counter() - started


def row(name: str, ms: np.ndarray, wall: float) -> str:
    p50, p99 = np.percentile(ms, [50, 99])
    return f"{name:<34} {len(ms) / wall:>10,.0f} {p50:>9.3f} {p99:>9.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--decisions", type=int, default=50_000)
    parser.add_argument("--checks", type=int, default=3_000)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tenants.yaml"
        key = seed_demo(path)[1]["api_key"]
        snap = tenants.load(path, TierTable())
        decider = Decider(DecisionSettings(), Sessions(SessionCodec(SECRET.encode()), 1))
        now = time.time()
        first = decider.decide(snap, headers_for(key), BODY, now)
        assert isinstance(first, Allow)
        new_session = headers_for(key)
        continued = headers_for(key, first.context.session)

        print(f"{'':<34} {'per s':>10} {'p50 ms':>9} {'p99 ms':>9}")
        for name, headers in (
            ("decide, new session", new_session),
            ("decide, continued", continued),
        ):

            def decide(h: dict[str, str] = headers) -> object:
                return decider.decide(snap, h, BODY, now)

            print(row(name, *timed(args.decisions, decide)))

        port, http_port = free_port(), free_port()
        config = Path(tmp) / "extauthz.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "serve": {"port": port},
                    "http_port": http_port,
                    "tenants_file": str(path),
                    "sessions": {"secret": SECRET},
                }
            )
        )
        target = f"127.0.0.1:{port}"
        proc = Process(
            "extauthz",
            [sys.executable, "-m", "extauthz", "--config", str(config)],
            grpc_serving(target),
            Path(tmp) / "extauthz.log",
        ).start()
        try:
            with grpc.insecure_channel(target) as channel:
                check = external_auth_pb2_grpc.AuthorizationStub(channel).Check
                http = attribute_context_pb2.AttributeContext.HttpRequest(
                    headers=new_session, raw_body=BODY, size=len(BODY)
                )
                request = external_auth_pb2.CheckRequest(
                    attributes=attribute_context_pb2.AttributeContext(
                        request=attribute_context_pb2.AttributeContext.Request(http=http)
                    )
                )
                timed(200, lambda: check(request))  # warm up
                print(
                    row("Check over gRPC, new session", *timed(args.checks, lambda: check(request)))
                )
            with socket.create_connection(("127.0.0.1", http_port)) as sock:
                raw = http_request(new_session)

                def check_http() -> object:
                    sock.sendall(raw)
                    return read_http(sock)

                timed(200, check_http)
                print(row("check over HTTP, new session", *timed(args.checks, check_http)))
        finally:
            proc.stop()


if __name__ == "__main__":
    main()
