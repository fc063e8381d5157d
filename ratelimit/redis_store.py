"""Counters in Redis: one EVALSHA per decision (admit.lua).

Keys (prefix `llmgw.wire.tenant_prefix`): `llmgw:rl:{<tenant>}:<check>:<bucket>` for buckets,
`…:res:<request id>` for token reservations (settled by the ledger, ledger/settle.lua) and
`…:tspec` for the tenant's token windows. The `{tenant}` hash tag keeps one tenant's keys
in one Redis Cluster slot, so each script touches a single slot. A NOSCRIPT reply (Redis restarted
or flushed its script cache) is answered by EVAL of the source, which caches it again.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from importlib import resources

from llmgw.resp import Arg, Reply, Resp, RespError
from ratelimit.types import Check, Outcome


def _script(name: str) -> tuple[str, str]:
    source = resources.files("ratelimit").joinpath(name).read_text()
    return source, hashlib.sha1(source.encode()).hexdigest()


ADMIT = _script("admit.lua")


class RedisStore:
    def __init__(self, client: Resp) -> None:
        self.client = client

    async def admit(
        self,
        prefix: str,
        checks: Sequence[Check],
        now_ms: int,
        *,
        shadow: bool = False,
        reservation: str = "",
        ttl_ms: int = 0,
    ) -> Outcome:
        args = admit_args(prefix, checks, now_ms, shadow, reservation, ttl_ms)
        try:
            reply = await self.send_admit(args)
        except RespError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
            reply = await self.eval_admit(args)
        return outcome(reply, checks)

    def send_admit(self, args: list[Arg]) -> asyncio.Future[Reply]:
        """EVALSHA of admit.lua, written now; the reply (or NOSCRIPT) arrives in the future."""
        return self.client.call("EVALSHA", ADMIT[1], *args)

    async def eval_admit(self, args: list[Arg]) -> Reply:
        """EVAL of admit.lua's source, after a NOSCRIPT (it caches the script again)."""
        return await self.client.call("EVAL", ADMIT[0], *args)

    async def get_fleet(self, key: str) -> bytes | dict[str, bytes] | None:
        """The fleet-load key as a string (JSON) or a hash; None when absent."""
        try:
            value = await self.client.call("GET", key)
        except RespError as exc:
            if not str(exc).startswith("WRONGTYPE"):
                raise
            pairs = await self.client.call("HGETALL", key)
            items = [p for p in pairs if isinstance(p, bytes)] if isinstance(pairs, list) else []
            return {items[i].decode(): items[i + 1] for i in range(0, len(items) - 1, 2)}
        return value if isinstance(value, bytes) else None

    async def load_scripts(self) -> None:
        for source, _ in (ADMIT,):
            await self.client.call("SCRIPT", "LOAD", source)


def admit_args(
    prefix: str,
    checks: Sequence[Check],
    now_ms: int,
    shadow: bool,
    reservation: str,
    ttl_ms: int,
) -> list[Arg]:
    """admit.lua's keys and arguments after the script (numkeys 1, the prefix, ARGV)."""
    args: list[Arg] = [1, prefix, now_ms, int(shadow), reservation, ttl_ms, len(checks)]
    for c in checks:
        w = c.window
        args += [c.name, w.bucket_ms, w.window_ms // w.bucket_ms, c.limit, c.cost, int(c.reserve)]
    return args


def outcome(reply: Reply, checks: Sequence[Check]) -> Outcome:
    """admit.lua's reply folded: admitted, and each check's buckets (newest first)."""
    if not isinstance(reply, bytes):
        raise RespError(f"admit.lua returned {reply!r}")
    try:
        flat = [int(v) for v in reply.split()]
    except ValueError:
        raise RespError(f"admit.lua returned {reply!r}") from None
    counts: list[tuple[int, ...]] = []
    at = 1
    for c in checks:
        n = c.window.window_ms // c.window.bucket_ms
        counts.append(tuple(flat[at : at + n]))
        at += n
    return Outcome(flat[0] == 1, tuple(counts))
