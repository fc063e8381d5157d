"""The window rule, followed identically by admit.lua, store.LocalStore and `state` below.

Time is Redis's (admit.lua reads TIME and returns the time it used), never a replica's clock. A
limit of L per unit is counted in aligned buckets of b ms; bucket i holds what was admitted in
[i·b, (i+1)·b):

    unit     window W   bucket b   N = W/b
    second   1 s        100 ms     10
    minute   60 s       10 s       6
    hour     1 h        10 min     6
    day      24 h       1 h        24

Rolling windows (the rate limits). At time t let c = ⌊t/b⌋ and f = t − c·b. The window (t − W, t]
covers buckets c−N+1 … c and the last b − f ms of bucket c−N; that bucket counts in proportion
(linear decay), rounded up (the strict side):

    used(t) = B[c] + B[c−1] + … + B[c−N+1] + ⌈B[c−N] · (b − f) / b⌉

A decision of cost k passes a check when used(t) + k ≤ L; when every check passes, k is added to
B[c] of each, in one atomic step. Fixed windows (hard budgets): one bucket as long as the unit (the
UTC day for `day`; for money budgets also the UTC calendar month) and no decay, used(t) = B[c].
Bucket keys live N + 2 buckets (N + 1 fixed; a month's, 62 days).

Guarantee. At every instant the N buckets plus the weighted one hold at most L. A rolling window
(s, s + W] with s = a·b + g also holds the part of B[a] admitted after s, which the rule counted
as B[a]·(b − f)/b at some f ≤ g; so it holds at most L + ⌊B[a]·g/b⌋. When admissions inside a
bucket are spread evenly (the decay's assumption) that is L; in the worst case (a bucket's
admissions all in its last moments, and again just under W later) it approaches L + B[a] ≤ 2L,
where aligned buckets alone allowed 2L within W − b.

Reset time (x-ratelimit-reset-*): until used(t) is 0, i.e. the newest non-empty bucket i has left
entirely, at (i + N + 1)·b ((i + 1)·b fixed). Free time (the floor of Retry-After): the first
instant at which used + k ≤ L if nothing else is admitted meanwhile; a whole window when k > L.
"""

from __future__ import annotations

from collections.abc import Sequence

from ratelimit.types import UNIT_MS, Check, CheckState, Period, Unit, Window

SLIDING: dict[Unit, Window] = {
    Unit.SECOND: Window(1_000, 100),
    Unit.MINUTE: Window(60_000, 10_000),
    Unit.HOUR: Window(3_600_000, 600_000),
    Unit.DAY: Window(86_400_000, 3_600_000),
}


_FIXED: dict[Unit, Window] = {unit: Window(ms, ms, rolling=False) for unit, ms in UNIT_MS.items()}


def fixed(unit: Unit) -> Window:
    """The fixed window of a unit (hard budgets): one bucket as long as the unit."""
    return _FIXED[unit]


# The longest calendar month, for "a whole window" (a cost no month can hold).
_MONTH = Window(31 * UNIT_MS[Unit.DAY], 0, rolling=False)


def period(p: Period) -> Window:
    """The fixed window of a money budget: the UTC day, or the UTC calendar month."""
    return fixed(Unit.DAY) if p is Period.DAY else _MONTH


def used(window: Window, counts: Sequence[int], now_ms: int) -> int:
    """used(t) of the rule, from the `window.span` buckets newest first."""
    n = window.buckets
    total = sum(counts[:n])
    if window.rolling:
        b = window.bucket_ms
        total += (counts[n] * (b - now_ms % b) + b - 1) // b
    return total


def state(check: Check, counts: Sequence[int], added: bool, now_ms: int) -> CheckState:
    """A check's standing after a decision, from its buckets before it (newest first)."""
    w = check.window
    current = w.index(now_ms)
    before = used(w, counts, now_ms)
    passed = before + check.cost <= check.limit
    # Adding puts the cost in the newest bucket, one of the N counted whole.
    cost = check.cost if added else 0
    reset_ms = 0
    for age, count in enumerate(counts):
        if count + (cost if age == 0 else 0) > 0:
            reset_ms = w.start(current - age + w.span) - now_ms
            break
    free_ms = 0 if passed else _free_ms(check, counts, now_ms)
    return CheckState(check, before + cost, passed, reset_ms, free_ms)


def _free_ms(check: Check, counts: Sequence[int], now_ms: int) -> int:
    """Until the refused cost fits, if nothing else is admitted: m buckets ahead, the buckets of
    age ≤ N−1−m still count whole and the one of age N−m decays (rolling windows)."""
    w = check.window
    b, n = w.bucket_ms, w.buckets
    current = w.index(now_ms)
    if check.cost > check.limit:
        return w.window_ms  # never fits: a whole window
    for m in range(w.span + 1):
        room = check.limit - check.cost - sum(counts[: max(0, n - m)])
        if room < 0:
            continue
        decaying = counts[n - m] if w.rolling and m <= n else 0
        # The least f with ⌈decaying·(b − f)/b⌉ ≤ room; 0: it fits as this bucket begins.
        at = max(0, b - room * b // decaying) if decaying else 0
        free_at = w.start(current + m) + at
        if free_at > now_ms:
            return free_at - now_ms
    return w.window_ms
