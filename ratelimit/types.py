"""The nouns of the rate limiter: units, windows, checks and what a decision returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from llmgw.prices import Prices
from llmgw.tiers import Period as Period  # one definition each, shared with the tier table
from llmgw.tiers import TenantSpec, month_index, month_start
from llmgw.tiers import Unit as Unit

UNIT_MS: dict[Unit, int] = {
    Unit.SECOND: 1_000,
    Unit.MINUTE: 60_000,
    Unit.HOUR: 3_600_000,
    Unit.DAY: 86_400_000,
}

# The largest limit or count: 26 buckets of it (a day window and its cost) stay below 2^53.
MAX_COUNT = 2**48
# Micro-units in a unit of a money budget's per-token price (Grant.per_cap: a millionth of a
# micro-unit per token, so that the prices' six decimal places stay whole numbers).
PRICE_SCALE = 1_000_000

Kind = Literal["requests", "tokens", "spend"]
# too_large: a cost above the highest limit the request could ever get (never retried).
# circuit_open: the tenant's breaker (llmgw/breaker.py) is open, or half-open and not its turn.
Refusal = Literal["requests", "tokens", "too_large", "insufficient_quota", "circuit_open"]


@dataclass(frozen=True, slots=True)
class Window:
    """A window of `window_ms` made of aligned buckets of `bucket_ms` (see windows.py); bucket_ms
    0: one bucket a UTC calendar month (money budgets), window_ms the longest month."""

    window_ms: int
    bucket_ms: int
    rolling: bool = True  # the bucket before the window counts, decaying; False: a fixed window
    # Derived, kept: read several times per check of every decision.
    buckets: int = field(init=False, compare=False, repr=False)
    # How many buckets a decision reads: the window's, and the decaying one before them.
    span: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        buckets = self.window_ms // self.bucket_ms if self.bucket_ms else 1
        object.__setattr__(self, "buckets", buckets)
        object.__setattr__(self, "span", buckets + self.rolling)

    def index(self, now_ms: int) -> int:
        """The bucket `now_ms` falls in (calendar: year × 12 + month − 1)."""
        return now_ms // self.bucket_ms if self.bucket_ms else month_index(now_ms)

    def start(self, index: int) -> int:
        """When bucket `index` begins (ms)."""
        return index * self.bucket_ms if self.bucket_ms else month_start(index)


@dataclass(frozen=True, slots=True)
class Limit:
    unit: Unit
    amount: int  # per unit; unlimited limits are simply absent


@dataclass(frozen=True, slots=True)
class Policy:
    """The limits one (tenant, tier) pair runs under, resolved from the limits config."""

    tier: str
    requests: tuple[Limit, ...]
    tokens: tuple[Limit, ...]
    budget: Limit | None  # hard token budget per fixed unit; exhausted → insufficient_quota
    shadow: bool
    borrow_share: float  # share of the fleet's borrowable capacity this tier may take (0-1)
    retry_base_s: float
    # Money budgets in micro-units per period (hard, like `budget`), and the prices that cost
    # a request against them (the tier table's).
    spend: tuple[tuple[Period, int], ...] = ()
    prices: Prices | None = None


@dataclass(frozen=True, slots=True)
class Check:
    """One counter to test and add to, atomically with the other checks of a decision."""

    name: str  # key suffix, e.g. "tokens:minute"
    window: Window
    limit: int
    cost: int
    reserve: bool = False  # part of the token reservation (settled by the ledger)
    # A hard budget: when the cost does not fit, the store may lower the request's output cap to
    # what the budget has left (Grant) instead of refusing.
    caps: bool = False
    # A money budget (reserve and caps): its cost is micro-units, reserved apart from the
    # tokens and lowered by the Grant's money parts.
    money: bool = False

    def __post_init__(self) -> None:
        # Every number that reaches Redis is an int that INCRBY and Lua's doubles hold exactly;
        # a cost above MAX_COUNT stays above every limit, so it is refused as it would have been.
        object.__setattr__(self, "limit", min(max(int(self.limit), 0), MAX_COUNT))
        object.__setattr__(self, "cost", min(max(int(self.cost), 0), MAX_COUNT + 1))


# Grant.per_cap at or above this cannot lower a cap exactly in Lua's doubles (admit.lua's
# long division): such a request is refused by a money budget it does not fit, never capped.
MAX_PER_CAP = 2**43


@dataclass(frozen=True, slots=True)
class Grant:
    """A token reservation in its parts, estimate = prompt + cap × sequences: a hard budget with
    less left than the estimate but at least prompt + sequences admits the request at the cap
    that fits, ⌊(left − prompt) / sequences⌋, reserved as prompt + that cap × sequences in every
    token window (admit.lua, LocalStore).

    A money budget's cost at a cap is base + ⌈cap × per_cap / PRICE_SCALE⌉ micro-units (base: the
    prompt's worst case; per_cap: every sequence's token at the output price, in millionths of a
    micro-unit), so it lowers the cap to ⌊(left − base) × PRICE_SCALE / per_cap⌋; per_cap 0:
    it does not lower it."""

    prompt: int
    sequences: int
    base: int = 0
    per_cap: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", min(max(int(self.prompt), 0), MAX_COUNT))
        object.__setattr__(self, "sequences", min(max(int(self.sequences), 1), MAX_COUNT))
        object.__setattr__(self, "base", min(max(int(self.base), 0), MAX_COUNT + 1))
        per_cap = max(int(self.per_cap), 0)
        object.__setattr__(self, "per_cap", per_cap if per_cap < MAX_PER_CAP else 0)

    def cap(self, left: int) -> int:
        """The output cap per sequence that fits in `left` tokens; below 1: none does."""
        return (left - self.prompt) // self.sequences

    def cost(self, cap: int) -> int:
        return self.prompt + cap * self.sequences

    def money_cap(self, left: int) -> int:
        """The output cap per sequence that `left` micro-units pay for; 0: none (or no money
        parts)."""
        if not self.per_cap or left < self.base:
            return 0
        return (left - self.base) * PRICE_SCALE // self.per_cap

    def money_cost(self, cap: int) -> int:
        return self.base + -(-cap * self.per_cap // PRICE_SCALE)


def granted(checks: Sequence[Check], grant: Grant | None, cap: int) -> list[Check]:
    """The checks as the store charged them: at a lowered cap (cap > 0), every reserving check
    costs grant.cost(cap), every money check grant.money_cost(cap) (where the grant has money
    parts)."""
    if grant is None or cap <= 0:
        return list(checks)
    cost = grant.cost(cap)
    money = grant.money_cost(cap)
    out = []
    for c in checks:
        if c.money:  # without money parts, its own worst case stands (the strict side)
            out.append(replace(c, cost=money) if grant.per_cap else c)
        else:
            out.append(replace(c, cost=cost) if c.reserve else c)
    return out


@dataclass(frozen=True, slots=True)
class StoreResult:
    """What a store saw: admitted or not, and each check's buckets before adding (newest first,
    `window.span` of them) at `now_ms`, the time it decided at (Redis's own clock)."""

    admitted: bool
    counts: tuple[tuple[int, ...], ...]
    now_ms: int
    replicas: int = 1  # the store enforced each limit's share for this many replicas
    local: bool = False  # decided from in-process counters (Redis slow, down or in error)
    # The output cap per sequence a hard budget lowered the request to (see Grant); 0: the
    # request's own stands.
    cap: int = 0
    # Refused by the tenant's breaker before any check was read: the wait (ms) to suggest.
    circuit_ms: int | None = None


def share(limit: int, replicas: int) -> int:
    """One replica's share of a limit: ⌊limit / replicas⌋, never rounded down to 0."""
    return limit if limit == 0 else max(1, limit // replicas)


@dataclass(frozen=True, slots=True)
class CheckState:
    """One check after the decision, in the terms the response needs."""

    check: Check
    used: int  # in the window after the decision
    passed: bool
    reset_ms: int  # until every counted bucket has left the window
    free_ms: int  # until the window has room for the cost (0 when it passed)


@dataclass(frozen=True, slots=True)
class KindState:
    """The binding limit of one kind (requests or tokens) for headers and descriptor statuses."""

    kind: Kind
    limit: int
    unit: Unit | Period
    remaining: int
    reset_ms: int
    used: int
    requested: int


@dataclass(frozen=True, slots=True)
class Admission:
    """Request time: count one request and reserve its estimated tokens."""

    tenant: str
    tier: str
    session: str | None = None
    request_id: str | None = None
    token_estimate: int | None = None  # None: no token check
    count_request: bool = True  # False: only the token check
    # The tenant's own limits and budgets (its spec's: in-process from extauthz; apart, the
    # per-minute limits of Envoy's descriptor `limit` override), merged over its tier's
    # (llmgw/tiers.py TierTable.tenant_spec).
    own: TenantSpec | None = None
    # The reservation's parts (token_estimate = prompt + cap × sequences), for a hard budget to
    # lower the cap instead of refusing; None: the budget refuses what does not fit.
    grant: Grant | None = None
    # For money budgets: the model priced (None: the table's dearest prices) and the most tokens
    # the prompt can be (llmgw/facts.py prompt_ceiling; 0: the grant's prompt).
    model: str | None = None
    prompt_ceiling: int = 0


@dataclass(frozen=True, slots=True)
class Verdict:
    tenant: str
    tier: str
    refusal: Refusal | None  # None when admitted (always None in shadow mode)
    refused: KindState | None  # the check that refused (also set in shadow mode)
    requests: KindState | None
    tokens: KindState | None
    retry_after_ms: int
    shadow: bool
    # Admitted beyond the base limits, from the fleet's borrowing pool (ratelimit/pool.py): the
    # largest draw over each kind's windows; 0 and 0 when the admission ran on base quota.
    borrowed_requests: int = 0
    borrowed_tokens: int = 0
    # The output cap per sequence the pod gets instead of the request's, lowered to what the
    # tenant's hard budget has left (Grant); 0: the request's own.
    output_cap: int = 0

    @property
    def allowed(self) -> bool:
        return self.refusal is None
