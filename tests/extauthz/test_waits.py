"""The wait of a check net of the clocks' offset (extauthz/waits.py), on a simulated clock."""

from __future__ import annotations

from extauthz.waits import Waits


def test_the_offset_is_the_least_age_seen_and_follows_the_clocks() -> None:
    waits = Waits(window_s=60)

    def wait(now_ms: float, age_ms: float) -> float | None:
        return waits.waited_ms(int(now_ms - age_ms), now_ms)

    assert wait(1_000_000, 3000) == 0  # the first shows the offset: 3 s
    assert wait(1_000_010, 4500) == 1500
    # The clocks come 1 s closer: within a window the old offset is forgotten.
    assert wait(1_031_000, 2000) == 0  # a new half window; the 3 s offset is still in the older
    assert wait(1_062_000, 3200) == 1200  # the 3 s half window is gone: offset 2 s
    assert wait(1_062_010, 2000) == 0


def test_an_implausible_stamp_is_no_wait_and_leaves_the_offset_alone() -> None:
    waits = Waits()
    now = 5_000_000.0
    assert waits.waited_ms(int(now), now) == 0
    assert waits.waited_ms(int(now - 3_600_000), now) is None
    assert waits.waited_ms(int(now + 3_600_000), now) is None
    assert waits.waited_ms(int(now - 1500), now) == 1500
