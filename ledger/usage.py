"""What the ledger's records add up to: one definition of a usage total over `outcomes`, as SQL,
for `llmgw usage` (tools/usage.py) and the admin API (admin/reports.py)."""

from __future__ import annotations


def amount(micros: str) -> str:
    """SQL: micro-units as the currency's decimal amount."""
    return f"round(({micros})::numeric / 1000000, 6)"


def one_currency(total: str) -> str:
    """SQL: an amount summed over records priced in one currency; none over several (a price
    table changed its currency: a narrower window gives one)."""
    return f"CASE WHEN count(DISTINCT nullif(currency, '')) > 1 THEN NULL ELSE {total} END"


# A record's cost times its borrowed share of the charged tokens (integer micro-units).
_BORROWED_MICROS = (
    "floor(cost_micros::numeric * least(borrowed_tokens, charged_tokens)"
    " / greatest(charged_tokens, 1))"
)

# The totals of a group of records (after its key, before FROM).
TOTALS = (
    "count(*) AS requests,"
    " count(*) FILTER (WHERE outcome = 'upstream_error') AS errors,"
    " count(*) FILTER (WHERE outcome = 'refused') AS refused,"
    " count(*) FILTER (WHERE outcome = 'aborted') AS aborted,"
    " sum(prompt_tokens)::bigint AS prompt_tokens,"
    " sum(completion_tokens)::bigint AS completion_tokens,"
    " sum(cached_tokens)::bigint AS cached_tokens,"
    " sum(charged_tokens)::bigint AS charged_tokens,"
    # The bill's split of the charged tokens. A record's borrowed_tokens is the draw at
    # admission, an upper bound of its borrowed use: settlement refunds the tenant's windows,
    # never the pool. So borrowed use is the draw capped at the charge, base use the rest.
    " sum(greatest(charged_tokens - borrowed_tokens, 0))::bigint AS base_tokens,"
    " sum(least(borrowed_tokens, charged_tokens))::bigint AS borrowed_tokens,"
    " sum(borrowed_requests)::bigint AS borrowed_requests,"
    # The cost split as the charged tokens are: a record's borrowed share of its charge.
    f" {one_currency('sum(cost_micros)::bigint')} AS cost_micros,"
    f" {one_currency(amount('sum(cost_micros)'))} AS cost,"
    f" {one_currency(amount(f'sum(cost_micros - {_BORROWED_MICROS})'))} AS base_cost,"
    f" {one_currency(amount(f'sum({_BORROWED_MICROS})'))} AS borrowed_cost,"
    " string_agg(DISTINCT nullif(currency, ''), ',') AS currency,"
    " round(sum(gpu_seconds)::numeric, 3) AS gpu_seconds,"
    # The wait in flow control's queue (none: not held; 0: went at once), then the pod's.
    " percentile_cont(0.5) WITHIN GROUP (ORDER BY queue_ms) AS queue_p50_ms,"
    " percentile_cont(0.9) WITHIN GROUP (ORDER BY queue_ms) AS queue_p90_ms,"
    " percentile_cont(0.5) WITHIN GROUP (ORDER BY ttft_ms) AS ttft_p50_ms,"
    " percentile_cont(0.9) WITHIN GROUP (ORDER BY ttft_ms) AS ttft_p90_ms"
)
