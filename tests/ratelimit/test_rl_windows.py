"""The window rule (ratelimit/windows.py) on a simulated clock, through the in-process store."""

from __future__ import annotations

import bisect
import itertools
import random

from ratelimit.store import LocalStore
from ratelimit.types import Check, Window
from ratelimit.windows import state, used

T0 = 1_800_000_000_000  # ms, a multiple of every bucket


def test_the_bucket_before_the_window_decays_linearly_rounded_up() -> None:
    w = Window(60_000, 10_000)
    counts = (0, 0, 0, 0, 0, 0, 7)  # 7 in the bucket just before the window
    assert used(w, counts, T0) == 7  # all of it still inside (t − 60 s, t]
    assert used(w, counts, T0 + 5_000) == 4  # ⌈3.5⌉
    assert used(w, counts, T0 + 9_999) == 1  # ⌈0.0007⌉: the strict side
    assert used(Window(86_400_000, 86_400_000, rolling=False), (7,), T0 + 5) == 7


async def test_aligned_buckets_no_longer_admit_twice_the_limit_within_a_minute() -> None:
    """L at the very end of one bucket; 50 s later aligned buckets had forgotten it."""
    store, limit = LocalStore(), 10
    checks = [Check("r", Window(60_000, 10_000), limit, 1)]
    late = T0 + 9_999
    assert sum([(await store.admit("p", checks, late)).admitted for _ in range(20)]) == limit
    for at in (T0 + 50_000, T0 + 59_999, T0 + 60_000):  # aligned buckets: 10 more at each
        assert not (await store.admit("p", checks, at)).admitted, at
    # From here the decay assumes those 10 were spread over their bucket: the rolling minute
    # (5 s, 65 s] then holds 15 = L + ⌊B·g/b⌋, the bound windows.py states.
    assert sum([(await store.admit("p", checks, T0 + 65_000)).admitted for _ in range(9)]) == 5


async def test_rolling_windows_stay_within_the_stated_bound() -> None:
    """Adversarial traffic (bursts hugging bucket ends, random gaps, random costs): at every
    decision the rule's own measure is within L, and every rolling window (s, s + W] holds at
    most L + ⌊B[a]·g/b⌋ (windows.py), B[a] being what its partly covered first bucket admitted."""
    rng = random.Random(11)
    w, limit = Window(1_000, 100), 40
    b = w.bucket_ms
    store = LocalStore()
    admitted: list[tuple[int, int]] = []  # (ms, cost)
    now = T0
    for _ in range(3_000):
        now += rng.choice([0, 0, 1, 3, 17, 60, 99, b - now % b - 1, b - now % b])
        check = Check("r", w, limit, rng.choice([1, 1, 2, 5]))
        outcome = await store.admit("p", [check], now)
        after = state(check, outcome.counts[0], outcome.admitted, now)
        assert after.used <= limit or not outcome.admitted
        if outcome.admitted:
            admitted.append((now, check.cost))
    per_bucket: dict[int, int] = {}
    for at, cost in admitted:
        per_bucket[at // b] = per_bucket.get(at // b, 0) + cost
    times = [at for at, _ in admitted]
    total = [0, *itertools.accumulate(c for _, c in admitted)]
    worst_excess = 0
    for start in range(T0 - w.window_ms, now):  # every rolling window, to the ms
        first = bisect.bisect_right(times, start)
        inside = total[bisect.bisect_right(times, start + w.window_ms)] - total[first]
        a, g = divmod(start, b)
        bound = limit + per_bucket.get(a, 0) * g // b
        assert inside <= bound, start
        worst_excess = max(worst_excess, inside - limit)
    assert worst_excess > 0  # the adversary does get past L: the bound is not decoration


async def test_free_and_reset_times_are_the_first_instants_the_rule_allows() -> None:
    """Retry-After's floor: refused 1 ms before free_ms, admitted at it; reset: 0 used at it."""
    rng = random.Random(5)
    refused = 0
    for w in (Window(60_000, 10_000), Window(60_000, 60_000, rolling=False)):
        for _ in range(300):
            store = LocalStore()
            now = T0
            limit = rng.randrange(1, 30)
            for _ in range(rng.randrange(1, 12)):
                now += rng.randrange(0, 14_000)
                await store.admit("p", [Check("r", w, limit, rng.randrange(1, 6))], now)
            cost = rng.randrange(1, limit + 1)
            probe = Check("r", w, limit, cost)
            seen = await store.admit("p", [probe], now)
            s = state(probe, seen.counts[0], seen.admitted, now)
            if s.passed:
                continue
            refused += 1
            counts = seen.counts[0]
            assert _used_at(w, counts, now, now + s.free_ms - 1) + cost > limit
            assert _used_at(w, counts, now, now + s.free_ms) + cost <= limit
            assert _used_at(w, counts, now, now + s.reset_ms - 1) > 0
            assert _used_at(w, counts, now, now + s.reset_ms) == 0
    assert refused > 200


def _used_at(w: Window, counts: tuple[int, ...], now: int, later: int) -> int:
    """The rule's measure at `later` of the buckets seen at `now`, nothing admitted meanwhile."""
    k = later // w.bucket_ms - now // w.bucket_ms
    return used(w, ((0,) * k + counts)[: w.span], later)
