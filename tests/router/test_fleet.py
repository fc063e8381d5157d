"""The datastore: staleness, pod health from replies, requests in flight."""

from __future__ import annotations

import pytest

from router.fleet import Fleet, FleetSettings
from router.types import PodMetrics
from tests.router.conftest import Clock


def test_staleness_counts_as_fully_loaded() -> None:
    clock = Clock()
    fleet = Fleet(FleetSettings(stale_after=0.5, capacity=10), clock=clock)
    fleet.set_pods(["a:1"])
    fleet.snapshots["a:1"] = PodMetrics("a:1", clock.now, ok=True, running=1, kv_usage=0.1)
    fresh = fleet.candidates()[0]
    assert fresh.fresh and fresh.load == pytest.approx(0.1) and fresh.kv == 0.1
    clock.now += 0.6
    stale = fleet.candidates()[0]
    assert stale.healthy and not stale.fresh
    assert (stale.kv, stale.queue, stale.load) == (1.0, 10, 1.0)
    assert not fleet.snapshots["a:1"].fresh(0.5, clock.now)


def test_error_replies_take_a_pod_out_for_the_cooldown() -> None:
    clock = Clock()
    fleet = Fleet(FleetSettings(error_threshold=3, error_cooldown=2.0), clock=clock)
    fleet.set_pods(["a:1"])
    fleet.snapshots["a:1"] = PodMetrics("a:1", clock.now, ok=True)
    for status in (503, 502, 200, 500, 500):  # a success resets the streak
        fleet.report("a:1", status)
    assert fleet.candidates()[0].healthy
    fleet.report("a:1", 503)
    assert not fleet.candidates()[0].healthy
    clock.now += 2.1
    assert fleet.candidates()[0].healthy


def test_a_pod_failing_again_stays_out_longer_until_it_answers_well() -> None:
    clock = Clock()
    fleet = Fleet(FleetSettings(error_threshold=1, error_cooldown=1.0), clock=clock)
    fleet.set_pods(["a:1"])
    fleet.snapshots["a:1"] = PodMetrics("a:1", clock.now, ok=True)
    for cooldown in (1.0, 2.0, 4.0):
        fleet.report("a:1", 503)
        clock.now += cooldown - 0.1
        assert not fleet.candidates()[0].healthy
        clock.now += 0.2
        assert fleet.candidates()[0].healthy
    fleet.report("a:1", 200)
    fleet.report("a:1", 503)
    clock.now += 1.1
    assert fleet.candidates()[0].healthy  # back to the base cooldown


def test_late_failures_of_a_pod_already_out_do_not_lengthen_its_penalty() -> None:
    """Outcomes arrive batched, after the fact: the picks that were in flight when the pod died
    all fail, but they are one incident, not many."""
    clock = Clock()
    fleet = Fleet(FleetSettings(error_threshold=1, error_cooldown=1.0), clock=clock)
    fleet.set_pods(["a:1"])
    fleet.snapshots["a:1"] = PodMetrics("a:1", clock.now, ok=True)
    for _ in range(40):  # forty picks in flight when it died
        fleet.report("a:1", 503)
    clock.now += 1.1
    assert fleet.candidates()[0].healthy  # one base cooldown, not 2**40 of them


def test_in_flight_counts_follow_acquire_and_release() -> None:
    fleet = Fleet(FleetSettings())
    fleet.set_pods(["a:1"])
    fleet.acquire("a:1")
    fleet.acquire("a:1")
    fleet.release("a:1")
    fleet.release("a:1")
    fleet.release("a:1")  # never below zero
    fleet.acquire("gone:1")  # unknown pods are ignored
    assert fleet.in_flight == {"a:1": 0}


def test_after_a_cooldown_a_pod_gets_one_probe_until_it_answers() -> None:
    clock = Clock()
    fleet = Fleet(FleetSettings(error_threshold=3, error_cooldown=1.0), clock=clock)
    fleet.set_pods(["a:1"])
    fleet.snapshots["a:1"] = PodMetrics("a:1", clock.now, ok=True)
    for _ in range(3):
        fleet.report("a:1", 503)
    clock.now += 1.1  # the cooldown is over: on probation
    assert fleet.pickable("a:1", clock.now)
    fleet.acquire("a:1", "probe")
    assert not fleet.pickable("a:1", clock.now)  # its answer is on its way
    fleet.finish("probe")
    fleet.report("a:1", 503)  # one failed probe is enough to take it out again
    assert not fleet.pickable("a:1", clock.now)
    clock.now += 2.1  # twice the cooldown
    fleet.acquire("a:1", "lost")  # a probe whose outcome never comes …
    clock.now += 1.1
    assert fleet.pickable("a:1", clock.now)  # … lets another one through after a cooldown
    fleet.report("a:1", 200)
    fleet.finish("lost")
    fleet.acquire("a:1", "x")
    assert fleet.pickable("a:1", clock.now)  # answered well: no probation


def test_the_served_models_are_every_pods_list_once_all_are_known() -> None:
    fleet = Fleet(FleetSettings())
    assert fleet.served_models() is None  # no pod
    fleet.set_pods(["a:1", "b:1"])
    fleet.store(PodMetrics("a:1", 0, ok=True, models=frozenset({"m1"})))
    assert fleet.served_models() is None  # b's list not read yet: b could serve anything
    fleet.store(PodMetrics("b:1", 0, ok=True, models=frozenset({"m2", "lora"})))
    assert fleet.served_models() == {"m1", "m2", "lora"}
    fleet.store(PodMetrics("b:1", 1, ok=False, models=frozenset({"m2"})))  # a failed scrape
    assert fleet.served_models() == {"m1", "m2"}
    fleet.set_pods(["a:1"])
    assert fleet.served_models() == {"m1"}
    fleet.set_pods(["a:1", "c:1"])
    assert fleet.served_models() is None
