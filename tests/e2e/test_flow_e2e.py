"""Flow control through real Envoy (extauthz/flow.py): one simulated pod of two seats (the
router's capacity, the pod's --max-num-seqs), held by streams that never end by themselves; what
arrives meanwhile waits in the gateway's queue and is served, as seats free, in the queue's
order, or refused with a clear 429 at its deadline or past its tenant's bound. Each test would
fail with flow control off: the pod would take every request at once and queue it itself."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.client import HTTPConnection

import pytest

from extauthz.types import PerMinuteLimits
from llmgw import wire
from tests.e2e.conftest import PATIENT_SCRAPES, api_key, stack_settings
from tests.e2e.test_ratelimit_e2e import MODEL, add_tenant, counter, reservations
from tests.eventually import eventually
from tools.stack import Stack

SEATS = 2
TENANT_MAX_QUEUED = 3
ROOMY = "requests: {second: 1000}, tokens: {minute: 100000000}"
TIERS = (
    "tiers:\n"
    f"  free: {{{ROOMY}}}\n"
    f"  standard: {{{ROOMY}}}\n"
    f"  platinum: {{{ROOMY}}}\n"
    f"  brief: {{{ROOMY}, queue_timeout_s: 1}}\n"
)
ENV = {
    # A scrape late on a busy machine leaves the pod unknown, not saturated: a request would
    # be dispatched past held seats (README, Flow control), not what these tests look at.
    **PATIENT_SCRAPES,
    "LLMGW_ROUTER__FLEET__CAPACITY": str(SEATS),
    "LLMGW_EXTAUTHZ__FLOW__TENANT_MAX_QUEUED": str(TENANT_MAX_QUEUED),
    # Outcomes wanted at once only from the last seat taken on (the default, half, is every
    # dispatch into two seats): a request into an idle pod has its outcome batched.
    "LLMGW_EXTAUTHZ__FLOW__OUTCOME_SOON_FROM": "1",
}


@pytest.fixture(scope="module")
def flow_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    state = tmp_path_factory.mktemp("flow-stack")
    (state / "tiers.yaml").write_text(TIERS)
    settings = stack_settings(pods=1).model_copy(
        update={
            "tiers_file": state / "tiers.yaml",
            "sim_args": ("--time-scale", "0.2", "--max-num-seqs", str(SEATS)),
        }
    )
    with contextlib.ExitStack() as running:
        with pytest.MonkeyPatch.context() as env:  # only the services started here see it
            for name, value in ENV.items():
                env.setenv(name, value)
            stack = running.enter_context(Stack(settings, state / "stack"))
        yield stack


def body(max_tokens: int, stream: bool = False) -> str:
    messages = [{"role": "user", "content": "hi"}]
    fields = {"max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    return json.dumps({"model": MODEL, "messages": messages, **fields})


def send(stack: Stack, key: str, max_tokens: int, stream: bool = False) -> HTTPConnection:
    conn = HTTPConnection(stack.listen.host, stack.listen.port, timeout=60)
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    conn.request("POST", "/v1/chat/completions", body(max_tokens, stream), headers)
    return conn


def flow_metric(stack: Stack, name: str, labels: str = "") -> float:
    """The sum of extauthz's `name` samples whose labels contain `labels`."""
    with urllib.request.urlopen(stack.metrics["extauthz"], timeout=5) as reply:
        text = reply.read().decode()
    pattern = rf"^{name}\{{([^}}]*)\}} (\S+)$"
    return sum(float(v) for ls, v in re.findall(pattern, text, re.M) if labels in ls)


def queued(stack: Stack) -> float:
    return flow_metric(stack, "llmgw_flow_queue_length")


def eventually_queued(stack: Stack, count: int) -> None:
    what = lambda: f"not {count} queued: {queued(stack)}"  # noqa: E731
    eventually(lambda: queued(stack) == count, 30, what, every_s=0.02)


def running(stack: Stack) -> float:
    with urllib.request.urlopen(f"{stack.pod_url(0)}/metrics", timeout=5) as reply:
        lines = reply.read().decode().splitlines()
    return sum(
        float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("vllm:num_requests_running")
    )


@contextlib.contextmanager
def blockers(stack: Stack, key: str) -> Iterator[list[HTTPConnection]]:
    """Every seat held by a stream of the tenant's; closing one hangs up, freeing its seat."""
    conns = [send(stack, key, 20_000, stream=True) for _ in range(SEATS)]
    try:
        for conn in conns:
            assert conn.getresponse().status == 200
        eventually(lambda: running(stack) == SEATS, 30, "the blockers do not run")
        yield conns
    finally:
        for conn in conns:
            conn.close()
        eventually(lambda: running(stack) == 0, 30, "the pod still runs the blockers")
        eventually_queued(stack, 0)


class Caller(threading.Thread):
    """One short request in a thread: its status, headers and when its answer ended."""

    order: list[str]

    def __init__(self, stack: Stack, key: str, name: str, order: list[str]) -> None:
        super().__init__(daemon=True)
        self.stack, self.key, self.name, self.order = stack, key, name, order
        self.status = 0
        self.headers: dict[str, str] = {}
        self.reply: dict[str, object] = {}

    def run(self) -> None:
        conn = send(self.stack, self.key, 2)
        try:
            reply = conn.getresponse()
            self.status, self.headers = reply.status, {k.lower(): v for k, v in reply.getheaders()}
            self.reply = json.loads(reply.read())
            self.order.append(self.name)
        finally:
            conn.close()

    def queued_ms(self) -> float:
        return float(self.headers[wire.HEADER_QUEUE_MS])


def finish(*callers: Caller) -> None:
    for caller in callers:
        caller.join(60)
        assert not caller.is_alive(), f"{caller.name} was never answered"


def test_a_free_seat_goes_at_once_and_says_it_did_not_wait(flow_stack: Stack) -> None:
    order: list[str] = []
    caller = Caller(flow_stack, api_key(flow_stack, "free"), "free", order)
    caller.run()
    assert caller.status == 200, caller.reply
    assert caller.queued_ms() == 0


def test_the_higher_band_is_served_first_when_a_seat_frees(flow_stack: Stack) -> None:
    """free queues before platinum; the one seat that frees goes to platinum, then to free, each
    told how long it waited. Without flow control both would have gone to the pod at once."""
    order: list[str] = []
    with blockers(flow_stack, api_key(flow_stack, "standard")) as held:
        free = Caller(flow_stack, api_key(flow_stack, "free"), "free", order)
        free.start()
        eventually_queued(flow_stack, 1)
        platinum = Caller(flow_stack, api_key(flow_stack, "platinum"), "platinum", order)
        platinum.start()
        eventually_queued(flow_stack, 2)
        time.sleep(0.3)  # several scrapes: nothing dispatches while every seat is held
        assert queued(flow_stack) == 2 and order == []
        held[0].close()  # one seat frees
        finish(platinum, free)
    assert order == ["platinum", "free"]
    assert (platinum.status, free.status) == (200, 200), (platinum.reply, free.reply)
    assert 0 < platinum.queued_ms() < free.queued_ms()


def test_a_tenant_below_its_share_goes_before_a_flood_that_holds_the_seats(
    flow_stack: Stack,
) -> None:
    """One tenant holds every seat and queues up to its bound (past it: 429 queue_full at once,
    for it alone); a second tenant of the same band arrives last and is served first."""
    limits = PerMinuteLimits(rpm=10_000, tpm=100_000_000)
    flood_key = add_tenant(flow_stack, "flow-flood", "standard", limits)
    light_key = add_tenant(flow_stack, "flow-light", "standard", limits)
    order: list[str] = []
    with blockers(flow_stack, flood_key) as held:
        flood = [
            Caller(flow_stack, flood_key, f"flood-{i}", order) for i in range(TENANT_MAX_QUEUED)
        ]
        for i, caller in enumerate(flood, start=1):
            caller.start()
            eventually_queued(flow_stack, i)
        over = Caller(flow_stack, flood_key, "over", order)
        over.run()  # answered at once, while the others wait
        assert over.status == 429 and over.reply["error"]["code"] == "queue_full", over.reply  # type: ignore[index]
        assert int(over.headers["retry-after"]) >= 1
        light = Caller(flow_stack, light_key, "light", order)
        light.start()
        eventually_queued(flow_stack, TENANT_MAX_QUEUED + 1)
        held[0].close()
        finish(light, *flood)
    assert order[1] == "light", order  # ("over" was first, refused)
    assert all(c.status == 200 for c in (light, *flood))

    def shared() -> tuple[float, float]:
        with flow_stack.redis_client() as r:
            counts = r.hgetall(wire.FLOW_SERVED_KEY)
        flood, light = (
            counts.get(t, b"0:0").split(b":")[0] for t in (b"flow-flood", b"flow-light")
        )
        return float(flood), float(light)  # a count (and when, "count:at_ms"; served.lua)

    # What each tenant was served reaches Redis, for every replica's order (fairness.py).
    eventually(lambda: min(shared()) > 0, 10, lambda: f"shared: {shared()}")


def test_a_request_past_its_tiers_deadline_is_refused_and_charged_nothing(
    flow_stack: Stack,
) -> None:
    tenant = "flow-brief"
    key = add_tenant(flow_stack, tenant, "brief", PerMinuteLimits(rpm=1000, tpm=100_000_000))
    order: list[str] = []
    with blockers(flow_stack, api_key(flow_stack, "standard")):
        stranger = Caller(flow_stack, "sk-llmgw-made-up", "stranger", order)
        stranger.run()
        assert stranger.status == 401  # never queued: no work before a valid key
        assert queued(flow_stack) == 0
        brief = Caller(flow_stack, key, "brief", order)
        started = time.monotonic()
        brief.run()
        waited = time.monotonic() - started
        assert brief.status == 429, brief.reply
        error = brief.reply["error"]
        assert isinstance(error, dict) and error["code"] == "queue_timeout"
        assert int(brief.headers["retry-after"]) >= 1
        assert waited >= 1 and brief.queued_ms() >= 1000  # its tier's queue_timeout_s
        assert queued(flow_stack) == 0
    # It was admitted before it waited (its tokens reserved); refused, it never ran: the ledger
    # releases the reservation, as for any denial after admission.
    released = lambda: counter(flow_stack, tenant) == 0 and not reservations(flow_stack, tenant)  # noqa: E731
    eventually(released, 20, "the refused request's tokens stay reserved")


def test_a_client_that_hangs_up_while_queued_leaves_the_queue_and_its_reservation(
    flow_stack: Stack,
) -> None:
    tenant = "flow-leaver"
    key = add_tenant(flow_stack, tenant, "free", PerMinuteLimits(rpm=1000, tpm=100_000_000))
    cancelled = flow_metric(flow_stack, "llmgw_flow_refusals_total", 'reason="cancelled"')
    order: list[str] = []
    with blockers(flow_stack, api_key(flow_stack, "standard")) as held:
        leaver = send(flow_stack, key, 2)
        eventually_queued(flow_stack, 1)
        assert counter(flow_stack, tenant) > 0  # admitted while it waits: its tokens reserved
        leaver.close()
        eventually_queued(flow_stack, 0)
        # Envoy logs it without the check's metadata (the check never answered): extauthz
        # gives the reservation back itself.
        released = lambda: counter(flow_stack, tenant) == 0 and not reservations(flow_stack, tenant)  # noqa: E731
        eventually(released, 10, "the leaver's tokens stay reserved")
        left = lambda: flow_metric(flow_stack, "llmgw_flow_refusals_total", 'reason="cancelled"')  # noqa: E731
        eventually(lambda: left() == cancelled + 1, 10, "the hang-up was not counted")
        stayer = Caller(flow_stack, api_key(flow_stack, "platinum"), "stayer", order)
        stayer.start()
        eventually_queued(flow_stack, 1)
        held[0].close()  # the freed seat goes to the one still waiting
        finish(stayer)
    assert stayer.status == 200 and stayer.queued_ms() > 0


def access_log(stack: Stack) -> list[dict[str, object]]:
    """Envoy's file access log, whole lines only (Envoy may be writing the last one)."""
    text = stack.access_log.read_text() if stack.access_log.exists() else ""
    lines = text.splitlines(keepends=True)
    return [json.loads(line) for line in lines if line.endswith("\n")]


def marked_soon(entry: dict[str, object]) -> bool:
    authz = entry.get("envoy.filters.http.ext_authz")
    return isinstance(authz, dict) and wire.META_OUTCOME_SOON in authz


def logged(stack: Stack, caller: Caller) -> dict[str, object]:
    """The caller's request's entry in Envoy's file log, once there (flushed every 0.2 s)."""
    rid = caller.headers["x-request-id"]
    found: dict[str, dict[str, object]] = {}

    def there() -> bool:
        found.update((str(e["request_id"]), e) for e in access_log(stack))
        return rid in found

    eventually(there, 20, f"{caller.name}'s request is not in Envoy's access log")
    return found[rid]


def test_outcomes_come_at_once_only_for_requests_dispatched_when_seats_may_run_out(
    flow_stack: Stack,
) -> None:
    """A request into an idle pod is marked for the batched router log (0.2 s), one dispatched
    from the queue for the prompt one (20 ms); Envoy's two router logs take every request once
    between them, each its own: the outcome feed's counts per log match the marks of every
    request in Envoy's file log, this module's other tests' included."""
    order: list[str] = []

    def unmarked_when_idle() -> bool:
        """The router may see the last test's streams for a scrape or a batch more (then the
        request takes the last seat, and is marked): the next one is not."""
        alone = Caller(flow_stack, api_key(flow_stack, "free"), "alone", order)
        alone.run()
        assert alone.status == 200, alone.reply
        return not marked_soon(logged(flow_stack, alone))

    eventually(unmarked_when_idle, 20, "every request into the idle pod is marked", every_s=0.2)
    with blockers(flow_stack, api_key(flow_stack, "standard")) as held:
        waiter = Caller(flow_stack, api_key(flow_stack, "free"), "waiter", order)
        waiter.start()
        eventually_queued(flow_stack, 1)
        held[0].close()
        finish(waiter)
    assert waiter.status == 200 and waiter.queued_ms() > 0, waiter.reply
    assert marked_soon(logged(flow_stack, waiter))

    def feeds() -> tuple[list[dict[str, object]], float, float]:
        soon = flow_metric(flow_stack, "llmgw_router_outcomes_total", 'feed="soon"')
        batched = flow_metric(flow_stack, "llmgw_router_outcomes_total", 'feed="batched"')
        return access_log(flow_stack), soon, batched

    def agree() -> bool:
        entries, soon, batched = feeds()
        marked = sum(marked_soon(e) for e in entries)
        return (soon, batched) == (marked, len(entries) - marked)

    eventually(agree, 20, lambda: f"feeds (soon, batched) and the log disagree: {feeds()[1:]}")
