"""The router through real Envoy and simulated pods: affinity, failing pods, router loss, replicas.

Where a request went is read from Envoy's access log (`upstream`, by request ID), what the router
picked from its own metrics.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from llmgw import wire
from llmgw.topology import Topology
from tests.e2e.conftest import PATIENT_SCRAPES, api_key, stack_settings
from tests.eventually import eventually_async
from tests.http import call
from tools.stack import Stack, StackSettings

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SYSTEM = "You are the support assistant of the Example Corporation. " * 40  # ~600 tokens


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with pytest.MonkeyPatch.context() as env:
        for name, value in PATIENT_SCRAPES.items():
            env.setenv(name, value)
        with Stack(stack_settings(pods=4), tmp_path_factory.mktemp("routed")) as running:
            yield running


@pytest.fixture
def patient_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    """A stack of this test's own whose router keeps its view of the pods however busy the
    machine: every admitted request is picked."""
    for name, value in PATIENT_SCRAPES.items():
        monkeypatch.setenv(name, value)
    with Stack(stack_settings(pods=3), tmp_path / "stack") as running:
        yield running


def chat(stack: Stack, messages: list[dict[str, str]], session: str | None = None) -> Any:
    headers = {"authorization": f"Bearer {api_key(stack)}"} if stack.tenants else {}
    if session:
        headers[wire.HEADER_SESSION] = session
    body = {"model": MODEL, "messages": messages, "max_tokens": 4}
    reply = call("POST", f"{stack.base_url}/chat/completions", body, headers)
    assert reply.status == 200, reply.body
    return reply


def upstreams(stack: Stack, request_ids: list[str]) -> list[str]:
    """The pod each request went to, from the access log (flushed every 200 ms; bounded wait)."""
    found: dict[str, str] = {}
    for _ in range(100):
        if stack.access_log.exists():
            # Whole lines only: Envoy may be writing the last one as it is read.
            for line in stack.access_log.read_text().splitlines(keepends=True):
                if not line.endswith("\n"):
                    break
                entry = json.loads(line)
                found[entry["request_id"]] = entry["upstream"]
        if all(r in found for r in request_ids):
            return [found[r] for r in request_ids]
        time.sleep(0.05)
    raise AssertionError(f"requests missing from the access log: {set(request_ids) - set(found)}")


def router_metric(stack: Stack, name: str, pod: str) -> float:
    """The router's metric `name` for `pod`, summed over its other labels (served by extauthz
    when the router runs inside it)."""
    with urllib.request.urlopen(stack.metrics["router"], timeout=5) as resp:
        text = resp.read().decode()
    prefix = f'{name}{{pod="{pod}"'
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    )


def router_picks(stack: Stack, pod: str) -> float:
    return router_metric(stack, "llmgw_router_picks_total", pod)


def admissions(stack: Stack) -> tuple[float, float]:
    """The limiter's admissions inside extauthz so far: those it admitted (its "ok" verdicts and
    those it let through undecided, fail-open), and those it refused."""
    with urllib.request.urlopen(stack.metrics["ratelimit"], timeout=5) as resp:
        text = resp.read().decode()
    admitted = refused = 0.0
    for line in text.splitlines():
        if line.startswith("llmgw_ratelimit_decisions_total{"):
            value = float(line.rsplit(" ", 1)[1])
            if 'result="ok"' in line:
                admitted += value
            else:
                refused += value
        elif line.startswith("llmgw_extauthz_admit_errors_total{"):
            admitted += float(line.rsplit(" ", 1)[1])
    return admitted, refused


def converse(stacks: list[Stack], turns: int, session: str | None = None) -> tuple[str, list[str]]:
    """One session's turns (alternating over `stacks`), with the history; the pods they hit."""
    messages = [{"role": "system", "content": SYSTEM}]
    pods = []
    for turn in range(turns):
        stack = stacks[turn % len(stacks)]
        messages.append({"role": "user", "content": f"question {turn}"})
        reply = chat(stack, messages, session)
        session = reply.headers.get(wire.HEADER_SESSION, session)
        pods += upstreams(stack, [reply.headers["x-request-id"]])
        messages.append(
            {"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]}
        )
    assert session is not None
    return session, pods


def test_a_session_stays_on_one_pod(routed: Stack) -> None:
    for _ in range(3):
        _, pods = converse([routed], turns=5)
        assert len(set(pods[1:])) == 1, pods  # the first turn has no affinity yet


def test_a_shared_prompt_prefix_lands_on_the_pod_that_holds_it(routed: Stack) -> None:
    """New sessions (no affinity yet) with one long system prompt follow the prefix."""
    prefix = "Tenant 42 instructions: answer tersely and cite sources. " * 40
    ids = []
    for i in range(6):
        messages = [{"role": "system", "content": prefix}, {"role": "user", "content": f"q{i}"}]
        ids.append(chat(routed, messages).headers["x-request-id"])
    pods = upstreams(routed, ids)
    assert len(set(pods[1:])) == 1, pods
    assert router_picks(routed, pods[-1]) >= 5  # the router named that pod


async def load(
    stack: Stack,
    seconds: float,
    concurrency: int,
    on_done: Any = None,
    rate: float = 40.0,
    until: int | None = None,
) -> tuple[int, list[BaseException]]:
    """Chat requests from `concurrency` workers for `seconds` (or until `until` are done, with
    `seconds` only a bound against a hang), each at most `rate` a second (so that a fast machine
    stays under the platinum tier's 500 a second): how many, and the failures."""
    headers = {"authorization": f"Bearer {api_key(stack)}"}
    deadline = time.monotonic() + seconds
    done = 0
    failures: list[BaseException] = []

    async def worker(session: aiohttp.ClientSession, w: int) -> None:
        nonlocal done
        next_at = time.monotonic()
        while time.monotonic() < deadline and (until is None or done < until):
            next_at += 1 / rate
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"w{w} {done}"}]}
            try:
                async with session.post(
                    f"{stack.base_url}/chat/completions", json=body | {"max_tokens": 20}
                ) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        raise RuntimeError(f"{resp.status}: {text}")
            except (RuntimeError, aiohttp.ClientError) as exc:
                failures.append(exc)
            done += 1
            if on_done is not None:
                await on_done(done)

    async with aiohttp.ClientSession(headers=headers) as session:
        await asyncio.gather(*(worker(session, w) for w in range(concurrency)))
    return done, failures


async def test_a_failing_pod_stops_receiving_picks_and_no_request_fails(own_stack: Stack) -> None:
    bad = own_stack.pods[0]
    bad_id = f"{bad.host}:{bad.port}"
    faults = {"error_rate": 1.0, "error_status": 503}
    assert call("PUT", f"{own_stack.pod_url(0)}/admin/faults", faults).status == 200
    failed_at = time.monotonic()
    marks: list[float] = []

    async def mark(done: int) -> None:
        if not marks and time.monotonic() - failed_at >= 1.0:
            marks.append(await asyncio.to_thread(router_picks, own_stack, bad_id))

    done, failures = await load(own_stack, 2.5, 6, mark)
    # Every 503 was retried on another pod. How many were sent is the machine's: 48 in 2.5 s
    # beside a second suite, 90 alone; a few dozen make the bad pod's picks show.
    assert done > 20 and failures == []
    assert marks
    # After a second, the bad pod gets at most one probe after its cooldown: `error_threshold`
    # (3) picks plus those made while the probe's answers are on their way (6 workers).
    assert router_picks(own_stack, bad_id) - marks[0] <= 3 + 6


async def test_picks_inside_extauthz_are_made_only_for_what_it_admits(
    patient_stack: Stack,
) -> None:
    """The router inside extauthz chooses while the admission is under way, and a refused
    request gives its pod back: a burst 4x the tier's rate picks exactly the admitted requests
    (a refused one holds no pod and teaches the prefix index nothing), and every pick is
    released by its access-log entry."""
    assert patient_stack.services.router_inside and patient_stack.services.limiter_inside
    pods = [f"{p.host}:{p.port}" for p in patient_stack.pods]
    picks_before = sum(router_picks(patient_stack, pod) for pod in pods)
    admitted_before, refused_before = admissions(patient_stack)
    headers = {"authorization": f"Bearer {api_key(patient_stack, 'free')}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with aiohttp.ClientSession(headers=headers) as session:

        async def one() -> int:
            async with session.post(f"{patient_stack.base_url}/chat/completions", json=body) as r:
                await r.read()
                return r.status

        statuses = await asyncio.gather(*(one() for _ in range(200)))  # 4x the tier's 50/s
    # Refused: over the rate (429), or shed while a busy machine queued the checks (503).
    refused = statuses.count(429) + statuses.count(503)
    # How many a burst leaves refused is the machine's too (a slow one spreads it over more of
    # the tier's seconds: 98 of 200 beside a second suite): the premise is only that many were.
    assert refused >= 50 and statuses.count(200) >= 20, statuses
    assert set(statuses) <= {200, 429, 503}, statuses
    picks = sum(router_picks(patient_stack, pod) for pod in pods) - picks_before
    admitted, refused_by_limiter = (
        a - b
        for a, b in zip(admissions(patient_stack), (admitted_before, refused_before), strict=True)
    )
    # The limiter refused some: without the give-back, their picks would count too.
    assert refused_by_limiter >= 1 and statuses.count(429) >= 1, statuses
    # Exactly the admitted are picked. Not exactly those answered 200: on a busy machine Envoy
    # can give up on a check (503) that extauthz admits after all, and that pick counts.
    assert picks == admitted
    assert statuses.count(200) <= picks
    await eventually_async(  # entries flush every 0.2 s
        lambda: not any(router_metric(patient_stack, "llmgw_router_in_flight", p) for p in pods),
        5.0,
        "picks still in flight after their requests ended",
        every_s=0.1,
    )
    # Envoy's default log buffer (16 KiB a logger) dropped entries of such a burst. Both gRPC
    # loggers took every entry the file log has: the burst's, and any other caller's (a fresh
    # clone once counted 203 entries for the 200: on a shared machine the listener's port is not
    # this test's alone), listed if they differ.
    await eventually_async(
        lambda: len(logged_entries(patient_stack)) >= len(statuses), 10.0, "the burst unlogged"
    )
    entries = logged_entries(patient_stack)
    stats = patient_stack.envoy_stats()
    assert stats["access_logs.grpc_access_log.logs_dropped"] == 0
    written = stats["access_logs.grpc_access_log.logs_written"]
    others = [e for e in entries if e.get("tenant") != "free"]
    assert written == 2 * len(entries), (written, len(entries), len(statuses), others)


def logged_entries(stack: Stack) -> list[dict[str, Any]]:
    """The file access log's entries (flushed every 0.2 s)."""
    lines = stack.access_log.read_text().splitlines() if stack.access_log.exists() else []
    return [json.loads(line) for line in lines]


@pytest.fixture
def apart_stack(tmp_path: Path) -> Iterator[Stack]:
    """The router in its own process behind ext_proc (`python -m router`): the epp topology."""
    settings = stack_settings(pods=3).model_copy(update={"topology": Topology.EPP})
    with Stack(settings, tmp_path / "stack") as running:
        yield running


async def test_killing_the_router_apart_mid_load_fails_no_request(apart_stack: Stack) -> None:
    router = next(p for p in apart_stack.processes if p.name == "router")
    pods = [f"{p.host}:{p.port}" for p in apart_stack.pods]
    before = sum(router_picks(apart_stack, pod) for pod in pods)

    async def kill(done: int) -> None:
        if done == 40:
            # The router was picking (a busy machine lets ext_proc's 0.2 s pass for some, and
            # Envoy's fallback picks those): killing it is not a no-op.
            assert sum(router_picks(apart_stack, pod) for pod in pods) - before > 0
            router.kill()

    # As many requests after the kill as before it, however long a busy machine takes.
    done, failures = await load(apart_stack, 120.0, 8, kill, until=80)
    assert router.popen is not None and router.popen.poll() is not None
    assert done >= 80 and failures == []


def test_two_router_replicas_keep_sessions_on_one_pod(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two stacks (two Envoys, two routers) in front of the same pods; turns alternate."""
    for name, value in PATIENT_SCRAPES.items():
        monkeypatch.setenv(name, value)
    alone = {"services": ("router",), "topology": Topology.EPP}  # the router alone
    first = stack_settings(pods=3).model_copy(update=alone)
    with Stack(first, tmp_path / "a") as a:
        second = StackSettings.model_validate(
            first.model_dump()
            | {
                "pods": 0,
                "upstreams": tuple(a.pod_url(i) for i in range(3)),
                "pod_api_key": a.pod_api_key,
            }
        )
        with Stack(second, tmp_path / "b") as b:
            for n in range(4):
                _, pods = converse([a, b], turns=4, session=f"sess_replicas_{n}")
                assert len(set(pods[1:])) == 1, pods  # the first turn has no affinity yet
