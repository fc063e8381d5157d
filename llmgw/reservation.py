"""A tenant's counters in Redis and the reservation admission leaves for settlement: their keys
and encoding, one Lua prelude (llmgw/reservation.lua) before each script that touches them —
ratelimit/admit.lua and ratelimit/replay.lua, which write them, and llmgw/settle.lua, which
settles them — so the two sides cannot name a key differently (as llmgw/breaker.lua is before
both of the breaker's scripts).
"""

from __future__ import annotations

from importlib import resources

PRELUDE = resources.files("llmgw").joinpath("reservation.lua").read_text()


def with_prelude(source: str) -> str:
    """A script with the reservation's keys before it (its functions are locals of the script)."""
    return PRELUDE + "\n" + source
