"""Counters in Redis: one EVALSHA per decision (admit.lua), at Redis's own time.

Keys (prefix `llmgw.wire.tenant_prefix`): each window's buckets, token reservations (settled by
the ledger, llmgw/settle.lua) and the tenant's token windows, named once in
llmgw/reservation.lua, which both sides prepend to their scripts. The `{tenant}` hash tag keeps
one tenant's keys in one Redis Cluster slot, so each script touches a single slot; a replay
(replay.lua) is one script per tenant, all sent at once. `llmgw:rl:replicas` is the replicas'
heartbeat set (replicas.lua). A NOSCRIPT reply (Redis restarted or flushed its script cache) is
answered by EVAL of the source, which caches it again.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from importlib import resources

from llmgw.breaker import with_prelude as with_breaker
from llmgw.reservation import with_prelude as with_keys
from llmgw.resp import Arg, Client, Reply, RespError
from ratelimit.store import Made
from ratelimit.types import Check, Grant, StoreResult


def script(name: str, *preludes: Callable[[str], str]) -> tuple[str, str]:
    """A Lua script of this package with each prelude's rule before it (the last one first):
    its source and SHA1 (for EVALSHA)."""
    source = resources.files("ratelimit").joinpath(name).read_text()
    for prelude in preludes:
        source = prelude(source)
    return source, hashlib.sha1(source.encode()).hexdigest()


async def run(client: Client, lua: tuple[str, str], *args: Arg) -> Reply:
    """EVALSHA of a `script`, and EVAL of its source after a NOSCRIPT (which caches it again)."""
    try:
        return await client.call("EVALSHA", lua[1], *args)
    except RespError as exc:
        if not str(exc).startswith("NOSCRIPT"):
            raise
        return await client.call("EVAL", lua[0], *args)


ADMIT = script("admit.lua", with_keys, with_breaker)
REPLAY = script("replay.lua", with_keys)
REPLICAS = script("replicas.lua")
REPLICAS_KEY = "llmgw:rl:replicas"


class RedisStore:
    def __init__(self, client: Client) -> None:
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
        grant: Grant | None = None,
        breaker: str = "",
    ) -> StoreResult:
        args = admit_args(prefix, checks, shadow, reservation, ttl_ms, grant, breaker)
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

    async def replay(self, made: Made) -> None:
        """Add counts made in process memory to Redis: one replay.lua per tenant, all at once."""
        per_prefix: dict[str, list[Arg]] = {}
        for (prefix, name), (w, buckets) in made.items():
            args = per_prefix.setdefault(prefix, [])
            for index, count in buckets.items():
                args += [name, w.bucket_ms, w.buckets, int(w.rolling), index, count]
        sent = [self._run(REPLAY, 1, prefix, *args) for prefix, args in per_prefix.items()]
        await asyncio.gather(*sent)

    async def heartbeat(self, replica: str, seen_ms: int) -> int:
        """Refresh this replica in the heartbeat set; how many replicas were seen in seen_ms."""
        count = await self._run(REPLICAS, 1, REPLICAS_KEY, replica, seen_ms)
        if not isinstance(count, int):
            raise RespError(f"replicas.lua returned {count!r}")
        return count

    async def _run(self, lua: tuple[str, str], *args: Arg) -> Reply:
        return await run(self.client, lua, *args)

    async def get_fleet(self, key: str) -> bytes | None:
        """The fleet-load key (llmgw/fleetload.py's JSON); None when absent."""
        value = await self.client.call("GET", key)
        return value if isinstance(value, bytes) else None

    async def load_scripts(self) -> None:
        for source, _ in (ADMIT, REPLAY, REPLICAS):
            await self.client.call("SCRIPT", "LOAD", source)


def admit_args(
    prefix: str,
    checks: Sequence[Check],
    shadow: bool,
    reservation: str,
    ttl_ms: int,
    grant: Grant | None = None,
    breaker: str = "",
) -> list[Arg]:
    """admit.lua's keys and arguments after the script (numkeys, the prefix and the breaker's
    key when consulted, ARGV). Every number is an int in range (Check and Grant clamp theirs)."""
    keys: list[Arg] = [2, prefix, breaker] if breaker else [1, prefix]
    args: list[Arg] = [*keys, int(shadow), reservation, int(ttl_ms), len(checks)]
    for c in checks:
        w = c.window
        reserve = 3 if c.money else 2 if c.reserve and c.caps else int(c.reserve)
        args += [c.name, w.bucket_ms, w.buckets, int(w.rolling), c.limit, c.cost, reserve]
    if grant is None:
        return [*args, 0, 0, 0, 0]
    return [*args, grant.prompt, grant.sequences, grant.base, grant.per_cap]


def outcome(reply: Reply, checks: Sequence[Check]) -> StoreResult:
    """admit.lua's reply folded: admitted, Redis's time, each check's buckets (newest first)
    and the cap it granted."""
    if not isinstance(reply, bytes):
        raise RespError(f"admit.lua returned {reply!r}")
    try:
        flat = list(map(int, reply.split()))
    except ValueError:
        raise RespError(f"admit.lua returned {reply!r}") from None
    if flat[:1] == [2] and len(flat) == 3:  # refused by the breaker: "2 now wait"
        return StoreResult(False, (), flat[1], circuit_ms=flat[2])
    counts: list[tuple[int, ...]] = []
    at = 2
    for c in checks:
        n = c.window.span
        counts.append(tuple(flat[at : at + n]))
        at += n
    if at + 1 != len(flat):
        raise RespError(f"admit.lua returned {reply!r}")
    return StoreResult(flat[0] == 1, tuple(counts), flat[1], cap=flat[at])
