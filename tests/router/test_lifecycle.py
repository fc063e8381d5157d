"""The pick's lifecycle (router/lifecycle.py) as the adapters drive it without a request ID:
the InferencePool picker, which sees its own picks end (the access-log path, by request ID, is
tested through gRPC in test_service.py)."""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from router.engine import Engine
from router.fleet import Fleet, FleetSettings
from router.lifecycle import Lifecycle
from router.registry import DEFAULT_PLUGINS, DEFAULT_PROFILE, default_registry
from router.types import PickRequest, PodMetrics

PODS = ["10.0.0.1:8000", "10.0.0.2:8000"]


def lifecycle(**settings: Any) -> Lifecycle:
    fleet = Fleet(FleetSettings(capacity=10, stale_after=60, **settings))
    fleet.set_pods(PODS)
    for pod in PODS:
        fleet.snapshots[pod] = PodMetrics(pod, fleet.clock(), ok=True)
    engine = Engine(default_registry().build(DEFAULT_PLUGINS, DEFAULT_PROFILE))
    return Lifecycle(fleet, engine, trace.get_tracer("test"))


def test_a_gateways_subset_bounds_the_choice() -> None:
    life = lifecycle()
    for pod in PODS:
        chosen = life.choose(PickRequest(), subset=frozenset({pod}))
        assert chosen is not None and chosen.pods == (pod,)
    assert life.choose(PickRequest(), subset=frozenset({"10.9.9.9:8000"})) is None
    assert life.choose(PickRequest(), subset=frozenset()) is None
    assert life.fleet.in_flight == dict.fromkeys(PODS, 1)


def test_a_pick_the_adapter_saw_end_is_released_and_judged_by_its_reply() -> None:
    life = lifecycle(error_threshold=1)
    fleet = life.fleet
    chosen = life.pick(PickRequest())
    assert chosen is not None
    first = chosen.pods[0]
    (other,) = [p for p in PODS if p != first]
    assert fleet.in_flight[first] == 1
    life.ended(None, other, 200, first)  # the gateway went down the list: the first failed
    assert fleet.in_flight[first] == 0
    assert not fleet.pickable(first, fleet.clock()) and fleet.pickable(other, fleet.clock())
    chosen = life.pick(PickRequest())
    assert chosen is not None and chosen.pods[0] == other
    life.ended(None, None, 0, other)  # the stream ended before any reply: nothing to judge
    assert fleet.in_flight[other] == 0 and fleet.pickable(other, fleet.clock())
    life.pick(PickRequest())
    life.ended(None, other, 503, other)  # its own 5xx
    assert fleet.in_flight[other] == 0 and not fleet.pickable(other, fleet.clock())
