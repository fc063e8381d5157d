"""The tenants' breakers as they stand now, read from the Redis they live in (one hash per
tenant, llmgw/breaker.lua). admin/breaker.lua runs the rule's read-only `cb_state` at Redis's
time, one EVALSHA per tenant, every one written before any reply is awaited: a page of 1,000
tenants is one round trip. Reading changes nothing: not the scores, not a half-open step's
count of requests (admission's), not the hash's expiry.

Connected on first use and made again after the connection broke (llmgw/link.py), so the admin
API starts and serves its other routes while Redis is down. Without Redis settings, or while
Redis fails or is slower than `timeout_s`, a read is a 503 in OpenAI's error shape, never a 500.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import Any, Literal

from admin.types import ApiError, TenantRow
from llmgw.breaker import with_prelude
from llmgw.link import RedisLink
from llmgw.redisconf import RedisSettings
from llmgw.resp import RespError, evalsha_each
from llmgw.tiers import TierTable
from llmgw.wire import breaker_key

log = logging.getLogger(__name__)

SOURCE = with_prelude(resources.files("admin").joinpath("breaker.lua").read_text())
SHA = hashlib.sha1(SOURCE.encode()).hexdigest()

State = Literal["closed", "open", "half_open"]
STATES: dict[bytes, State] = {
    b"closed": "closed",
    b"open": "open",
    b"half": "half_open",
    b"recovered": "closed",  # the last step ran out; the next feed cleans the hash up
}
NOT_CONFIGURED = ApiError(
    503,
    "the admin API has no Redis configured (LLMGW_ADMIN__REDIS__HOST, …): breaker state is"
    " not served",
    "not_configured",
    type="server_error",
)


@dataclass(frozen=True)
class BreakerState:
    tenant: str
    state: State
    until: datetime | None  # open: the cool-down's end; half-open: the current step's
    admits: float | None  # half-open: the share of requests this step admits
    tripped_at: datetime | None  # the episode's first trip (a re-open keeps it)
    # Tripped: this episode's cool-down (re-opens grow it); closed: the one a trip would start
    # with, by the tenant's tier (None: the tier has no breaker).
    cooldown_s: float | None

    def view(self) -> dict[str, Any]:
        return {
            "object": "breaker",
            "tenant": self.tenant,
            "state": self.state,
            "until": _iso(self.until),
            "admits": self.admits,
            "tripped_at": _iso(self.tripped_at),
            "cooldown_s": self.cooldown_s,
        }


class BreakerStates:
    def __init__(self, redis: RedisSettings | None, timeout_s: float = 1.0) -> None:
        self._link = RedisLink.of(redis) if redis is not None else None
        self.timeout_s = timeout_s  # a read, connecting included
        self._connecting = asyncio.Lock()  # one connection, however many requests wait for it

    async def read(self, tenants: Sequence[TenantRow], tiers: TierTable) -> list[BreakerState]:
        """The breakers of `tenants`, in order; ApiError 503 when they cannot be read."""
        if self._link is None:
            raise NOT_CONFIGURED
        if not tenants:
            return []
        calls = [(1, breaker_key(t.spec.id)) for t in tenants]
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._connecting:
                    client = await self._link.get()
                replies = await evalsha_each(client, SOURCE, SHA, calls)
            for reply in replies:
                if isinstance(reply, BaseException):
                    raise reply
            return [_state(t, r, tiers) for t, r in zip(tenants, replies, strict=True)]
        except (ConnectionError, OSError, TimeoutError, RespError) as exc:
            if isinstance(exc, TimeoutError):  # Redis owes replies: a new connection next time
                await self._link.close()
            log.warning("redis refused a breaker read", extra={"error": repr(exc)})
            raise ApiError(
                503, "redis unavailable: breaker state unknown", "unavailable", type="server_error"
            ) from exc

    async def close(self) -> None:
        if self._link is not None:
            await self._link.close()


def _state(tenant: TenantRow, reply: object, tiers: TierTable) -> BreakerState:
    """admin/breaker.lua's answer: Redis's time, then cb_state's (llmgw/breaker.lua)."""
    match reply:
        case [
            bytes(),
            bytes() as phase,
            bytes() as ends,
            bytes() as share,
            bytes() as at,
            bytes() as cd,
        ] if phase in STATES:
            state = STATES[phase]
            if state == "closed":
                spec = tiers.tier(tenant.spec.tier).breaker
                cooldown = spec.cooldown_s if spec is not None else None
                return BreakerState(tenant.spec.id, state, None, None, None, cooldown)
            return BreakerState(
                tenant.spec.id,
                state,
                _time(ends),
                int(share) / 1000 if share else None,
                _time(at) if at else None,
                int(cd) / 1000 if cd else None,
            )
    raise RespError(f"breaker.lua returned {reply!r}")


def _time(ms: bytes) -> datetime:
    return datetime.fromtimestamp(int(ms) / 1000, UTC)


def _iso(at: datetime | None) -> str | None:
    return at.isoformat() if at is not None else None
