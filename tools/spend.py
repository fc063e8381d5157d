"""`llmgw spend`: a tenant's money budgets in Redis, as the limiter and the ledger keep them.

    llmgw spend show --tenant T [--redis-url URL]
    llmgw spend reset --tenant T --period day|month [--redis-url URL]

`show`: what each window holds now (the costs settled and the reservations outstanding) and what
of it was settled. `reset`: forgive the costs settled in the current window (llmgw/forgive.lua):
the reservations outstanding stay held and settle as before, the next request is admitted
against what is left, and the window's soft limits alert again. Redis: `--redis-url`, else
$LLMGW_REDIS_URL, else the `redis_url` of the newest `.llmgw/run-*/ready.json`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from importlib import resources
from typing import Any

import redis

from llmgw.prices import amount
from llmgw.reservation import with_prelude
from llmgw.tiers import Period
from llmgw.wire import tenant_prefix
from ratelimit.windows import period
from tools.usage import from_ready

FORGIVE = with_prelude(resources.files("llmgw").joinpath("forgive.lua").read_text())
FORGIVE_SHA = hashlib.sha1(FORGIVE.encode()).hexdigest()


def default_redis_url() -> str | None:
    """$LLMGW_REDIS_URL, else the newest run's ready.json."""
    return os.environ.get("LLMGW_REDIS_URL") or from_ready("redis_url")


def reset(client: redis.Redis, tenant: str, per: Period) -> tuple[int, int, int]:
    """Forgive the current window's settled costs: (bucket index, forgiven, still held)."""
    window = period(per)
    args = (1, tenant_prefix(tenant), f"spend:{per}", window.bucket_ms, per.value)
    reply: Any = client.eval(FORGIVE, *args)
    index, forgiven, held = (int(v) for v in reply)
    return index, forgiven, held


def show(client: redis.Redis, tenant: str) -> list[tuple[Period, int, int]]:
    """Per period: what the current window holds and what of it was settled (micro-units)."""
    prefix = tenant_prefix(tenant)
    seconds, micros = client.time()  # Redis's clock, as the windows are counted
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    out = []
    for per in Period:
        index = period(per).index(now_ms)
        held, settled = client.mget(
            f"{prefix}:spend:{per}:{index}", f"{prefix}:settled:spend:{per}:{index}"
        )
        out.append((per, int(held or 0), int(settled or 0)))
    return out


def register(sub: Any) -> None:
    """Add `spend` to the `llmgw` subcommands."""
    p = sub.add_parser("spend", help="a tenant's money budgets: what they hold; forgive them")
    p.add_argument("action", choices=["show", "reset"])
    p.add_argument("--tenant", required=True)
    p.add_argument("--period", choices=[p.value for p in Period], help="reset: which window")
    p.add_argument("--redis-url", help="redis://… (default: $LLMGW_REDIS_URL, the local stack's)")
    p.set_defaults(func=cmd_spend)


def cmd_spend(args: argparse.Namespace) -> int:
    url = args.redis_url or default_redis_url()
    if not url:
        raise ValueError("no Redis: give --redis-url or set LLMGW_REDIS_URL")
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        if args.action == "reset":
            if args.period is None:
                raise ValueError("spend reset: give --period day or month")
            index, forgiven, held = reset(client, args.tenant, Period(args.period))
            print(
                f"{args.tenant} {args.period} (window {index}): forgave {amount(forgiven)}; "
                f"{amount(held)} still held by requests in flight"
            )
        else:
            print(f"{'PERIOD':<7} {'HELD':>14} {'SETTLED':>14}")
            for per, held, settled in show(client, args.tenant):
                print(f"{per.value:<7} {amount(held):>14} {amount(settled):>14}")
    except redis.RedisError as exc:
        raise ValueError(f"spend: Redis: {type(exc).__name__}") from exc  # never the URL
    finally:
        client.close()
    sys.stdout.flush()
    return 0
