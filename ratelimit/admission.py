"""The admission of a request decided inside extauthz's Check: extauthz's tenant context and
request facts, typed, as the Admission that Envoy's descriptors carry to `python -m ratelimit`
from the same values written as metadata (ratelimit/descriptors.py), so either path decides the
same request alike (tests/ratelimit/test_rl_admission.py)."""

from __future__ import annotations

from llmgw.facts import RequestFacts
from llmgw.tenant import TenantContext
from ratelimit.types import Admission, Grant


def from_context(context: TenantContext, facts: RequestFacts) -> Admission:
    """Count the request, and reserve its token estimate, which a hard budget may lower by its
    output cap (Grant); its model and prompt ceiling price it for money budgets."""
    return Admission(
        context.tenant,
        context.tier,
        context.session or None,
        context.request_id,
        facts.token_estimate,
        own=context.own,
        grant=Grant(facts.history + facts.prompt_tokens, facts.n) if facts.n else None,
        model=facts.model,
        prompt_ceiling=facts.history + facts.prompt_ceiling,
    )
