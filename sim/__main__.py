"""`python -m sim`: one simulated vLLM pod until SIGTERM or SIGINT (then exit 0)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from llmgw import logs
from llmgw.config import ConfigError, load, validate
from llmgw.responses import STORE_ENV  # "1" or "true" here; vLLM reads an integer
from llmgw.serve import run
from sim.pod import SimPod
from sim.profile import PROFILES
from sim.types import DEFAULT_MODEL, SimSettings

ENV_PREFIX = "LLMGW_SIM"
API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own variable for --api-key


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sim",
        description="A simulated vLLM OpenAI server. Settings: --config YAML, then "
        f"{ENV_PREFIX}__FIELD=value, then these flags.",
    )
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--model", help=f"served model name (default {DEFAULT_MODEL})")
    p.add_argument("--profile", choices=sorted(PROFILES), help="GPU timing profile")
    p.add_argument(
        "--speed-factor",
        type=float,
        help="> 1 is a FASTER pod: 2 halves every step time (metrics show the faster times)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        help="wall seconds per simulated second: 0.1 runs 10x faster; metrics stay simulated",
    )
    p.add_argument("--seed", type=int, help="seed for generated text, lengths and fault dice")
    p.add_argument(
        "--max-num-seqs", type=int, help="seats in the running batch (default: the profile's)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="token budget of one step (default: the profile's, as vLLM's for that GPU)",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        help="fcfs (default) or priority: vLLM's waiting heap on (priority, arrival) and "
        "preemption of the largest (priority, arrival); lower priority is served earlier",
    )
    p.add_argument("--num-gpu-blocks", type=int, help="KV-cache blocks (default 28000)")
    p.add_argument("--block-size", type=int, help="tokens per KV block (default 16)")
    p.add_argument("--max-model-len", type=int, help="context length (default 131072)")
    p.add_argument(
        "--force-include-usage",
        action="store_true",
        default=None,
        help="usage in every stream, like vLLM's --enable-force-include-usage",
    )
    p.add_argument(
        "--usage-mode",
        choices=["per-chunk", "final"],
        help="what --force-include-usage does: per-chunk (default, vLLM >= 0.20: usage on "
        "every chunk and a final usage chunk) or final (vLLM 0.18: the final chunk only)",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        help="the served model's tokenizer.json (its chat template beside it): prompts count "
        "as that model's pods count them (default: 4 characters a token)",
    )
    p.add_argument(
        "--prefix-caching-hash-algo",
        choices=["sha256", "sha256_cbor"],
        help="how a tokenized prompt's blocks are hashed, as vLLM's flag (seeded by "
        "PYTHONHASHSEED where set, as vLLM's)",
    )
    p.add_argument(
        "--kv-events-config",
        type=json.loads,
        help='vLLM\'s JSON: {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"} publishes the KV-cache events over ZMQ',
    )
    p.add_argument(
        "--api-key",
        help="/v1/* needs `Authorization: Bearer KEY`, as vLLM's --api-key (default: "
        f"${API_KEY_ENV}; prefer it: a flag shows in ps)",
    )
    p.add_argument("--config", type=Path, help="YAML file of settings (field names as above)")
    return p


def settings_from(argv: list[str]) -> SimSettings:
    args = vars(parser().parse_args(argv))
    path = args.pop("config")
    base = load(SimSettings, path, ENV_PREFIX)
    if args["api_key"] is None:
        args["api_key"] = os.environ.get(API_KEY_ENV) or None
    args["hash_seed"] = os.environ.get("PYTHONHASHSEED")
    args["enable_responses_api_store"] = os.environ.get(STORE_ENV)
    flags: dict[str, Any] = {k: v for k, v in args.items() if v is not None}
    return validate(SimSettings, base.model_dump() | flags, "flags")


async def main(settings: SimSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with SimPod(settings):
        await stop.wait()


def cli(argv: list[str]) -> int:
    logs.setup()
    try:
        settings = settings_from(argv)
    except ConfigError as exc:
        print(f"sim: {exc}", file=sys.stderr)
        return 2
    run(lambda: main(settings))
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
