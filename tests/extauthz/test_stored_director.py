"""A stored response's requests in the director: pinned to the pod its ID names, a follow-up
through flow control like any generation, a read not queued, a stored response named at the
pick (extauthz/director.py, with a real pick lifecycle and flow control)."""

from __future__ import annotations

import json
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider

from extauthz.director import Director
from extauthz.flow import FlowControl
from extauthz.responseids import Kept
from extauthz.settings import FlowSettings
from extauthz.store import tenants_store
from llmgw import wire
from router.engine import Engine
from router.fleet import Fleet, FleetSettings
from router.registry import DEFAULT_PLUGINS, DEFAULT_PROFILE, default_registry
from router.runtime import Router
from router.types import PodMetrics
from tests.extauthz.conftest import Keys, make_decider

PODS = ("10.0.0.1:8000", "10.0.0.2:8000")
MODEL = "llama-3-8b"


def director(tenants_file: Path, tiers_file: Path, busy: bool = True) -> Director:
    """Two pods of one seat each (`busy`: both taken, the fleet saturated; else of 8 each)."""
    fleet = Fleet(FleetSettings(capacity=1 if busy else 8, stale_after=60, dispatch_lag=0.0))
    fleet.set_pods(PODS)
    for pod in PODS:
        fleet.store(PodMetrics(pod, fleet.clock(), ok=True, models=frozenset({MODEL})))
        if busy:
            fleet.acquire(pod, f"busy-{pod}")
    engine = Engine(default_registry().build(DEFAULT_PLUGINS, DEFAULT_PROFILE))
    router = Router(fleet, engine, TracerProvider().get_tracer("t"))
    flow = FlowControl(FlowSettings(max_wait_s=0.3), router)
    decider = make_decider(responses_store=True, max_model_len={MODEL: 8192})
    store = tenants_store(tenants_file, tiers_file)
    return Director(store, decider, TracerProvider().get_tracer("t"), router=router, flow=flow)


def headers(key: str, path: str, method: str = "POST") -> dict[str, str]:
    return {":path": path, ":method": method, "authorization": f"Bearer {key}"}


async def test_a_follow_up_waits_its_turn_and_a_read_goes_at_once(
    tenants_file: Path, tiers_file: Path, keys: Keys
) -> None:
    """With no seat free, a follow-up queues like any generation (here until its wait runs
    out: 429 queue_timeout); reading the same response is not generation and goes at once, to
    the pod its ID names (the fleet's other pod is as busy)."""
    checks = director(tenants_file, tiers_file)
    rid = checks.decider.response_ids.mint("acme", Kept(PODS[1], 100))
    body = {"model": MODEL, "input": "and then?", "previous_response_id": rid}
    follow = await checks.check(headers(keys.acme, wire.RESPONSES_PATH), json.dumps(body).encode())
    assert follow.status == 429 and json.loads(follow.body)["error"]["code"] == "queue_timeout"
    read = await checks.check(headers(keys.acme, f"{wire.RESPONSES_PATH}/{rid}", "GET"), b"")
    assert read.allowed and read.metadata[wire.DESTINATION_ENDPOINT] == PODS[1]


async def test_a_stored_response_is_named_after_the_pod_it_goes_to(
    tenants_file: Path, tiers_file: Path, keys: Keys
) -> None:
    """The body's members, appended by Envoy, end with the ID naming the pod chosen (and the
    bound of the conversation kept there); its follow-up goes to that pod, whichever is freer."""
    checks = director(tenants_file, tiers_file, busy=False)
    assert checks.router is not None
    body = json.dumps({"model": MODEL, "input": "hello", "max_output_tokens": 7}).encode()
    answer = await checks.check(headers(keys.acme, wire.RESPONSES_PATH), body)
    assert answer.allowed
    pod = str(answer.metadata[wire.DESTINATION_ENDPOINT]).split(",")[0]
    suffix = json.loads("{" + str(answer.metadata[wire.META_BODY_SUFFIX]).lstrip(",") + "}")
    assert suffix["store"] is True
    kept = checks.decider.response_ids.kept("acme", suffix["request_id"])
    assert kept is not None and kept.pod == pod and kept.tokens >= 7
    for n in range(4):  # the other pod is now the freer one
        checks.router.fleet.acquire(pod, f"now-busy-{n}")
    follow = {"model": MODEL, "input": "go on", "previous_response_id": suffix["request_id"]}
    again = await checks.check(headers(keys.acme, wire.RESPONSES_PATH), json.dumps(follow).encode())
    assert again.allowed and again.metadata[wire.DESTINATION_ENDPOINT] == pod
