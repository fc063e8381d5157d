"""The collectors in a process of their own (router/collectors/process.py), through a real child:
the scrapes go on while the pick's event loop is stalled, what the child reads reaches the
parent's datastore (scrapes, KV events, counters, pods that come and go), a child killed is
started again and its KV entries relearnt, and a parent killed takes its child with it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry import trace

from router import metrics
from router.collectors import channel
from router.collectors.process import (
    FRAME_HASHES,
    MIN_SILENT_SECONDS,
    WATCH_SECONDS,
    CollectorProcess,
    _collapsed,
    _frames,
)
from router.fleet import Fleet, FleetSettings, KvEventSettings
from router.runtime import Router
from router.settings import Settings
from tests.eventually import eventually, eventually_async
from tests.router.conftest import metrics_text
from tests.router.test_kvevents import PROMPT_A, Pods, chat, held


class _Pod(BaseHTTPRequestHandler):
    """/metrics and /v1/models from a thread of the test's own: it answers while the test's
    event loop is stalled."""

    hits: list[float]
    status: int

    def do_GET(self) -> None:
        if self.path == "/metrics":
            type(self).hits.append(time.monotonic())
            body = metrics_text(running=2).encode()
        else:
            body = b'{"object": "list", "data": [{"id": "m", "max_model_len": 4096}]}'
        self.send_response(type(self).status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def threaded_pod() -> Iterator[tuple[str, type[_Pod]]]:
    handler = type("Pod", (_Pod,), {"hits": [], "status": 200})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


Start = Callable[[Fleet], CollectorProcess]


@pytest.fixture
async def collectors() -> AsyncIterator[Start]:
    """Starts a fleet's collectors' process; all stopped (the child killed) at the end."""
    tasks: list[asyncio.Task[None]] = []

    def start(fleet: Fleet) -> CollectorProcess:
        process = CollectorProcess(fleet)
        tasks.append(asyncio.create_task(process.run()))
        return process

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def fleet_of(*pods: str, **settings: object) -> Fleet:
    fleet = Fleet(
        FleetSettings.model_validate(
            {"pods": list(pods), "scrape_interval": 0.05, "scrape_timeout": 1.0} | settings
        )
    )
    fleet.set_pods(pods)
    return fleet


def scraped_ok(fleet: Fleet, pod: str) -> bool:
    snap = fleet.snapshots.get(pod)
    return snap is not None and snap.ok


async def test_the_scrapes_go_on_while_the_picks_loop_is_stalled(
    threaded_pod: tuple[str, type[_Pod]], collectors: Start
) -> None:
    """The point of the process: a check's loop that is busy (here: stalled outright for a
    second) delays no scrape. With the scraper on that loop, no scrape is sent meanwhile."""
    pod, handler = threaded_pod
    fleet = fleet_of(pod)
    collectors(fleet)
    await eventually_async(lambda: scraped_ok(fleet, pod), 30, "the pod scraped")
    snap = fleet.snapshots[pod]
    assert (snap.running, snap.contexts) == (2.0, {"m": 4096})
    before = len(handler.hits)
    stalled = time.monotonic()
    time.sleep(1.0)  # noqa: ASYNC251 (the loop stalled, as a long check would)
    during = [t for t in handler.hits[before:] if t > stalled + 0.1]
    assert len(during) >= 3, f"{len(during)} scrapes while the loop was stalled"
    # and the parent takes the newest once it runs again
    await eventually_async(lambda: fleet.snapshots[pod].at > stalled + 1.0, 10, "a newer scrape")


async def test_pods_that_come_and_go_and_failed_scrapes_reach_the_parent(
    threaded_pod: tuple[str, type[_Pod]], collectors: Start
) -> None:
    pod, handler = threaded_pod
    fleet = fleet_of()
    collectors(fleet)
    fleet.set_pods([pod])  # the resolver found it after the start
    await eventually_async(lambda: scraped_ok(fleet, pod), 30, "the new pod scraped")
    errors = metrics.SCRAPE_ERRORS.labels(pod)._value.get()
    handler.status = 500
    await eventually_async(lambda: not fleet.snapshots[pod].ok, 10, "the failed scrape")
    await eventually_async(
        lambda: metrics.SCRAPE_ERRORS.labels(pod)._value.get() > errors, 10, "counted"
    )
    fleet.set_pods([])
    await asyncio.sleep(1.5)  # the child told within PODS_SECONDS; a scrape under way ends
    settled = len(handler.hits)
    await asyncio.sleep(1.0)
    assert len(handler.hits) <= settled + 1, "a pod gone from the fleet is still scraped"


@pytest.fixture
async def pods(tmp_path: Path) -> AsyncIterator[Pods]:
    made = Pods(tmp_path)
    yield made
    for pod in made.pods:
        await pod.close()


async def test_kv_events_reach_the_parents_index_and_a_killed_child_is_replaced(
    pods: Pods, collectors: Start
) -> None:
    endpoint = pods.endpoint("p")
    sim = await pods.start(endpoint)
    fleet = fleet_of(kv_events=KvEventSettings(endpoints={"p": endpoint}).model_dump())
    fleet.set_pods(["p"])  # (no pod to scrape at "p": only its events are read)
    process = collectors(fleet)
    blocks = pods.blocks(PROMPT_A)
    await chat(sim, PROMPT_A)
    await eventually_async(lambda: held(fleet, "p", blocks) == len(blocks), 30, "A's blocks")
    assert process.proc is not None
    first = process.proc.pid
    os.kill(first, signal.SIGKILL)
    # Dropped when the child died (it may have missed an eviction), relearnt from the replay.
    await eventually_async(lambda: not fleet.kv.publishes("p"), 10, "the entries dropped")
    await eventually_async(lambda: held(fleet, "p", blocks) == len(blocks), 30, "relearnt")
    assert process.proc is not None and process.proc.pid != first


async def test_a_sigterm_to_the_process_group_leaves_the_child_to_its_parent(
    threaded_pod: tuple[str, type[_Pod]], collectors: Start
) -> None:
    """A supervisor stops a router by SIGTERM to its process group; the router drains its
    checks meanwhile, with its pods still scraped."""
    pod, handler = threaded_pod
    fleet = fleet_of(pod)
    process = collectors(fleet)
    await eventually_async(lambda: scraped_ok(fleet, pod), 30, "the pod scraped")
    assert process.proc is not None
    os.kill(process.proc.pid, signal.SIGTERM)
    after = len(handler.hits)
    await eventually_async(lambda: len(handler.hits) > after + 5, 10, "scrapes after SIGTERM")
    assert process.proc.returncode is None


def test_operations_for_a_pod_gone_from_the_fleet_forget_it() -> None:
    """The child learns that a pod left up to PODS_SECONDS after the parent: what it still
    sends of the pod must not put it back in the index (a lookup would count blocks of a pod
    no longer watched)."""
    fleet = fleet_of("a:1", "b:1", kv_events={"port": 5557})
    process = CollectorProcess(fleet)
    process.apply(
        channel.KvOps([channel.Stored("a:1", [1, 2], 16), channel.Stored("b:1", [1], 16)])
    )
    fleet.set_pods(["a:1"])
    process.apply(channel.KvOps([channel.Stored("b:1", [1, 2, 3], 16), channel.Cleared("b:1")]))
    assert not fleet.kv.publishes("b:1")
    assert fleet.kv.match((1, 2), 16) == {"a:1": 2}


def test_operations_too_many_to_hold_collapse_to_what_is_safe() -> None:
    ops: list[channel.KvOp] = [
        channel.Stored("a:1", [1, 2], 16),
        channel.Removed("b:1", [7]),
        channel.Dropped("c:1"),
        channel.Stored("c:1", [3], 16),
    ]
    assert _collapsed(ops) == [
        channel.Cleared("a:1"),
        channel.Cleared("b:1"),
        channel.Dropped("c:1"),
    ]


def test_a_frame_holds_a_bounded_number_of_hashes_in_order() -> None:
    ops: list[channel.KvOp] = [channel.Stored("a:1", list(range(1000)), 16) for _ in range(40)]
    frames = list(_frames(ops))
    assert [op for frame in frames for op in frame] == ops
    assert all(sum(len(op.hashes) for op in f) <= FRAME_HASHES + 1000 for f in frames)  # type: ignore[union-attr]
    assert len(frames) == 3


def child_commands() -> list[bytes]:
    me = os.getpid()
    pids = Path(f"/proc/{me}/task/{me}/children").read_text().split()
    return [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in pids]


async def test_a_router_runs_its_collectors_in_a_process_and_starts_once_they_scraped(
    threaded_pod: tuple[str, type[_Pod]],
) -> None:
    pod, _ = threaded_pod
    fleet = FleetSettings(pods=[pod], scrape_timeout=1.0)  # patient: a busy machine's scrapes
    router = Router.from_settings(Settings(fleet=fleet), trace.get_tracer("t"))
    await router.start()  # returns once its pods are scraped: it never answers blind
    try:
        assert scraped_ok(router.fleet, pod)
        kids = child_commands()
        assert any(b"router.collectors" in cmd for cmd in kids), kids
    finally:
        await router.stop()


async def test_a_child_gone_silent_is_replaced(
    threaded_pod: tuple[str, type[_Pod]], collectors: Start
) -> None:
    """A stopped (or wedged) child would leave every pod stale for good."""
    pod, handler = threaded_pod
    fleet = fleet_of(pod, scrape_timeout=0.2)
    process = collectors(fleet)
    await eventually_async(lambda: scraped_ok(fleet, pod), 30, "the pod scraped")
    assert process.proc is not None
    stopped = process.proc.pid
    os.kill(stopped, signal.SIGSTOP)
    try:
        await eventually_async(
            lambda: process.proc is not None and process.proc.pid != stopped, 30, "a new child"
        )
        hits = len(handler.hits)
        await eventually_async(lambda: len(handler.hits) > hits, 30, "the new child scraping")
        assert gone(stopped)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGKILL)


async def test_a_stall_of_the_parents_own_loop_replaces_no_child(
    threaded_pod: tuple[str, type[_Pod]], collectors: Start
) -> None:
    """The child's frames wait in the pipe while the parent's loop is stalled: that is not the
    child's silence."""
    pod, _ = threaded_pod
    fleet = fleet_of(pod, scrape_timeout=0.2)  # silent after 5 s
    process = collectors(fleet)
    await eventually_async(lambda: scraped_ok(fleet, pod), 30, "the pod scraped")
    assert process.proc is not None
    child = process.proc.pid
    time.sleep(MIN_SILENT_SECONDS + 1.0)  # noqa: ASYNC251 (the loop stalled)
    await asyncio.sleep(4 * WATCH_SECONDS)
    assert process.proc.pid == child and process.proc.returncode is None


PARENT = """
import asyncio, sys
from router.collectors.process import CollectorProcess
from router.fleet import Fleet, FleetSettings

async def main() -> None:
    fleet = Fleet(FleetSettings(pods=[sys.argv[1]]))
    fleet.set_pods([sys.argv[1]])
    process = CollectorProcess(fleet)
    task = asyncio.create_task(process.run())
    while process.proc is None:
        await asyncio.sleep(0.01)
    print(process.proc.pid, flush=True)
    await task

asyncio.run(main())
"""


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def test_a_parent_killed_takes_its_child_with_it(threaded_pod: tuple[str, type[_Pod]]) -> None:
    pod, handler = threaded_pod
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, pod],
        stdout=subprocess.PIPE,
        env=os.environ | {"PYTHONPATH": str(Path(__file__).parents[2])},
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        eventually(lambda: len(handler.hits) > 0, 30, "the child scraping")
        parent.kill()
        parent.wait(10)
        eventually(lambda: gone(child), 10, "the orphaned child gone")
    finally:
        parent.kill()
        parent.wait(10)
        if parent.stdout is not None:
            parent.stdout.close()
