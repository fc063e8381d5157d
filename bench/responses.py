"""The check's CPU for a Responses API request against the chat request of the same size.

    .venv/bin/python -m bench.responses [--decisions 20000] [--checks 3000] [--rounds 3]

Two ways, each alternating the two bodies in rounds (one run, shared machine: ratios, not
absolutes): the decision alone in this process (CPU time per decision), and whole checks over
HTTP against `python -m extauthz` as a child (its CPU per check, from /proc). The Responses body
carries the same text as the chat one: its instructions the chat's system message, its input
the user message. Target (issue 28): within 10 %.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from bench.extauthz_decision import BODY, SECRET, headers_for, http_request, read_http
from extauthz import tenants
from extauthz.decision import Decider
from extauthz.demo import seed_demo
from extauthz.sessions import SessionCodec, Sessions
from extauthz.settings import DecisionSettings
from extauthz.types import Allow
from llmgw import wire
from llmgw.tiers import TierTable
from tools.procs import Process, free_port, grpc_serving

SYSTEM = "You are a helpful assistant. " * 8
USER = "Summarise the following text. " + "lorem ipsum " * 60
BODIES = {
    "chat": (
        wire.CHAT_PATH,
        {
            "model": "llama-3-8b",
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
            "max_tokens": 256,
            "stream": True,
        },
    ),
    "responses": (
        wire.RESPONSES_PATH,
        {
            "model": "llama-3-8b",
            "instructions": SYSTEM,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": USER}]}],
            "max_output_tokens": 256,
            "stream": True,
        },
    ),
}


def cpu_of(pid: int) -> float:
    """A process's user + system CPU seconds so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def per_call(n: int, call: Callable[[], object], cpu: Callable[[], float]) -> float:
    """CPU microseconds per call, as `cpu` counts it."""
    before = cpu()
    for _ in range(n):
        call()
    return (cpu() - before) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--checks", type=int, default=3_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tenants.yaml"
        key = seed_demo(path)[1]["api_key"]
        snap = tenants.load(path, TierTable())
        decider = Decider(DecisionSettings(), Sessions(SessionCodec(SECRET.encode()), 1))
        now = time.time()
        requests: dict[str, tuple[dict[str, str], bytes]] = {}
        for name, (route, body) in BODIES.items():
            raw = json.dumps(body).encode()
            headers = {**headers_for(key), ":path": route, "content-length": str(len(raw))}
            decision = decider.decide(snap, headers, raw, now)
            assert isinstance(decision, Allow), decision
            requests[name] = (headers, raw)
        chat, responses = (decider.decide(snap, *requests[n], now) for n in BODIES)
        assert isinstance(chat, Allow) and isinstance(responses, Allow)
        assert chat.facts.prompt_tokens == responses.facts.prompt_tokens  # the same request

        decide_us: dict[str, list[float]] = {name: [] for name in BODIES}
        for _ in range(args.rounds):
            for name, (headers, raw) in requests.items():

                def decide(h: dict[str, str] = headers, b: bytes = raw) -> object:
                    return decider.decide(snap, h, b, now)

                decide_us[name].append(per_call(args.decisions, decide, time.process_time))

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
        proc = Process(
            "extauthz",
            [sys.executable, "-m", "extauthz", "--config", str(config)],
            grpc_serving(f"127.0.0.1:{port}"),
            Path(tmp) / "extauthz.log",
        ).start()
        check_us: dict[str, list[float]] = {name: [] for name in BODIES}
        try:
            pid = proc.pid
            assert pid is not None
            with socket.create_connection(("127.0.0.1", http_port)) as sock:
                for _ in range(args.rounds):
                    for name, (headers, raw) in requests.items():
                        # The check as Envoy sends it, with this body instead of the default.
                        message = http_request(headers)[: -len(BODY)] + raw

                        def check(m: bytes = message) -> object:
                            sock.sendall(m)
                            return read_http(sock)

                        check_us[name].append(per_call(args.checks, check, lambda: cpu_of(pid)))
        finally:
            proc.stop()

    print(f"{'':<10} {'decide µs CPU':>14} {'check µs CPU (extauthz)':>24}")
    for name in BODIES:
        print(f"{name:<10} {min(decide_us[name]):>14.1f} {min(check_us[name]):>24.1f}")
    d = min(decide_us["responses"]) / min(decide_us["chat"])
    c = min(check_us["responses"]) / min(check_us["chat"])
    print(f"{'ratio':<10} {d:>13.2f}× {c:>23.2f}×   (target: within 1.10×)")


if __name__ == "__main__":
    main()
