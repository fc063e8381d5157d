"""The tenant breaker's rule on a simulated clock (tests/breaker_model.py restates
llmgw/breaker.lua; tests/ratelimit/test_rl_breaker.py checks the scripts against it), and the
weight of each outcome."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from llmgw.breaker import BreakerSpec
from llmgw.config import ConfigError, validate
from llmgw.outcome import Outcome
from llmgw.tiers import BUILTIN_TIERS, TierTable
from tests.breaker_model import Model

S = 1000  # ms
FREE = BUILTIN_TIERS["free"].breaker
PLATINUM = BUILTIN_TIERS["platinum"].breaker
FAIL = [(1.0, "s", "500")]
STANDARD = BUILTIN_TIERS["standard"].breaker


def admitted(model: Model, start: int, requests: int, spacing: int = 1) -> int:
    return sum(model.admit(start + i * spacing) is None for i in range(requests))


def test_seed_numbers_per_tier() -> None:
    b = {name: t.breaker for name, t in BUILTIN_TIERS.items()}
    assert b["free"] and b["standard"] and b["platinum"]
    assert (b["free"].threshold, b["standard"].threshold, b["platinum"].threshold) == (2, 2, 3)
    mistakes = (b["free"].mistakes_threshold, b["standard"].mistakes_threshold)
    assert (*mistakes, b["platinum"].mistakes_threshold) == (6, 9, 12)
    assert (b["free"].cooldown_s, b["standard"].cooldown_s, b["platinum"].cooldown_s) == (
        120,
        30,
        15,
    )
    assert [t.alert for t in b.values() if t is not None] == [False, False, True]
    assert b["free"].steps == (0.1, 0.3, 1.0) and b["free"].decay_per_min == 0.5


def test_recovery_admits_10_then_30_then_100_percent_then_closes() -> None:
    assert FREE is not None
    m = Model(FREE)
    assert m.feed(0, FAIL) == []  # one request never trips
    assert m.feed(0, FAIL) == [f"trip 0 500 {120 * S} 0 0"]
    # Open: everything refused, told the remaining cool-down.
    assert m.admit(1 * S) == 119 * S and m.admit(119_999) == 1
    assert admitted(m, 0, 1000, 100) == 0
    step = int(FREE.step_s * S)
    opened = 120 * S
    # Each step: the first request passes, then one in 1000/share, whatever the spacing.
    assert admitted(m, opened, 100) == 10
    assert admitted(m, opened + step, 100, 7) == 30
    assert admitted(m, opened + 2 * step, 100, 3) == 100
    # The wait a half-open refusal suggests: until its step ends.
    assert m.admit(opened + 2 * step + 5) is None
    fresh = Model(FREE)
    fresh.feed(0, FAIL * 2)
    assert fresh.admit(opened + 5) is None and fresh.admit(opened + 6) == step - 6
    assert m.feed(opened + 3 * step, []) == [f"recover {opened + 3 * step} 0"]
    assert m.phase(opened + 3 * step)[0] == "closed"
    assert admitted(m, opened + 3 * step, 50) == 50


def test_a_failure_during_recovery_reopens_with_a_longer_cool_down_bounded() -> None:
    assert FREE is not None
    m = Model(FREE)
    m.feed(0, FAIL * 2)
    now, cooldowns = 0, []
    for _ in range(5):
        now = m.until or 0  # the first half-open step
        assert m.phase(now)[0] == "half"
        (event,) = m.feed(now + 1, FAIL)
        assert event.split()[4] == "1"  # a reopen
        cooldowns.append(m.cooldown)
    assert cooldowns == [240 * S, 480 * S, 960 * S, 960 * S, 960 * S]  # ×2, at most 8×
    # A full recovery resets it: the next trip is back to the base cool-down.
    assert m.until is not None
    end = m.until + 3 * int(FREE.step_s * S)
    assert m.feed(end, []) == [f"recover {end} 0"]
    assert m.feed(end + 1, FAIL * 2) == [f"trip {end + 1} 500 {120 * S} 0 {end + 1}"]


def test_a_failure_in_the_last_step_still_reopens_but_a_few_mistakes_do_not() -> None:
    assert FREE is not None
    m = Model(FREE)
    m.feed(0, FAIL * 2)
    last = 120 * S + 2 * int(FREE.step_s * S)
    assert m.feed(last, [(0.7, "m", "429")] * 8) == []  # mistakes: their own threshold (6)
    assert m.feed(last, [(0.5, "s", "5xx")]) == []  # below the recovery threshold (1.0)
    assert m.feed(last + 1, [(0.5, "s", "5xx")])[0].startswith("trip")  # 1.0: re-opened


def test_platinum_needs_three_failures_and_old_ones_decay() -> None:
    assert PLATINUM is not None
    m = Model(PLATINUM)
    assert m.feed(0, FAIL) == [] and m.feed(1, FAIL) == []
    assert m.feed(2, FAIL) == [f"trip 2 500 {15 * S} 0 2"]
    # Within one storm they add up (three 500s 1.5 s apart: 2.963); further apart they decay.
    storm = Model(PLATINUM)
    assert storm.feed(0, FAIL) == [] and storm.feed(1500, FAIL) == []
    assert storm.feed(3000, FAIL)[0].startswith("trip")
    slow = Model(PLATINUM)
    assert (
        slow.feed(0, FAIL) == [] and slow.feed(4 * S, FAIL) == [] and slow.feed(8 * S, FAIL) == []
    )
    spread = Model(PLATINUM)  # two minutes apart: 1 + e^-1 + e^-2 + … never reaches 3
    assert [spread.feed(i * 120 * S, FAIL) for i in range(10)] == [[]] * 10


def test_outcomes_arriving_while_open_count_nothing() -> None:
    assert FREE is not None
    m = Model(FREE)
    m.feed(0, FAIL * 2)
    assert m.feed(1, FAIL * 50) == []
    assert (m.until, m.score) == (120 * S, 0.0)


def test_one_batch_trips_once_and_later_outcomes_of_it_are_ignored() -> None:
    assert FREE is not None
    m = Model(FREE)
    batch = [(0.3, "m", "400"), (1.2, "s", "503"), (1.0, "s", "500"), (0.7, "m", "429")]
    assert m.feed(0, batch) == [f"trip 0 500 {120 * S} 0 0"]


def outcome(status: int, flags: str = "", kind: str = "", checked: bool = False) -> Outcome:
    kinds = {True: "upstream_error", False: "refused" if status >= 400 else "ok"}
    return Outcome(
        request_id="r",
        ts=datetime.now(UTC),
        tenant="t",
        status=status,
        flags=flags,
        outcome=kind or kinds[status >= 500],  # type: ignore[arg-type]
        quota_checked=checked,
    )


@pytest.mark.parametrize(
    ("status", "flags", "kind", "weight", "checked"),
    [
        (500, "", "", (1.0, "s", "500"), False),
        (503, "", "", (1.2, "s", "503"), False),
        (429, "RL", "", (0.0, "s", "429"), False),  # the gateway's quota refusal: held to quota
        (429, "", "ok", (0.7, "m", "429"), False),  # a pod's 429
        (400, "", "", (0.3, "m", "400"), False),  # the client's mistakes: a score of their own
        (502, "", "", (1.0, "s", "502"), False),
        (504, "UT", "", (1.0, "s", "504"), False),
        (404, "", "", (0.0, "m", "404"), False),  # a model no pod serves: never counts
        (404, "UAEX", "", (0.0, "m", "404"), False),  # ... answered by the gateway
        (413, "", "", (0.3, "m", "413"), False),
        (401, "UAEX", "", (0.0, "m", "401"), False),
        (403, "UAEX", "", (0.0, "m", "403"), False),
        (200, "", "upstream_error", (1.0, "s", "stream"), False),  # failed after its 200
        (200, "", "", (0.0, "s", "200"), False),
        (0, "DC", "aborted", (0.0, "s", "0"), False),
        (200, "DC", "aborted", (0.0, "s", "200"), False),
        (503, "RL", "", (0.0, "s", "503"), False),  # the breaker's own refusal
        # Both refusals by the rate limiter inside extauthz (its answer is there: checked) ...
        (503, "UAEX", "", (1.2, "s", "503"), False),  # ... not extauthz failing (no answer)
        # The fleet's: a pod killed under a stream (its reset, its connection gone), no pod to
        # connect to, none healthy, the pool full.
        (200, "UR", "upstream_error", (0.0, "s", "fleet"), False),
        (200, "UC", "upstream_error", (0.0, "s", "fleet"), False),
        (503, "UF,URX", "", (0.0, "s", "fleet"), False),
        (503, "UH", "", (0.0, "s", "fleet"), False),
        (503, "UO", "", (0.0, "s", "fleet"), False),
    ],
)
def test_weights(
    status: int, flags: str, kind: str, weight: tuple[float, str, str], checked: bool
) -> None:
    assert FREE is not None
    assert FREE.weight(outcome(status, flags, kind, checked)) == weight


def test_the_limiters_refusals_inside_extauthz_weigh_nothing() -> None:
    assert FREE is not None
    for status in (429, 503):
        assert FREE.weight(outcome(status, "UAEX", checked=True)).weight == 0.0


def test_a_failure_of_a_pod_that_failed_many_tenants_is_the_pods() -> None:
    assert FREE is not None
    assert FREE.weight(outcome(500), pods_fault=True) == (0.0, "s", "pod")
    assert FREE.weight(outcome(200, kind="upstream_error"), pods_fault=True).cause == "pod"
    assert FREE.weight(outcome(400), pods_fault=True).weight == 0.3  # a 4xx is still a mistake


def test_no_single_request_trips_a_closed_breaker() -> None:
    for name, tier in BUILTIN_TIERS.items():
        spec = tier.breaker
        assert spec is not None
        for weight, score, cause in [
            (w, "m" if k.startswith("4") else "s", k) for k, w in spec.weights.items()
        ] + [(spec.weights["500"], "s", "stream")]:
            assert Model(spec).feed(0, [(weight, score, cause)]) == [], (name, cause)
    # ... nor may a tier's configuration let one.
    for bad in (
        {"threshold": 1, "cooldown_s": 1, "cooldown_max_s": 5},  # 500 weighs 1.0
        {"threshold": 2, "mistakes_threshold": 0.5, "cooldown_s": 1, "cooldown_max_s": 5},
        {"threshold": 2, "cooldown_s": 1, "cooldown_max_s": 5, "weights": {"502": 3}},
    ):
        with pytest.raises(ConfigError, match="one request would trip it"):
            validate(TierTable, {"tiers": {"x": {"breaker": bad}}}, "limits.yaml")


@pytest.mark.parametrize(("tier", "burst"), [("free", 20), ("standard", 30), ("platinum", 40)])
def test_mistakes_trip_on_their_own_threshold_not_a_handful(tier: str, burst: int) -> None:
    """A pod's 400s (0.3 each): a misconfigured app's handful leaves the tenant served; a burst
    of `burst` trips it. Mistakes and failures do not add up."""
    spec = BUILTIN_TIERS[tier].breaker
    assert spec is not None
    mistake = (0.3, "m", "400")
    m = Model(spec)
    assert m.feed(0, [mistake] * (burst - 1)) == []
    assert m.feed(0, [(1.0, "s", "500")] * (round(spec.threshold) - 1)) == []
    assert m.feed(0, [mistake]) == [f"trip 0 400 {int(spec.cooldown_s * S)} 0 0"]


def test_a_custom_tier_sets_its_own_breaker_and_bad_ones_are_refused() -> None:
    table = validate(
        TierTable,
        {
            "tiers": {
                "gold": {
                    "breaker": {"threshold": 5, "cooldown_s": 1, "cooldown_max_s": 4},
                },
                "plain": {},
            }
        },
        "limits.yaml",
    )
    gold = table.tier("gold").breaker
    assert gold is not None and gold.threshold == 5 and gold.weights["503"] == 1.2
    assert table.tier("plain").breaker is None  # a tier states its own: none is none
    for bad in (
        {"threshold": 2, "cooldown_s": 10, "cooldown_max_s": 5},
        {"threshold": 2, "cooldown_s": 1, "cooldown_max_s": 5, "steps": [0.5, 0]},
        {"threshold": 2, "cooldown_s": 1, "cooldown_max_s": 5, "weights": {"5xxx": 1}},
        {"cooldown_s": 1, "cooldown_max_s": 5},
    ):
        with pytest.raises(ConfigError, match="breaker"):
            validate(TierTable, {"tiers": {"x": {"breaker": bad}}}, "limits.yaml")
    assert isinstance(gold, BreakerSpec)
