"""One allowed check as it goes through the director's stages (extauthz/director.py), typed from
the decision to the answer: each stage fills in its part, and only the answer writes it for
Envoy (extauthz/answers.py)."""

from __future__ import annotations

from dataclasses import dataclass

from extauthz.types import Allow
from llmgw.facts import RequestFacts
from llmgw.tenant import TenantContext
from ratelimit.types import Admission, Verdict
from router.types import Pick, PickRequest, PodId

# A request's pick before it is held: what the router was asked, and its answer.
Chosen = tuple[PickRequest, Pick]


@dataclass(slots=True)
class Timings:
    """Seconds each stage took (None: it did not run, or did not finish)."""

    decide: float
    admit: float | None = None


@dataclass(slots=True)
class RequestContext:
    allow: Allow  # authenticated and decided: who, what, the headers for the pod
    timings: Timings
    body_bytes: int = 0  # what Envoy holds for it until it is answered
    # Admit: the reservation asked of the limiter inside, and its verdict (None: not decided,
    # the request goes on unchecked).
    admission: Admission | None = None
    verdict: Verdict | None = None
    # Pick: the router's choice, counted in flight from then until held or given back; then the
    # pods the request goes to, best first (empty: Envoy's fallback picks).
    chosen: Chosen | None = None
    pods: tuple[PodId, ...] = ()

    @property
    def context(self) -> TenantContext:
        return self.allow.context

    @property
    def facts(self) -> RequestFacts:
        return self.allow.facts
