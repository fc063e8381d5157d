"""Whose fault a pod's failure is (ledger/blame.py), on a given clock."""

from __future__ import annotations

from datetime import UTC, datetime

from ledger.blame import Blame, BlameSettings
from llmgw.outcome import Outcome


def failed(tenant: str, pod: str = "10.0.0.1:8000", status: int = 500) -> Outcome:
    return Outcome(
        request_id=f"{tenant}-{pod}",
        ts=datetime.now(UTC),
        tenant=tenant,
        pod=pod,
        status=status,
        outcome="upstream_error" if status >= 500 else "ok",
    )


def test_three_tenants_failed_by_one_pod_within_the_window_make_it_the_pods_fault() -> None:
    blame = Blame(BlameSettings(tenants=3, window_s=10))
    assert blame.judge(0, [failed("a"), failed("a")]) == [False, False]  # one tenant: its own
    assert blame.judge(1, [failed("b")]) == [False]
    # The third tenant: the pod's, and the first two's next failures too.
    assert blame.judge(2, [failed("c"), failed("a"), failed("b", "10.0.0.2:8000")]) == [
        True,
        True,
        False,  # another pod
    ]
    # Outcomes that are no pod's failure are never the pod's.
    assert blame.judge(3, [failed("d", status=200), failed("e", pod="")]) == [False, False]


def test_a_storm_in_one_batch_is_the_pods_from_its_first_outcome() -> None:
    blame = Blame(BlameSettings())
    assert blame.judge(0, [failed("a"), failed("b"), failed("c")]) == [True] * 3


def test_failures_older_than_the_window_are_forgotten() -> None:
    blame = Blame(BlameSettings(tenants=3, window_s=10))
    blame.judge(0, [failed("a"), failed("b")])
    assert blame.judge(10.5, [failed("c")]) == [False]  # a and b were 10.5 s ago
    assert blame.judge(11, [failed("a"), failed("b")]) == [True, True]
    blame.judge(30, [])
    assert blame._failed == {}  # nothing kept for a quiet pod
