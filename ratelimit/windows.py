"""The sliding-window rule, shared by the Redis script and the in-process counters.

A limit of L per unit U is counted in aligned buckets:

    unit     window   bucket
    second   1 s      100 ms   (10 buckets)
    minute   60 s     10 s     (6 buckets)
    hour     1 h      10 min   (6 buckets)
    day      24 h     1 h      (24 buckets)

Bucket i covers [i·b, (i+1)·b) of Unix time in ms. At time t the current bucket is c = ⌊t/b⌋ and
the window is the N buckets c−N+1 … c. A decision with cost k passes when the sum of those buckets
plus k is at most L; if every check of the decision passes, k is added to bucket c of each check,
all in one atomic step. So within any N consecutive buckets, the admitted total never exceeds L.
Hard budgets use one bucket as long as the unit (a fixed window: the UTC day for `day`).

Reset time (x-ratelimit-reset-*): until the newest non-empty bucket leaves the window.
Free time (the floor of Retry-After): until enough of the oldest buckets leave the window for the
refused cost to fit.
"""

from __future__ import annotations

from collections.abc import Sequence

from ratelimit.types import UNIT_MS, Check, CheckState, Unit, Window

SLIDING: dict[Unit, Window] = {
    Unit.SECOND: Window(1_000, 100),
    Unit.MINUTE: Window(60_000, 10_000),
    Unit.HOUR: Window(3_600_000, 600_000),
    Unit.DAY: Window(86_400_000, 3_600_000),
}


def fixed(unit: Unit) -> Window:
    return Window(UNIT_MS[unit], UNIT_MS[unit])


def state(check: Check, counts: Sequence[int], added: bool, now_ms: int) -> CheckState:
    """A check's standing after a decision, from its buckets before it (newest first)."""
    w = check.window
    current = now_ms // w.bucket_ms
    before = sum(counts)
    passed = before + check.cost <= check.limit
    after = list(counts)
    if added and check.cost:
        after[0] += check.cost
    reset_ms = 0
    for age, count in enumerate(after):
        if count > 0:
            reset_ms = (current - age + w.buckets) * w.bucket_ms - now_ms
            break
    free_ms = 0
    if not passed:
        need = before + check.cost - check.limit
        free_ms = w.window_ms  # never fits (cost above the limit): a whole window
        freed = 0
        for age in range(len(counts) - 1, -1, -1):
            freed += counts[age]
            if freed >= need:
                free_ms = (current - age + w.buckets) * w.bucket_ms - now_ms
                break
    return CheckState(check, sum(after), passed, reset_ms, free_ms)
