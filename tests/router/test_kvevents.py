"""The KV-event subscriber (router/collectors/kvevents.py) against simulated pods publishing as
vLLM does (sim/kvevents.py), over real ZMQ sockets: events applied in order, gaps filled by
replay or else the pod's entries dropped, a pod's buffered past learnt on connecting, a
restarted pod cleared, a pod gone forgotten, garbage
skipped."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from opentelemetry import trace

from llmgw import facts, kvblocks, kvevents, tokenizer
from router import metrics
from router.collectors.kvevents import KvEventSubscriber
from router.collectors.scraper import Scraper
from router.engine import Engine
from router.fleet import Fleet, FleetSettings, KvEndpoint, KvEventSettings
from router.lifecycle import Lifecycle
from router.registry import DEFAULT_PLUGINS, DEFAULT_PROFILE, default_registry
from router.types import PickRequest
from sim.faults import FaultState
from sim.kvevents import KvEventPublisher
from sim.pod import SimPod
from sim.types import DEFAULT_MODEL, KvEventsConfig, SimSettings
from tests import tiny_tokenizer
from tests.eventually import eventually_async

BLOCK = 16
SALT = "c0ffee"


class Pods:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.tokenizer = tiny_tokenizer.write(tmp / "tiny")
        self.pods: list[SimPod] = []

    def endpoint(self, name: str, replay: bool = True) -> KvEndpoint:
        path = self.tmp / name
        return KvEndpoint(
            publish=f"ipc://{path}.pub", replay=f"ipc://{path}.replay" if replay else None
        )

    async def start(self, endpoint: KvEndpoint, port: int = 0) -> SimPod:
        config = KvEventsConfig(
            enable_kv_cache_events=True,
            endpoint=endpoint.publish,
            replay_endpoint=endpoint.replay,
        )
        settings = SimSettings(
            port=port,
            time_scale=0.01,
            block_size=BLOCK,
            tokenizer=self.tokenizer,
            kv_events_config=config,
        )
        pod = await SimPod(settings).start()
        self.pods.append(pod)
        return pod

    def blocks(self, text: str) -> tuple[int, ...]:
        """What the gateway computes for a chat request of `text` (llmgw/kvblocks.py)."""
        prompt = tokenizer.counter(self.tokenizer).request(
            {"messages": [{"role": "user", "content": text}]}, 0
        )
        assert prompt is not None
        return kvblocks.block_hashes(prompt.ids, kvblocks.KvHashing(block_size=BLOCK), SALT)


@pytest.fixture
async def pods(tmp_path: Path) -> AsyncIterator[Pods]:
    made = Pods(tmp_path)
    yield made
    for pod in made.pods:
        await pod.close()


Run = Callable[[dict[str, KvEndpoint]], Awaitable[tuple[Fleet, KvEventSubscriber]]]


@pytest.fixture
async def subscribe() -> AsyncIterator[Run]:
    tasks: list[asyncio.Task[None]] = []

    async def run(endpoints: dict[str, KvEndpoint]) -> tuple[Fleet, KvEventSubscriber]:
        settings = KvEventSettings(endpoints=endpoints)
        fleet = Fleet(FleetSettings(kv_events=settings))
        fleet.set_pods(endpoints)
        subscriber = KvEventSubscriber(fleet, settings)
        tasks.append(asyncio.create_task(subscriber.run()))
        return fleet, subscriber

    yield run
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def chat(pod: SimPod, text: str) -> None:
    body: dict[str, Any] = {
        "model": pod.settings.model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 2,
        "cache_salt": SALT,
    }
    async with (
        aiohttp.ClientSession() as http,
        http.post(pod.url + "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200, await resp.text()


async def faults(pod: SimPod, **fields: Any) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.put(pod.url + "/admin/faults", json=fields) as resp,
    ):
        assert resp.status == 200, await resp.text()


def held(fleet: Fleet, pod: str, blocks: tuple[int, ...]) -> int:
    return fleet.kv.match(blocks, BLOCK).get(pod, 0)


def batches(result: str) -> float:
    return float(metrics.KV_BATCHES.labels(result)._value.get())


PROMPT_A = "the quick brown fox jumps over the lazy dog " * 12
PROMPT_B = "a completely different conversation about caching " * 12


async def test_the_index_holds_what_the_pod_cached_as_the_gateway_hashes_it(
    pods: Pods, subscribe: Run
) -> None:
    """The gateway's hashes of a request (from its tokenizer) are the simulated pod's: after
    the request, the index says the pod holds every full block of its prompt."""
    endpoint = pods.endpoint("p")
    pod = await pods.start(endpoint)
    fleet, _ = await subscribe({"p": endpoint})
    blocks = pods.blocks(PROMPT_A)
    assert len(blocks) >= 5
    await chat(pod, PROMPT_A)
    await eventually_async(lambda: held(fleet, "p", blocks) == len(blocks), 10, "A's blocks")
    # Another tenant's salt shares none of them.
    other = kvblocks.block_hashes(
        tokenizer.counter(pods.tokenizer)
        .request({"messages": [{"role": "user", "content": PROMPT_A}]}, 0)
        .ids,  # type: ignore[union-attr]
        kvblocks.KvHashing(block_size=BLOCK),
        "another-salt",
    )
    assert held(fleet, "p", other) == 0


async def test_a_subscriber_learns_what_the_pod_cached_before_it_connected(
    pods: Pods, subscribe: Run
) -> None:
    """A router started (or restarted) after the pod: the connection's replay."""
    endpoint = pods.endpoint("p")
    pod = await pods.start(endpoint)
    await chat(pod, PROMPT_A)
    fleet, _ = await subscribe({"p": endpoint})
    a = pods.blocks(PROMPT_A)
    await eventually_async(lambda: held(fleet, "p", a) == len(a), 10, "A's blocks")


async def test_a_gap_is_replayed(pods: Pods, subscribe: Run) -> None:
    endpoint = pods.endpoint("p")
    pod = await pods.start(endpoint)
    fleet, _ = await subscribe({"p": endpoint})
    await chat(pod, "warm up " * 40)  # the subscription is live once its blocks arrive
    warm = pods.blocks("warm up " * 40)
    await eventually_async(lambda: held(fleet, "p", warm) == len(warm), 10, "warm-up blocks")
    replayed = batches("replayed")
    await faults(pod, kv_events_paused=True)  # as ZMQ drops past the high-water mark
    await chat(pod, PROMPT_A)
    await faults(pod, kv_events_paused=False)
    await chat(pod, PROMPT_B)
    a, b = pods.blocks(PROMPT_A), pods.blocks(PROMPT_B)
    await eventually_async(lambda: held(fleet, "p", b) == len(b), 10, "B's blocks")
    assert held(fleet, "p", a) == len(a)  # the batches never sent came from the replay
    assert batches("replayed") > replayed


async def live(pods: Pods, pod: SimPod, fleet: Fleet) -> None:
    """Until the subscription is live: a fresh prompt's blocks arrive (bounded). Without a
    replay, what the pod published before the subscriber connected is lost for good (a busy
    machine connected it after the first prompt's events)."""
    for i in range(20):
        text = f"warm up {i} " * 40
        await chat(pod, text)
        blocks = pods.blocks(text)

        def arrived(b: tuple[int, ...] = blocks) -> bool:
            return held(fleet, "p", b) == len(b)

        with contextlib.suppress(AssertionError):
            await eventually_async(arrived, 2, "warm-up")
            return
    raise AssertionError("the subscription never went live")


async def test_a_gap_no_replay_fills_drops_the_pods_entries(pods: Pods, subscribe: Run) -> None:
    endpoint = pods.endpoint("p", replay=False)
    pod = await pods.start(endpoint)
    fleet, _ = await subscribe({"p": endpoint})
    await live(pods, pod, fleet)
    warm = pods.blocks(PROMPT_A)
    await chat(pod, PROMPT_A)
    await eventually_async(lambda: held(fleet, "p", warm) == len(warm), 10, "A's blocks")
    lost = batches("lost")
    await faults(pod, kv_events_paused=True)
    await chat(pod, "unseen " * 40)
    await faults(pod, kv_events_paused=False)
    await chat(pod, PROMPT_B)
    b = pods.blocks(PROMPT_B)
    await eventually_async(lambda: held(fleet, "p", b) == len(b), 10, "B's blocks")
    # What the pod did meanwhile is unknown (it may have evicted A): A is no longer counted.
    assert held(fleet, "p", warm) == 0 and batches("lost") == lost + 1


async def test_a_restarted_pod_is_cleared_and_a_pod_gone_forgotten(
    pods: Pods, subscribe: Run
) -> None:
    endpoint = pods.endpoint("p")
    pod = await pods.start(endpoint)
    fleet, subscriber = await subscribe({"p": endpoint})
    a, b = pods.blocks(PROMPT_A), pods.blocks(PROMPT_B)
    await chat(pod, PROMPT_A)
    await eventually_async(lambda: held(fleet, "p", a) == len(a), 10, "A's blocks")
    await pod.close()
    pods.pods.remove(pod)
    pod = await pods.start(endpoint)  # a new process on the same address: sequence from 0
    await chat(pod, PROMPT_B)
    await eventually_async(lambda: held(fleet, "p", b) == len(b), 10, "B's blocks")
    assert held(fleet, "p", a) == 0  # the old process's cache went with it
    fleet.set_pods([])
    subscriber.reconcile()
    assert not fleet.kv.publishes("p") and fleet.kv.entries() == 0


async def test_garbage_is_skipped_and_the_subscription_goes_on(pods: Pods, subscribe: Run) -> None:
    """Undecodable payloads and wrong frame counts are counted and skipped; the batch after
    them is applied."""
    endpoint = pods.endpoint("raw", replay=False)
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint.publish)
    try:
        fleet, _ = await subscribe({"raw": endpoint})
        malformed = batches("malformed")
        stored = kvevents.EventBatch(0.0, [kvevents.BlockStored([7], None, [], 16)])
        seq = 0
        for _ in range(200):  # until the subscription is live (ZMQ connects in the background)
            for payload in (b"\xc1 not msgpack", kvevents.encode(stored)):
                await pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
                seq += 1
            await pub.send_multipart([b"two frames", b""])
            await asyncio.sleep(0.05)
            if fleet.kv.match((7,), 16) == {"raw": 1}:
                break
        assert fleet.kv.match((7,), 16) == {"raw": 1}
        assert batches("malformed") >= malformed + 2
    finally:
        ctx.destroy(linger=0)


async def test_two_replicas_send_a_conversation_where_the_other_one_started_it(
    pods: Pods,
) -> None:
    """Two routers that share nothing but the pods' events: for each conversation, replica A
    picks the first turn's pod, the turn runs there, and replica B, which never saw that pick,
    sends the next turn to the same pod (without the events: a pod of three by load and chance,
    each time)."""
    endpoints = [pods.endpoint(f"p{i}") for i in range(3)]
    started = [await pods.start(e) for e in endpoints]
    ids = [f"127.0.0.1:{p.port}" for p in started]
    settings = KvEventSettings(endpoints=dict(zip(ids, endpoints, strict=True)))
    replicas: list[Lifecycle] = []
    tasks: list[asyncio.Task[None]] = []
    for _ in range(2):
        fleet = Fleet(FleetSettings(kv_events=settings, scrape_timeout=2.0, stale_after=60.0))
        fleet.set_pods(ids)
        async with Scraper(fleet).session() as http:
            await Scraper(fleet).scrape_once(http)
        tasks.append(asyncio.create_task(KvEventSubscriber(fleet, settings).run()))
        engine = Engine(default_registry().build(DEFAULT_PLUGINS, DEFAULT_PROFILE))
        replicas.append(Lifecycle(fleet, engine, trace.get_tracer("test")))
    a, b = replicas
    try:
        for i in range(4):
            first = f"conversation {i}: " + PROMPT_A
            turn1 = request(pods, [{"role": "user", "content": first}])
            chosen = a.pick(turn1)
            assert chosen is not None
            pod = started[ids.index(chosen.pods[0])]
            await chat(pod, first)

            # B learns it from the pod's events alone.
            def held(blocks: tuple[int, ...] = turn1.kv_blocks, at: str = chosen.pods[0]) -> bool:
                return b.fleet.kv.match(blocks, BLOCK).get(at) == len(blocks)

            await eventually_async(held, 10, "replica B never saw the first turn's blocks")
            messages = [
                {"role": "user", "content": first},
                {"role": "assistant", "content": "Sure."},
                {"role": "user", "content": "And then?"},
            ]
            turn2 = b.pick(request(pods, messages))
            assert turn2 is not None and turn2.pods[0] == chosen.pods[0], i
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def request(pods: Pods, messages: list[dict[str, str]]) -> PickRequest:
    """What extauthz hands the router for these messages (a tenant of salt SALT)."""
    prompt = tokenizer.counter(pods.tokenizer).request({"messages": messages}, 0)
    assert prompt is not None
    hashing = kvblocks.KvHashing(block_size=BLOCK)
    return PickRequest(
        model=DEFAULT_MODEL,
        prompt_tokens=prompt.tokens,
        kv_blocks=kvblocks.block_hashes(prompt.ids, hashing, SALT),
        kv_block_size=BLOCK,
        prefix_blocks=facts.block_hashes(facts.render({"messages": messages}), 64, "group"),
        first_turn=len(messages) == 1,
    )


def stored(*hashes: int) -> list[kvevents.Event]:
    return [kvevents.BlockStored(list(hashes), None, [], BLOCK, medium="GPU")]


async def test_a_restarted_pods_queued_batches_are_not_taken_for_the_new_ones(
    pods: Pods, subscribe: Run
) -> None:
    """The router busy (its loop held) while the old process sends ten batches and dies and a
    new one starts on the same address and sends three: the old ones still queued are not
    applied after the disconnection (they would be taken for the new process's, which counts
    from 0 again, and the new ones skipped); the new process's are."""
    endpoint = pods.endpoint("p")
    ctx = zmq.Context()
    old = ctx.socket(zmq.PUB)
    old.bind(endpoint.publish)
    try:
        fleet, _ = await subscribe({"p": endpoint})
        batch = kvevents.encode(kvevents.EventBatch(0.0, stored(1)))
        for seq in range(200):  # until the subscription is live
            old.send_multipart([b"", seq.to_bytes(8, "big"), batch])
            await asyncio.sleep(0.05)
            if held(fleet, "p", (1,)):
                break
        assert held(fleet, "p", (1,))
        for k in range(10):  # the loop held from here: nothing is read
            batch = kvevents.encode(kvevents.EventBatch(0.0, stored(100 + k)))
            old.send_multipart([b"", (seq + 1 + k).to_bytes(8, "big"), batch])
        time.sleep(0.3)  # noqa: ASYNC251 (the router's loop held on purpose)
        old.close(linger=0)
        time.sleep(0.3)  # noqa: ASYNC251
        new = KvEventPublisher(
            KvEventsConfig(enable_kv_cache_events=True, endpoint=endpoint.publish,
                           replay_endpoint=endpoint.replay),
            FaultState(0),
        )  # fmt: skip
        new.start()
        for k in range(3):
            new.publish(stored(200 + k))
        time.sleep(0.3)  # noqa: ASYNC251
        try:
            await eventually_async(
                lambda: all(held(fleet, "p", (200 + k,)) for k in range(3)), 10, "new blocks"
            )
            assert not any(held(fleet, "p", (h,)) for h in (1, *range(100, 110)))
        finally:
            await new.close()
    finally:
        ctx.destroy(linger=0)


async def test_a_replay_with_a_hole_keeps_only_the_unbroken_run_to_the_newest(
    pods: Pods, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's replay socket drops what passes its high-water mark: a block stored before the
    hole whose eviction fell in it would be counted for ever. The pod's entries are dropped,
    and only the batches after the last hole are applied."""
    settings = KvEventSettings(endpoints={"p": pods.endpoint("p")})
    fleet = Fleet(FleetSettings(kv_events=settings))
    fleet.set_pods(["p"])
    subscriber = KvEventSubscriber(fleet, settings)
    fleet.kv.stored("p", [9], BLOCK)  # known before the gap
    replayed = [
        (q, kvevents.encode(kvevents.EventBatch(0.0, stored(10 + q)))) for q in (3, 4, 6, 7)
    ]

    async def replay(_: object, start: int, until: int) -> list[tuple[int, bytes]]:
        return [b for b in replayed if start <= b[0] < until]

    monkeypatch.setattr(subscriber, "_replay", replay)
    last = await subscriber._catch_up("p", settings.endpoints["p"], 3, 8, 2)
    assert last == 7
    assert [h for h in (9, 13, 14, 16, 17) if held(fleet, "p", (h,))] == [16, 17]
    # Complete: every batch applied, nothing dropped.
    fleet.kv.stored("p", [9], BLOCK)
    last = await subscriber._catch_up("p", settings.endpoints["p"], 6, 8, 5)
    assert last == 7 and held(fleet, "p", (9,))


async def test_a_message_past_the_size_bound_is_never_applied(pods: Pods) -> None:
    """ZMQ ends the connection on a message larger than max_message_bytes: the pod's entries
    go with it, and the batch is not applied."""
    endpoint = pods.endpoint("p", replay=False)
    settings = KvEventSettings(endpoints={"p": endpoint}, max_message_bytes=4096)
    fleet = Fleet(FleetSettings(kv_events=settings))
    fleet.set_pods(["p"])
    task = asyncio.create_task(KvEventSubscriber(fleet, settings).run())
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint.publish)
    try:
        small = kvevents.encode(kvevents.EventBatch(0.0, stored(1)))
        for seq in range(200):
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), small])
            await asyncio.sleep(0.05)
            if held(fleet, "p", (1,)):
                break
        disconnected = batches("disconnected")
        large = kvevents.encode(kvevents.EventBatch(0.0, stored(*range(2, 2000))))
        assert len(large) > 4096
        await pub.send_multipart([b"", (seq + 1).to_bytes(8, "big"), large])
        await eventually_async(lambda: batches("disconnected") > disconnected, 10)
        assert fleet.kv.size("p") == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.destroy(linger=0)


def test_only_the_full_attention_cache_is_indexed(pods: Pods) -> None:
    """A hybrid model's sliding-window group stores and evicts blocks of its own: they are not
    a prompt's prefix, and their evictions must not remove the full-attention group's."""
    settings = KvEventSettings(endpoints={"p": pods.endpoint("p")})
    fleet = Fleet(FleetSettings(kv_events=settings))
    fleet.set_pods(["p"])
    subscriber = KvEventSubscriber(fleet, settings)
    full = kvevents.BlockStored([1, 2], None, [], BLOCK, group_idx=0,
                                kv_cache_spec_kind="full_attention")  # fmt: skip
    window = kvevents.BlockStored([1, 3], None, [], BLOCK, group_idx=1,
                                  kv_cache_spec_kind="sliding_window")  # fmt: skip
    evicted = kvevents.BlockRemoved([1], group_idx=1)
    subscriber.apply("p", kvevents.encode(kvevents.EventBatch(0.0, [full, window, evicted])))
    assert held(fleet, "p", (1, 2)) == 2 and not held(fleet, "p", (3,))
