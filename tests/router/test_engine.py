"""The engine: contracts enforced, no pod left, hot-spot avoidance through in-flight counts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from prometheus_client import REGISTRY

from router.engine import TIMED_EVERY, Engine, NoPod
from router.fleet import Fleet, FleetSettings
from router.registry import DEFAULT_PLUGINS, DEFAULT_PROFILE, Profile, default_registry
from router.types import Candidate, PickRequest, PodMetrics
from tests.router.conftest import Clock, cand


class Wild:
    name = "wild"

    def score(self, req: PickRequest, cands: list[Candidate]) -> Sequence[float]:
        return [5.0, -3.0]


class Spy:
    name = "spy"

    def __init__(self) -> None:
        self.seen: list[list[float]] = []

    def pick(self, cands: list[Candidate], scores: list[float]) -> tuple[list[Candidate], bool]:
        self.seen.append(scores)
        return cands, False


def default_engine() -> Engine:
    return Engine(default_registry().build(DEFAULT_PLUGINS, DEFAULT_PROFILE))


def test_scores_are_clamped_and_weighted() -> None:
    spy = Spy()
    engine = Engine(Profile(filters=(), scorers=((Wild(), 2.0),), picker=spy))
    engine.pick(PickRequest(), [cand("a"), cand("b")])
    assert spy.seen == [[2.0, 0.0]]


def test_no_pod_names_the_stage_and_every_plugin_is_timed() -> None:
    engine = default_engine()
    assert engine.pick(PickRequest(), []) == NoPod("fleet")
    assert engine.pick(PickRequest(), [cand("a", healthy=False)]) == NoPod("healthy")
    assert engine.pick(PickRequest(model="x"), [cand("a", models=frozenset({"y"}))]) == NoPod(
        "serves-model"
    )
    pick = engine.pick(PickRequest(), [cand("a")])
    assert not isinstance(pick, NoPod) and pick.pods == ("a",)


def test_every_plugin_is_timed_in_one_pick_of_timed_every() -> None:
    def counts() -> list[float]:
        return [
            REGISTRY.get_sample_value("llmgw_router_plugin_seconds_count", {"plugin": p}) or 0.0
            for p in ("healthy", "kv", "session", "pick")
        ]

    engine = default_engine()
    before = counts()
    for _ in range(3 * TIMED_EVERY):
        assert not isinstance(engine.pick(PickRequest(), [cand("a"), cand("b")]), NoPod)
    assert [after - b for after, b in zip(counts(), before, strict=True)] == [3.0] * 4


def test_answer_is_an_ordered_list_without_unhealthy_pods() -> None:
    engine = default_engine()
    pick = engine.pick(
        PickRequest(),
        [cand("busy", running=8, kv=0.7), cand("down", healthy=False), cand("idle")],
    )
    assert not isinstance(pick, NoPod)
    assert pick.pods == ("idle", "busy")


def test_burst_on_a_frozen_view_spreads_over_pods() -> None:
    """Herding guard: 40 picks while the scraped metrics do not change (all pods look idle)."""
    clock = Clock()
    fleet = Fleet(FleetSettings(capacity=10), clock=clock)
    names = [f"10.0.0.{i}:8000" for i in range(4)]
    fleet.set_pods(names)
    for name in names:
        fleet.snapshots[name] = PodMetrics(name, clock.now, ok=True)
    engine = default_engine()
    per_pod: Counter[str] = Counter()
    for _ in range(40):
        pick = engine.pick(PickRequest(), fleet.candidates())
        assert not isinstance(pick, NoPod)
        fleet.acquire(pick.pods[0])
        per_pod[pick.pods[0]] += 1
    assert set(per_pod) == set(names)
    assert max(per_pod.values()) <= 12  # fair share is 10


def test_hot_prefix_spills_over_instead_of_piling_on_one_pod() -> None:
    """Every request shares one long prefix; affinity must yield once its pod is loaded."""
    clock = Clock()
    fleet = Fleet(FleetSettings(capacity=10), clock=clock)
    names = [f"10.0.0.{i}:8000" for i in range(4)]
    fleet.set_pods(names)
    for name in names:
        fleet.snapshots[name] = PodMetrics(name, clock.now, ok=True)
    engine = default_engine()
    req = PickRequest(prefix_blocks=tuple(range(1, 40)))
    per_pod: Counter[str] = Counter()
    for _ in range(30):
        pick = engine.pick(req, fleet.candidates())
        assert not isinstance(pick, NoPod)
        fleet.acquire(pick.pods[0])
        per_pod[pick.pods[0]] += 1
    assert len(per_pod) >= 3
    assert max(per_pod.values()) <= 12


def test_stale_pods_are_avoided() -> None:
    clock = Clock()
    fleet = Fleet(FleetSettings(stale_after=0.5), clock=clock)
    fleet.set_pods(["a:1", "b:1"])
    fleet.snapshots["a:1"] = PodMetrics("a:1", clock.now - 5, ok=True)
    fleet.snapshots["b:1"] = PodMetrics("b:1", clock.now, ok=True, running=20, kv_usage=0.8)
    engine = default_engine()
    for _ in range(10):
        pick = engine.pick(PickRequest(), fleet.candidates())
        assert not isinstance(pick, NoPod) and pick.pods[0] == "b:1"


def test_a_half_speed_pod_gets_about_half_the_work() -> None:
    """Distinct long prompts, each homed by speed-weighted rendezvous: 1 : 1 : 1 : 0.5."""
    clock = Clock()
    fleet = Fleet(FleetSettings(capacity=32), clock=clock)
    names = [f"10.0.0.{i}:8000" for i in range(4)]
    fleet.set_pods(names)
    for name in names:
        fleet.snapshots[name] = PodMetrics(name, clock.now, ok=True)
    fleet.speeds.current = {names[3]: 0.5}
    engine = default_engine()
    per_pod: Counter[str] = Counter()
    for n in range(1400):
        req = PickRequest(prefix_blocks=(n + 1,), prompt_tokens=3000, first_turn=True)
        pick = engine.pick(req, fleet.candidates())
        assert not isinstance(pick, NoPod)
        per_pod[pick.pods[0]] += 1
    fast = [per_pod[n] for n in names[:3]]
    assert 0.4 < per_pod[names[3]] / (sum(fast) / 3) < 0.6
