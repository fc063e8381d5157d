"""Flow control's rules (extauthz/flow.py, extauthz/queue.py, router/saturation.py) over a real
fleet datastore and pick lifecycle, with scrapes written by hand: seats, the dispatch order
(bands by weight, least-served tenant within a band), headroom, deadlines, bounds, a client
leaving. Through real Envoy: tests/e2e/test_flow_e2e.py."""

from __future__ import annotations

import asyncio
from collections import Counter
from functools import partial
from typing import Any

import pytest
from opentelemetry import trace

from extauthz.flow import FlowControl, Refused
from extauthz.queue import ModelQueue, Waiter
from extauthz.settings import FlowSettings
from router.engine import Engine
from router.fleet import Fleet, FleetSettings
from router.lifecycle import Lifecycle
from router.registry import DEFAULT_PLUGINS, DEFAULT_PROFILE, default_registry
from router.saturation import Bounds, seats
from router.types import PickRequest, PodId, PodMetrics

POD = "10.0.0.1:8000"
MODEL = "m"


def lifecycle(capacity: float = 4, pods: tuple[str, ...] = (POD,)) -> Lifecycle:
    fleet = Fleet(FleetSettings(capacity=capacity, stale_after=60, dispatch_lag=0.0))
    fleet.set_pods(pods)
    for pod in pods:
        fleet.store(PodMetrics(pod, fleet.clock(), ok=True, models=frozenset({MODEL})))
    engine = Engine(default_registry().build(DEFAULT_PLUGINS, DEFAULT_PROFILE))
    return Lifecycle(fleet, engine, trace.get_tracer("test"))


def scrape(router: Lifecycle, running: int, waiting: int = 0, pod: str = POD, **kw: Any) -> None:
    """A scrape taken now: it shows every pick made before it."""
    router.fleet.store(
        PodMetrics(
            pod,
            router.fleet.clock() + 1e-6,
            ok=True,
            running=running,
            waiting=waiting,
            models=frozenset({MODEL}),
            **kw,
        )
    )


class Client:
    """Requests as the director sends them: each dispatch picks, and is recorded in order."""

    def __init__(self, router: Lifecycle, flow: FlowControl) -> None:
        self.router, self.flow = router, flow
        self.order: list[str] = []
        self.ids = 0

    def waiter(self, tenant: str, band: int = 5, tokens: int = 100, body: int = 10) -> Waiter:
        self.ids += 1
        rid = f"{tenant}-{self.ids}"

        def pick(free: frozenset[PodId]) -> None:
            if not free:  # no pod usable: the director's pick is the router's or Envoy's
                self.order.append(tenant)
                return
            req = PickRequest(model=MODEL, tenant=tenant, request_id=rid)
            chosen = self.router.choose(req, subset=free)
            assert chosen is not None and chosen.pods[0] in free
            self.router.hold(req, chosen)
            self.order.append(tenant)

        return Waiter(tenant, band, tokens, body, self.flow.clock(), pick, rid)

    def send(self, w: Waiter, deadline: float = 30.0) -> asyncio.Task[Refused | float]:
        return asyncio.get_running_loop().create_task(self.flow.wait(w, MODEL, deadline))


def free_pods(flow: FlowControl, tenant: str) -> frozenset[PodId] | None:
    free = flow.free_for(MODEL, tenant)
    return None if free is None else free.pods


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_seats_count_running_waiting_and_picks_the_scrape_cannot_show() -> None:
    router = lifecycle(capacity=4)
    scrape(router, running=2)
    assert seats(router.fleet, Bounds(), MODEL).free == {POD: 2}
    router.fleet.acquire(POD, "r1")  # made after the scrape: not in its counts
    assert seats(router.fleet, Bounds(), MODEL).free == {POD: 1}
    scrape(router, running=3)  # the next scrape shows it
    assert seats(router.fleet, Bounds(), MODEL).free == {POD: 1}
    scrape(router, running=1, waiting=1)  # anything waiting at queue_max 1: no seat
    assert seats(router.fleet, Bounds(queue_max=1), MODEL).free == {}
    scrape(router, running=0, kv_usage=0.96)
    assert seats(router.fleet, Bounds(), MODEL).free == {}
    assert seats(router.fleet, Bounds(), "another-model").free == {}


def test_a_scrape_that_shows_arrivals_sees_the_picks_made_before_it() -> None:
    """Picks count on top of the scrapes until one shows them: by the pod's counts (running +
    waiting grew, plus what finished), not only by `dispatch_lag`, here too long to matter."""
    router = lifecycle(capacity=4)
    router.fleet.settings = router.fleet.settings.model_copy(update={"dispatch_lag": 60.0})
    scrape(router, running=2, requests_served=10)
    router.fleet.acquire(POD, "r1")
    router.fleet.acquire(POD, "r2")
    scrape(router, running=2, requests_served=10)  # not there yet: still counted
    assert seats(router.fleet, Bounds(), MODEL).free == {}
    scrape(router, running=3, requests_served=11)  # both arrived, and one request finished
    assert seats(router.fleet, Bounds(), MODEL).free == {POD: 1}
    router.fleet.acquire(POD, "r3")  # made after that scrape: counted until one shows it
    assert seats(router.fleet, Bounds(), MODEL).free == {}


def test_a_late_scrape_is_unknown_not_saturated_and_bounded_by_its_seats() -> None:
    router = lifecycle(capacity=3)
    scrape(router, running=3)
    assert seats(router.fleet, Bounds(), MODEL).free == {}
    router.fleet.settings = router.fleet.settings.model_copy(update={"stale_after": 0.0})
    # Late: counted free, less the picks made since its last scrape.
    assert seats(router.fleet, Bounds(), MODEL).free == {POD: 3}
    router.fleet.acquire(POD, "r1")
    router.fleet.acquire(POD, "r2")
    assert seats(router.fleet, Bounds(), MODEL).free == {POD: 1}


async def test_a_request_goes_at_once_while_a_seat_is_free_and_waits_when_none_is() -> None:
    router = lifecycle(capacity=2)
    flow = FlowControl(FlowSettings(), router)
    free = flow.free_for(MODEL, "a")
    assert free is not None and free.pods == {POD}
    scrape(router, running=2)
    assert flow.free_for(MODEL, "a") is None
    client = Client(router, flow)
    task = client.send(client.waiter("a"))
    await settle()
    assert not task.done() and flow.length == 1
    assert flow.free_for(MODEL, "b") is None  # someone waits: nobody jumps the queue
    scrape(router, running=1)  # a stream ended: the scrape frees a seat, the waiter goes
    waited = await asyncio.wait_for(task, 5)
    assert isinstance(waited, float) and client.order == ["a"] and flow.length == 0
    assert router.fleet.in_flight[POD] == 1


def test_a_dispatch_asks_for_its_outcome_at_once_only_once_seats_may_run_out() -> None:
    """Half of a model's seats taken, this dispatch's included (outcome_soon_from), on: its
    outcome is wanted at once (Envoy's 20 ms router log); below, batched (0.2 s)."""
    router = lifecycle(capacity=4, pods=(POD, "10.0.0.2:8000"))  # 8 seats
    flow = FlowControl(FlowSettings(headroom=0), router)
    soon = []
    for running in range(5):
        scrape(router, running=running)  # the other pod idle
        free = flow.free_for(MODEL, "a")
        assert free is not None
        soon.append(free.soon)
    assert soon == [False, False, False, True, True]  # 1, 2, 3 of 8 taken; then 4, 5
    fractional = lifecycle(capacity=1.5, pods=(POD, "10.0.0.2:8000", "10.0.0.3:8000"))
    assert seats(fractional.fleet, Bounds(), MODEL).total == 3  # whole seats: one a pod
    free = FlowControl(FlowSettings(headroom=0), fractional).free_for(MODEL, "a")
    assert free is not None and not free.soon  # 1 of 3 taken: an idle fleet stays batched
    always = FlowControl(FlowSettings(headroom=0, outcome_soon_from=0), router)
    scrape(router, running=0)
    free = always.free_for(MODEL, "a")
    assert free is not None and free.soon


async def test_bands_share_dispatches_by_weight_and_none_starves() -> None:
    router = lifecycle(capacity=1)
    flow = FlowControl(FlowSettings(band_weights={9: 3.0, 2: 1.0}, headroom=0), router)
    client = Client(router, flow)
    scrape(router, running=1)
    tasks = [client.send(client.waiter(f"low{i}", band=2)) for i in range(8)]
    tasks += [client.send(client.waiter(f"high{i}", band=9)) for i in range(8)]
    await settle()
    for _ in range(8):  # a seat frees eight times
        scrape(router, running=0)
        await settle()
        scrape(router, running=1)
    bands = ["high" if t.startswith("high") else "low" for t in client.order]
    assert Counter(bands) == {"high": 6, "low": 2}, bands  # 3:1, the low band served
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert flow.length == 0


async def test_within_a_band_the_least_served_tenant_goes_next_by_tokens_not_requests() -> None:
    router = lifecycle(capacity=1)
    flow = FlowControl(FlowSettings(headroom=0), router)
    client = Client(router, flow)
    scrape(router, running=1)
    # Both backlogged; "long" sends prompts ten times larger.
    tasks = [client.send(client.waiter("long", tokens=1000)) for _ in range(12)]
    tasks += [client.send(client.waiter("short", tokens=100)) for _ in range(12)]
    await settle()
    for _ in range(11):
        scrape(router, running=0)
        await settle()
        scrape(router, running=1)
    counts = Counter(client.order)
    assert counts["short"] == 10 and counts["long"] == 1, client.order  # equal tokens served
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_the_last_seats_are_kept_for_tenants_below_their_fair_share() -> None:
    router = lifecycle(capacity=10)
    flow = FlowControl(FlowSettings(headroom=0.2), router)

    def dispatch(tenant: str, rid: str) -> None:
        assert flow.free_for(MODEL, tenant) is not None
        router.fleet.acquire(POD, rid)
        flow.dispatched(MODEL, 5, tenant, rid, 100)

    for i in range(10):  # alone, a tenant may take every seat
        dispatch("flood", f"f{i}")
    for i in range(10):
        flow.ended(f"f{i}")
    scrape(router, running=0)
    dispatch("light", "l0")
    for i in range(7):
        dispatch("flood", f"g{i}")
    # 2 seats left, the headroom (20 % of 10): not for the flood, above its half share...
    assert flow.free_for(MODEL, "flood") is None
    assert free_pods(flow, "light") == {POD}  # ... for those below theirs
    assert free_pods(flow, "newcomer") == {POD}
    for i in range(3):
        flow.ended(f"g{i}")
    assert flow.free_for(MODEL, "flood") is not None  # its outcomes: 4 held, below half


async def test_the_last_seats_go_by_service_too_so_smaller_requests_get_more_seats() -> None:
    """Both backlogged, each holding half the seats: the tenant whose requests are ten times
    smaller has received a tenth of the tokens, so the seats that free in the headroom go to it
    (by seats alone, half each, it could never take one)."""
    router = lifecycle(capacity=10)
    flow = FlowControl(FlowSettings(headroom=0.2), router)
    client = Client(router, flow)
    for i in range(5):
        for tenant, tokens in (("long", 1000), ("short", 100)):
            router.fleet.acquire(POD, f"{tenant}{i}")
            flow.dispatched(MODEL, 5, tenant, f"{tenant}{i}", tokens)
    scrape(router, running=10)
    tasks = [client.send(client.waiter("long", tokens=1000)) for _ in range(3)]
    tasks += [client.send(client.waiter("short", tokens=100)) for _ in range(3)]
    await settle()
    for i in range(3):  # one of long's streams ends: the one seat free is in the headroom
        flow.ended(f"long{i}")
        router.fleet.finish(f"long{i}")
        scrape(router, running=9)
        await settle()
        scrape(router, running=10)
    assert client.order == ["short"] * 3
    assert flow.holds.of(MODEL, "short") == 8 > flow.holds.of(MODEL, "long")
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_request_past_its_deadline_is_refused_and_leaves_the_queue() -> None:
    router = lifecycle(capacity=1)
    flow = FlowControl(FlowSettings(), router)
    client = Client(router, flow)
    scrape(router, running=1)
    refused = await client.send(client.waiter("a"), deadline=0.05)
    assert isinstance(refused, Refused) and refused.code == "queue_timeout"
    assert refused.retry_after_s >= 1 and flow.length == 0 and flow.bytes == 0


async def test_a_full_queue_refuses_at_once_per_tenant_and_in_bytes() -> None:
    router = lifecycle(capacity=1)
    settings = FlowSettings(tenant_max_queued=2, max_queued_bytes=1000)
    flow = FlowControl(settings, router)
    client = Client(router, flow)
    scrape(router, running=1)
    tasks = [client.send(client.waiter("a")) for _ in range(2)]
    await settle()
    third = await client.send(client.waiter("a"))
    assert isinstance(third, Refused) and third.code == "queue_full"
    big = await client.send(client.waiter("b", body=995))  # 20 + 995 > 1000
    assert isinstance(big, Refused) and big.code == "queue_full"
    other = client.send(client.waiter("b"))  # another tenant still fits
    await settle()
    assert not other.done() and flow.length == 3
    for t in [*tasks, other]:
        t.cancel()
    await asyncio.gather(*tasks, other, return_exceptions=True)
    assert (flow.length, flow.bytes, flow.tenant_length) == (0, 0, {})


async def test_a_client_that_leaves_leaves_the_queue_and_the_next_goes() -> None:
    router = lifecycle(capacity=1)
    flow = FlowControl(FlowSettings(), router)
    client = Client(router, flow)
    scrape(router, running=1)
    first = client.send(client.waiter("gone"))
    second = client.send(client.waiter("stays"))
    await settle()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert flow.length == 1
    scrape(router, running=0)
    assert isinstance(await asyncio.wait_for(second, 5), float)
    assert client.order == ["stays"]


async def test_an_outcome_frees_a_hold_and_wakes_the_queue() -> None:
    router = lifecycle(capacity=1)
    flow = FlowControl(FlowSettings(), router)
    client = Client(router, flow)
    scrape(router, running=0)
    first = client.send(client.waiter("a"))  # nobody waits: the pump dispatches it at once
    assert isinstance(await asyncio.wait_for(first, 5), float)
    assert flow.holds.of(MODEL, "a") == 1
    router.ended("a-1", POD, 200)  # the access log: it ended
    assert flow.holds.of(MODEL, "a") == 0


async def test_an_outcome_frees_its_seat_before_the_next_scrape_shows_it() -> None:
    router = lifecycle(capacity=1)
    lag = router.fleet.settings.outcome_lag
    flow = FlowControl(FlowSettings(), router)
    client = Client(router, flow)
    for tenant in "ab":
        first = client.send(client.waiter(tenant))
        assert isinstance(await asyncio.wait_for(first, 5), float)
        scrape(router, running=1)  # it runs
        after = client.waiter("next")
        waiting = client.send(after)
        await settle()
        assert not waiting.done()
        if tenant == "a":  # its outcome just after a scrape, which may have shown its end
            router.ended("a-1", POD, 200)
            await settle()
            assert not waiting.done()  # no seat until the next scrape
            scrape(router, running=0)
        else:  # its outcome later than any scrape that started before its end
            router.fleet.clock = partial(float, router.fleet.clock() + lag + 0.01)
            router.ended("b-3", POD, 200)
        assert isinstance(await asyncio.wait_for(waiting, 5), float)
        assert flow.free_for(MODEL, "c") is None  # the waiter took the seat
        assert after.request_id is not None
        router.ended(after.request_id, POD, 200)  # and is done
        scrape(router, running=0)
    assert client.order == ["a", "next", "b", "next"]


async def test_an_outcome_that_says_when_it_ended_frees_its_seat_unless_a_scrape_showed_it() -> (
    None
):
    router = lifecycle(capacity=1)
    flow = FlowControl(FlowSettings(), router)
    client = Client(router, flow)
    first = client.send(client.waiter("a"))
    assert isinstance(await asyncio.wait_for(first, 5), float)
    ended = router.fleet.clock()  # a's last byte left the pod
    scrape(router, running=0)  # a scrape that started after: it shows the seat free
    second = client.send(client.waiter("b"))
    assert isinstance(await asyncio.wait_for(second, 5), float)  # b took it
    late = router.fleet.clock() + router.fleet.settings.outcome_lag + 0.01
    router.fleet.clock = partial(float, late)
    router.ended("a-1", POD, 200, at=ended)  # a's outcome, late: not a second free seat
    assert flow.free_for(MODEL, "c") is None
    scrape(router, running=1)
    router.ended("b-2", POD, 200, at=late + 0.001)  # b ended after that scrape
    assert free_pods(flow, "c") == {POD}


def test_outcomes_free_at_most_a_pods_seats_between_scrapes() -> None:
    router = lifecycle(capacity=2)
    scrape(router, running=2)
    for i in range(100):  # outcomes whose scrapes never come (its /metrics broke)
        router.fleet.acquire(POD, f"r{i}")
        router.ended(f"r{i}", POD, 200, at=router.fleet.clock() + 1)
    assert router.fleet.unseen(POD) == 100 - 2
    scrape(router, running=0)
    assert seats(router.fleet, Bounds(), MODEL).free == {POD: 2}


def test_a_band_that_was_empty_cannot_claim_the_turns_it_missed() -> None:
    queue = ModelQueue(float)
    loop = asyncio.new_event_loop()
    try:

        def waiter(tenant: str, band: int) -> Waiter:
            fut: asyncio.Future[None] = loop.create_future()
            return Waiter(tenant, band, 1, 0, 0.0, lambda free: None, None, fut)

        for _ in range(20):
            queue.push(waiter("low", 1))
        for _ in range(10):
            assert queue.pop(lambda t: True, lambda t: 0.0) is not None
        for _ in range(4):
            queue.push(waiter("high", 3))
        popped = [queue.pop(lambda t: True, lambda t: 0.0) for _ in range(4)]
        tenants = [w.tenant for w in popped if w is not None]
        assert tenants.count("high") == 3  # 3:1 from now on, not 4 in a row and more
    finally:
        loop.close()


async def test_with_no_pod_usable_nothing_waits_for_one() -> None:
    """Every pod down (or erroring, in the router's health): not saturation, nothing frees a seat
    for the queue to wait for; requests go on as without flow control (Envoy's fallback)."""
    router = lifecycle(capacity=1)
    flow = FlowControl(FlowSettings(), router)
    client = Client(router, flow)
    scrape(router, running=1)
    waiting = client.send(client.waiter("a"))
    await settle()
    assert flow.length == 1
    router.fleet.store(PodMetrics(POD, router.fleet.clock() + 1e-6, ok=False))  # down
    assert isinstance(await asyncio.wait_for(waiting, 5), float)
    assert flow.length == 0 and client.order == ["a"]
    assert free_pods(flow, "b") == frozenset()
