"""The outcome record: what happened to one request, from Envoy's access log (ledger/).

Envoy writes one access-log entry per request when it ends (the gRPC access-log service, in
batches); the ledger turns each into one `Outcome`, settles its tokens and stores it. Everything
downstream of a request (settlement, the usage ledger, `llmgw usage`, the breaker, alerts) reads
this one model, so its field names are the ledger table's columns and `llmgw usage --json`'s keys
(but an excluded field's: what settlement reads and nothing stores).
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from llmgw.tiers import Spend

OutcomeKind = Literal["ok", "aborted", "upstream_error", "refused"]
OUTCOME_KINDS: tuple[OutcomeKind, ...] = ("ok", "aborted", "upstream_error", "refused")


class Outcome(BaseModel):
    """One request's outcome. Token counts are what the pod reported (usage), or for a stream
    cut short, the prompt (its bound before the pod reported it) plus the tokens that reached
    the client."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_id: str
    ts: datetime  # when Envoy received the request's first byte (UTC)
    tenant: str  # "" when the caller was never authenticated
    tier: str = ""
    session: str = ""
    key_id: str = ""
    model: str = ""
    endpoint: str = ""  # the path without its query string, e.g. "/v1/chat/completions"
    pod: str = ""  # "ip:port" of the pod that answered; "" when none did
    status: int  # what the client got; 0 when it hung up before any response
    flags: str = ""  # Envoy's response flags, e.g. "DC" (downstream hung up), "UF", "RL"
    attempts: int = 0  # upstream attempts (> 1: Envoy retried)
    stream: bool = False
    outcome: OutcomeKind
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reserved_tokens: int = 0  # the reservation made at admission (0: none)
    charged_tokens: int = 0  # what settlement left charged against the tenant's quota
    # What its tokens (prompt, cached, completion) cost at the price table's prices when it was
    # recorded, in micro-units of `currency` (llmgw/prices.py); "": its model has no price.
    cost_micros: int = 0
    currency: str = ""
    # Its share of its pod's time, from its duration and the pod's batch (ledger/gputime.py);
    # None: no pod, or its batch unknown.
    gpu_seconds: float | None = None
    # What the admission drew from the fleet's borrowing pool (ratelimit/pool.py); 0: it ran on
    # base quota. The draw is made at admission and never refunded to the pool (settlement
    # refunds the tenant's windows), so borrowed_tokens bounds the borrowed use from above.
    borrowed_requests: int = 0
    borrowed_tokens: int = 0
    # The rate limiter decided the admission; False with a pod reached: it failed open.
    quota_checked: bool = False
    # How long flow control held it in its queue before its dispatch, or its refusal there
    # (extauthz/flow.py; 0: it went at once); None: it did not pass through flow control.
    queue_ms: float | None = None
    ttft_ms: float | None = None  # first byte to the client; None when none was sent
    duration_ms: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    # The tenant's own money budgets, as its request's metadata carried them (its spec's), for
    # the soft limits (ledger/spending.py); not a column: the tier table and the spec hold them.
    spend: Spend | None = Field(default=None, exclude=True)

    @property
    def by_gateway(self) -> bool:
        """Refused by the rate limiter's own decision, the tenant breaker's too: the fleet did
        not fail. Envoy's flag is RL with the limiter behind its rate-limit filter; inside
        extauthz it is UAEX, which Envoy also sets when extauthz fails (a 503 with no limiter's
        answer: quota_checked is unset then)."""
        flags = self.flags.split(",")
        return "RL" in flags or ("UAEX" in flags and self.quota_checked)

    @property
    def reserved(self) -> bool:
        """Admission reserved its tokens: anything but the limiter's own refusal, which reserved
        nothing. Flow control refuses (queue_full, queue_timeout) after admission."""
        return not self.by_gateway or (self.status == 429 and self.queue_ms is not None)


# The columns `llmgw usage --json` prints, in this order (any others may follow).
JSON_FIELDS = (
    "request_id",
    "ts",
    "tenant",
    "session",
    "model",
    "pod",
    "status",
    "outcome",
    "prompt_tokens",
    "completion_tokens",
    "charged_tokens",
    "cost",  # cost_micros as the currency's decimal amount
    "currency",
    "gpu_seconds",
    "queue_ms",
    "ttft_ms",
    "duration_ms",
)
