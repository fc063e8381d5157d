"""The per-tenant circuit breaker: its configuration (one per tier, in the tier table), the
weight of each outcome, and the Lua rule both of its sides run (llmgw/breaker.lua).

The ledger feeds it the outcomes it receives (ledger/breaker.py); ratelimit enforces it in the
admission script it already calls (ratelimit/admit.lua), so it adds no exchange to a request.
Both run llmgw/breaker.lua, prepended to their script at load time: the state, the decay, the
trip and the lazily computed recovery steps are defined once, there.
"""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING, Literal, NamedTuple

from pydantic import Field, model_validator

from llmgw.config import Strict

if TYPE_CHECKING:  # the outcome record names the tier table's Spend, which names breakers
    from llmgw.outcome import Outcome

# Status code (or class "4xx", "5xx") → the weight an outcome adds to the tenant's score.
# 429 0.7, 500 1.0, 503 1.2 and 400 0.3 are the seed's. The rest, chosen:
# - other 5xx (502, 504, a stream that failed after its 200) like 500: the tenant's requests
#   fail on the fleet;
# - other 4xx (408, 413, 422…) like 400: the tenant sends what cannot be served;
# - 404 counts nothing: a model the fleet does not serve is answered by the gateway from the
#   fleet's model list (extauthz/director.py) without asking a pod; where the list is not known
#   (the router apart, or not scraped yet) the pod answers the same 404 at the same small cost.
#   7 requests naming an unknown model locked a standard tenant out, 30 s then 60 s;
# - 401 and 403 count nothing: they answer one key's identity or permissions, and a stale client
#   hammering a revoked key must not lock out the tenant's working keys;
# - 0 and 499 (the client hung up) count nothing: the client's choice, not a failure;
# - the gateway's own rate-limit refusals (a quota 429, the breaker's 503: Outcome.by_gateway)
#   never count: a tenant over quota is already held to it, and tripping its breaker would turn a
#   1-second Retry-After into a 2-minute lock-out (a 50-request burst over 40/min did, for
#   free). Persistent quota refusals raise the quota_refusals alert instead (ledger/detectors.py).
#   The 429 weight is for 429s a pod sends.
# A 4xx weighs on the tenant's mistakes (its own threshold), anything else on its failures.
SEED_WEIGHTS: dict[str, float] = {
    "400": 0.3,
    "429": 0.7,
    "500": 1.0,
    "503": 1.2,
    "401": 0.0,
    "403": 0.0,
    "404": 0.0,
    "499": 0.0,
    "4xx": 0.3,
    "5xx": 1.0,
}
STREAM_FAILED = "stream"  # the cause of a failure after the 200: weighed as a 500
# Envoy's response flags of a failure that is the fleet's, whoever sent the request: the pod
# reset the stream or its connection (UR, UC: a pod killed, evicted, OOM-killed), no connection
# could be made (UF), none was left in the pool (UO: another tenant's concurrency can fill it),
# no healthy pod (UH), no address or cluster (DF, NC), Envoy itself overloaded (OM). They weigh
# nothing here; pod health (Envoy's outlier detection, the router's) and the fleet alerts
# (fleet_5xx, pod_errors: ledger/detectors.py) take them. A pod killed under one stream of each
# tier locked the free tenant out for 2 minutes (one broken stream weighed 1.0, its threshold 1).
FLEET_FLAGS = frozenset({"UR", "UC", "UF", "UO", "UH", "DF", "NC", "OM"})

EXCUSED = ("fleet", "pod")  # the causes of failures that weigh nothing: not the tenant's
Score = Literal["s", "m"]  # the failures' score or the mistakes' (their fields in the hash)


class Weighed(NamedTuple):
    weight: float
    score: Score
    cause: str  # the status, or "stream"; "fleet" or "pod" when the fleet was at fault


def score_of(key: str) -> Score:
    """A weight's score: a 4xx is the client's mistake, anything else a failure."""
    return "m" if key.startswith("4") else "s"


class BreakerSpec(Strict):
    """One tier's breaker. Two scores Σ w·e^(−λ·age): the tenant's failures (5xx, broken
    streams, none the fleet's) and its mistakes (4xx). It trips when failures reach `threshold`
    or mistakes `mistakes_threshold`; refuses everything for the cool-down; then admits `steps`
    of the tenant's requests in turn (a share each, for `step_s` each) and closes after the last.
    During recovery both start from 0 and failures reaching `recovery_threshold`, or mistakes
    their own threshold, re-open (each threshold less `slack`), the cool-down × `cooldown_growth`
    (at most `cooldown_max_s`); a full recovery resets it. No single outcome outweighs a
    threshold: one request never trips a closed breaker."""

    weights: dict[str, float] = Field(default_factory=lambda: dict(SEED_WEIGHTS))
    decay_per_min: float = Field(default=0.5, ge=0)  # λ
    threshold: float = Field(gt=0)
    # The client's mistakes (a pod's 4xx) count apart: a misconfigured app sends a few before
    # anyone notices, and they cost the pods little. 6 is 20 bad requests (0.3 each) in a burst.
    mistakes_threshold: float = Field(default=6.0, gt=0)
    cooldown_s: float = Field(gt=0)
    cooldown_growth: float = Field(default=2.0, ge=1)
    cooldown_max_s: float = Field(gt=0)
    steps: tuple[float, ...] = Field(default=(0.1, 0.3, 1.0), min_length=1)
    step_s: float = Field(default=10.0, gt=0)
    # One 5xx-weighted failure re-opens: a probe that fails once has failed.
    recovery_threshold: float = Field(default=1.0, gt=0)
    # How far below a threshold the score still trips. The failures of one storm arrive seconds
    # apart and have decayed a little by the last (three 500s a second apart sum to 2.975): 0.05
    # lets them add up whole while their ages sum to ~6 s (at λ = 0.5/min), and no further.
    slack: float = Field(default=0.05, ge=0, lt=0.3)
    alert: bool = False  # a trip calls the support hook (ledger/alerts.py)

    @model_validator(mode="after")
    def _valid(self) -> BreakerSpec:
        if any(not 0 < s <= 1 for s in self.steps):
            raise ValueError("breaker steps are shares in (0, 1]")
        if self.cooldown_max_s < self.cooldown_s:
            raise ValueError("breaker cooldown_max_s is below cooldown_s")
        bad = [k for k in self.weights if not (k.isdigit() or k in ("4xx", "5xx"))]
        if bad:
            raise ValueError(f"breaker weights: not a status or 4xx/5xx: {bad}")
        limits = {"s": self.threshold - self.slack, "m": self.mistakes_threshold - self.slack}
        single = [k for k, w in self.weights.items() if w >= limits[score_of(k)]]
        if single:
            raise ValueError(
                f"breaker weights {single}: one request would trip it (each weight must stay "
                "below its threshold less slack: threshold for 5xx, mistakes_threshold for 4xx)"
            )
        return self

    def weight(self, o: Outcome, pods_fault: bool = False) -> Weighed:
        """What an outcome adds to the tenant's scores, and its cause. `pods_fault`: the pod
        failed many tenants at once (ledger/blame.py)."""
        key = str(o.status)
        if o.by_gateway:
            return Weighed(0.0, "s", key)  # the gateway's own refusal: see SEED_WEIGHTS
        if FLEET_FLAGS.intersection(o.flags.split(",")):
            return Weighed(0.0, "s", "fleet")
        failed = o.outcome == "upstream_error"
        if failed and pods_fault:
            return Weighed(0.0, "s", "pod")
        if failed and o.status < 500 and o.status != 0:
            return Weighed(self.weights.get("500", 0.0), "s", STREAM_FAILED)
        if key not in self.weights:
            key = f"{key[0]}xx" if len(key) == 3 else ""
        return Weighed(self.weights.get(key, 0.0), score_of(key), str(o.status))

    def feed_args(self) -> list[str | int]:
        """The tier's part of ledger/breaker.lua's ARGV (see cb_feed in llmgw/breaker.lua)."""
        return [
            repr(self.threshold - self.slack),
            repr(self.recovery_threshold - self.slack),
            repr(self.mistakes_threshold - self.slack),
            repr(self.decay_per_min / 60_000),
            int(self.cooldown_s * 1000),
            repr(self.cooldown_growth),
            int(self.cooldown_max_s * 1000),
            int(self.step_s * 1000),
            " ".join(str(round(s * 1000)) for s in self.steps),
        ]


def seed(
    cooldown_s: float, threshold: float, mistakes_threshold: float, alert: bool = False
) -> BreakerSpec:
    """A built-in tier's breaker: the seed's weights, decay and steps; the cool-down may grow
    to 8× (three failed recoveries in a row)."""
    return BreakerSpec(
        threshold=threshold,
        mistakes_threshold=mistakes_threshold,
        cooldown_s=cooldown_s,
        cooldown_max_s=8 * cooldown_s,
        alert=alert,
    )


PRELUDE = resources.files("llmgw").joinpath("breaker.lua").read_text()


def with_prelude(source: str) -> str:
    """A script with the breaker's rule before it (its functions are locals of the script)."""
    return PRELUDE + "\n" + source
