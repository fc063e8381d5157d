"""Settlement: each outcome's tokens against the reservation ratelimit made (llmgw/settle.lua):
the ledger's, from the access log; and extauthz's release (0 tokens) of a request whose client
left while flow control held it, which Envoy logs without the check's metadata.

A batch is settled in one Redis round trip: every EVALSHA is written before any reply is awaited
(llmgw/resp.py pipelines), and each script touches one tenant's keys only (one Cluster slot).
Each script settles at Redis's own time (TIME), the clock admission decides by, never the
ledger's. Idempotent by request ID, so a batch delivered twice charges once. When Redis cannot be
reached the batch is not lost: the caller keeps it and tries again; until then its reservations
stay charged as reserved (never over-refunded).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

from llmgw.reservation import with_prelude
from llmgw.resp import Client, RespError, evalsha_each
from llmgw.wire import tenant_prefix

SOURCE = with_prelude(resources.files("llmgw").joinpath("settle.lua").read_text())
SHA = hashlib.sha1(SOURCE.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Charge:
    tenant: str
    request_id: str
    tokens: int
    cost_micros: int = 0  # what money budgets are charged (llmgw/prices.py)


@dataclass(frozen=True, slots=True)
class Settled:
    state: int  # 1 reservation settled, 0 no reservation, 2 already settled (a duplicate)
    reserved: int
    charged: int
    # Each money budget window the request was charged to: its name ("spend:day"), the bucket
    # (the day or month, as Redis's clock counts them) and the costs settled in it so far
    # (micro-units, without reservations outstanding).
    spent: tuple[tuple[str, int, int], ...] = ()


async def settle(client: Client, charges: Sequence[Charge], done_ttl_ms: int) -> list[Settled]:
    """Settle every charge; raises ConnectionError, TimeoutError or RespError when Redis fails."""
    calls = [
        (1, tenant_prefix(c.tenant), c.request_id, c.tokens, done_ttl_ms, c.cost_micros)
        for c in charges
    ]
    replies = await evalsha_each(client, SOURCE, SHA, calls)
    out: list[Settled] = []
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply
        if not isinstance(reply, list) or len(reply) != 4 or not isinstance(reply[3], bytes):
            raise RespError(f"settle.lua returned {reply!r}")
        state, reserved, charged = (v if isinstance(v, int) else 0 for v in reply[:3])
        words = reply[3].decode().split()
        spent = tuple(
            (words[i], int(words[i + 1]), int(words[i + 2])) for i in range(0, len(words) - 2, 3)
        )
        out.append(Settled(state, reserved, charged, spent))
    return out
