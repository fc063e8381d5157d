"""Flow control's isolation benchmark: queue off against queue on, one run, one table.

Two stacks, both up for the whole run (`LLMGW_EXTAUTHZ__FLOW__ENABLED` false in one, true in the
other; the one without the queue as the gateway was before it: no request asks for its outcome at
once, so Envoy batches them all every 0.2 s), each on `--pods` simulated pods of `--seats` seats
(the sim's --max-num-seqs and the router's fleet capacity), at `--time-scale`, small enough that
this machine saturates them. Only one stack has load at a time; the other idles meanwhile (its
services' few % of CPU at rest, as printed last). Each stack runs the same phases, every request a
distinct stream (a random first block: no prefix-cache hits), answers exactly `max_tokens` long
(ignore_eos), closed loops unless said otherwise:

- steady: the fleet NOT saturated: `--steady-rate` short streams a second (open loop); CPU
  seconds of extauthz (the check, with the limiter and router inside) and of Envoy, each with its
  threads and children, divided by the requests. The one phase where the arms take turns:
  `--steady-rounds` rounds of `--steady-seconds` s per arm, in ABBA order (off on, on off, off
  on, ...), so that the machine's drift (other work on a shared box, a minute apart between two
  arms run one after the other: on/off ratios of 0.86 to 1.39 for the same work) weighs on both
  arms alike. CPU and requests are summed per arm over its rounds, the on/off ratio taken of the
  sums; the spread of the ratios of each round's pair (min to max) shows the noise left.
- alone: the light tenant (`--light` streams) and the priority tenant (platinum, priority 9,
  `--light` streams) without the flood: their baseline TTFT (a few seats of many: neither waits
  for the other).
- flood: a flooding tenant of the light tenant's priority keeps `--flood` long streams in
  flight; after `--ramp` s the light and priority tenants run as in `alone` for `--window` s;
  their TTFT against `alone`'s, the flooder's share of the tokens served meanwhile.
- fairness: two equal-priority tenants, `--fair` streams each (both backlogged), one with
  prompts `--long-factor` times longer; Jain's index of their tokens served (prompt + output;
  output only too) over `--window` s after `--ramp` s.

The steady rounds come first (after each stack's warm-up and CPU at rest); then the other phases,
every one of the off arm's, then the on arm's.

Tokens served: per request, its output tokens as they stream within the phase's window and its
prompt's (from usage) if its first token came within it: requests cut at a window's end count
what they got. 5xx answers other than shedding (503 `overloaded`) are counted over every phase.
Also printed: the steady rounds one by one, each phase's tenants in detail, how many seats the
pods ran (sampled), the services' CPU at rest, and, with the queue on, extauthz's flow metrics per
phase: dispatches at once or through the queue (queued="true": it found others waiting or no
seat, however briefly it then waited) and the queue-wait histogram per priority band.

    python -m bench.flow [--pods 2] [--seats 8] [--time-scale 0.5] [--window 15] [--flood 48]
                         [--steady-rounds 6] [--steady-seconds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import resource
import statistics
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import uvloop

from bench.cpu import cpu_seconds
from bench.loadgen import Head
from extauthz import tenants
from extauthz.types import Tenant, TenantsFile
from llmgw import wire
from tools.envoyconf import Address
from tools.stack import Stack, StackSettings

ARMS = {"off": False, "on": True}  # flow control (its queue) off, on
PHASES = ("steady", "alone", "flood", "fairness")
# Tenant: (tier, priority). The flooder and the light tenant share a band; so do the two fair ones.
TENANTS = {
    "steady": ("standard", 5),
    "light": ("standard", 5),
    "priority": ("platinum", 9),
    "flood": ("standard", 5),
    "fair-short": ("standard", 5),
    "fair-long": ("standard", 5),
}
ROOMY = "    requests: {second: 100000, minute: 10000000}\n    tokens: {minute: 10000000000}\n"
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india")
REQUEST_TIMEOUT_S = 60.0  # any one request
DRAIN_TIMEOUT_S = 30.0  # the fleet and the queue idle between phases
LOAD_TIMEOUT_S = 10.0  # extauthz has the new tenants
SAMPLE_EVERY_S = 0.5  # the pods' running and waiting gauges
SHED = (503, "overloaded")
IDLE_S = 2.0  # the services' CPU without load, before the phases
# After a steady round's last answer: its access-log entries (flushed every 20 ms to the router,
# every 200 ms to Envoy's file) are handled within the round, counted in its arm.
SETTLE_S = 0.5


def tenant_id(name: str) -> str:
    return f"fb-{name}"


def tiers_yaml() -> str:
    """Every benchmark tenant's limits far above what it sends: no rate limit ever bites."""
    return "tenants:\n" + "".join(f"  {tenant_id(n)}:\n{ROOMY}" for n in TENANTS)


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """`values` in this process's environment (the services started meanwhile inherit it)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def get(url: str, key: str | None = None) -> tuple[int, bytes]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def add_tenants(stack: Stack) -> dict[str, str]:
    """The benchmark's tenants with one key each (as tests/e2e/test_isolation.py adds them), once
    extauthz has them (bounded wait). Returns name → API key."""
    keys: dict[str, str] = {}
    with tenants.editing(stack.tenants_file):
        data = tenants.read(stack.tenants_file)
        added = []
        for name, (tier, priority) in TENANTS.items():
            key, record = tenants.new_key(datetime.now(UTC).replace(microsecond=0))
            keys[name] = key
            tid = tenant_id(name)
            added.append(
                Tenant(id=tid, name=tid, tier=tier, priority=priority, models="*", keys=(record,))
            )
        tenants.write(stack.tenants_file, TenantsFile(tenants=(*data.tenants, *added)))
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    for key in keys.values():
        while get(f"{stack.base_url}/models", key)[0] == 401:
            if time.monotonic() > deadline:
                raise RuntimeError("extauthz did not load the benchmark's tenants")
            time.sleep(0.05)
    return keys


# One request, as the client saw it.


@dataclass(frozen=True, slots=True)
class Window:
    """Absolute perf_counter seconds: what streams within it counts as served."""

    start: float
    end: float


@dataclass(slots=True)
class Outcome:
    tenant: str
    window: Window
    start: float = 0.0
    status: int = 0  # 0: no answer (cut at the phase's end, or the connection failed)
    code: str = ""  # the error's code, for a refusal
    done: bool = False
    first_at: float = 0.0  # when the first content event came (0: none)
    ttft: float = float("nan")
    queue_ms: float = float("nan")  # the gateway's x-llmgw-queue-ms
    out_in_window: int = 0
    out_total: int = 0  # against usage's completion_tokens: the count's own check
    prompt_tokens: int = -1  # from usage; -1: no usage seen
    completion_tokens: int = -1
    _pending: bytearray = field(default_factory=bytearray)

    def feed(self, data: bytes, now: float) -> None:
        """Stream bytes: complete lines are counted, the rest waits for the next chunk."""
        self._pending += data
        cut = self._pending.rfind(b"\n")
        if cut < 0:
            return
        lines = bytes(self._pending[: cut + 1])
        del self._pending[: cut + 1]
        events = lines.count(b'"content"')
        if events and not self.first_at:
            self.first_at, self.ttft = now, now - self.start
        tokens = events - lines.count(b'"role"')  # the role chunk's content is empty
        self.out_total += tokens
        if self.window.start <= now <= self.window.end:
            self.out_in_window += tokens
        if b'"usage"' in lines:
            for line in lines.split(b"\n"):
                if line.startswith(b"data: {") and b'"usage"' in line:
                    usage = json.loads(line[6:]).get("usage") or {}
                    self.prompt_tokens = int(usage.get("prompt_tokens", -1))
                    self.completion_tokens = int(usage.get("completion_tokens", -1))

    @property
    def ok(self) -> bool:
        return self.done and self.status == 200

    @property
    def first_in_window(self) -> bool:
        return self.window.start <= self.first_at <= self.window.end

    @property
    def server_error(self) -> bool:
        """A 5xx that is not shedding."""
        return self.status >= 500 and (self.status, self.code) != SHED


class Conn:
    """One keep-alive HTTP/1.1 connection to Envoy (raw asyncio: a cheap client)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, host: str, port: int) -> Conn:
        return cls(*await asyncio.open_connection(host, port))

    def close(self) -> None:
        self.writer.close()

    async def exchange(self, request: bytes, o: Outcome) -> bool:
        """Send one request, fill `o` as the answer comes; False: the connection is done."""
        o.start = time.perf_counter()
        self.writer.write(request)
        head = await Head.read(self.reader)
        o.status, length, keep = head.status, head.length, head.keep
        queue_ms = head.headers.get(wire.HEADER_QUEUE_MS.encode())
        if queue_ms is not None:
            with contextlib.suppress(ValueError):
                o.queue_ms = float(queue_ms)
        body = bytearray()
        if head.chunked:
            while True:
                size = int((await self.reader.readline()).split(b";", 1)[0], 16)
                if size == 0:
                    await self.reader.readuntil(b"\r\n")
                    break
                data = (await self.reader.readexactly(size + 2))[:-2]
                if o.status == 200:
                    o.feed(data, time.perf_counter())
                else:
                    body += data
        elif length >= 0:
            body += await self.reader.readexactly(length)
        else:
            body += await self.reader.read()
            keep = False
        if o.status == 200:
            o.feed(b"\n", time.perf_counter())
        else:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                o.code = str(json.loads(body)["error"]["code"])
        o.done = True
        return keep


# Load: closed loops of streams per tenant, or an open loop.


@dataclass(frozen=True)
class Group:
    """One tenant's share of a phase's load."""

    tenant: str
    key: str
    concurrency: int
    prompt_tokens: int
    max_tokens: int


class Client:
    def __init__(self, host: str, port: int, model: str, seed: int) -> None:
        self.host, self.port, self.model = host, port, model
        self.rng = random.Random(seed)
        self.filler = " ".join(WORDS[i % len(WORDS)] for i in range(20_000))

    def request(self, g: Group) -> bytes:
        """A distinct prompt of about `g.prompt_tokens` tokens (4 characters a token)."""
        prompt = f"{self.rng.getrandbits(64):016x} " + self.filler[: g.prompt_tokens * 4 - 17]
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": g.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        payload = json.dumps(body).encode()
        return (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
            f"authorization: Bearer {g.key}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n\r\n"
        ).encode() + payload

    async def one(self, conn: Conn | None, g: Group, o: Outcome) -> Conn | None:
        """One request on `conn` (a new one if None); the connection to reuse, or None."""
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                conn = conn or await Conn.open(self.host, self.port)
                if await conn.exchange(self.request(g), o):
                    return conn
        except (OSError, asyncio.IncompleteReadError, ValueError, TimeoutError):
            pass
        if conn is not None:
            conn.close()
        return None

    async def loop(self, g: Group, stop_at: float, window: Window, out: list[Outcome]) -> None:
        """`g.concurrency` workers, each sending its next request as its last ends, until
        `stop_at` (perf_counter); a request under way then is finished (or cancelled with the
        task). Worker i starts i / concurrency s late, so that streams do not end in bursts."""

        async def worker(i: int) -> None:
            conn: Conn | None = None
            try:
                await asyncio.sleep(i / g.concurrency)
                while time.perf_counter() < stop_at:
                    o = Outcome(g.tenant, window)
                    out.append(o)
                    conn = await self.one(conn, g, o)
            finally:
                if conn is not None:
                    conn.close()

        await asyncio.gather(*(worker(i) for i in range(g.concurrency)))

    async def paced(self, g: Group, rate: float, seconds: float, out: list[Outcome]) -> None:
        """Open loop: request i starts at i / rate, on an idle connection (else a new one)."""
        start = time.perf_counter()
        window = Window(start, start + seconds + REQUEST_TIMEOUT_S)
        idle: list[Conn] = []

        async def send() -> None:
            o = Outcome(g.tenant, window)
            out.append(o)
            conn = await self.one(idle.pop() if idle else None, g, o)
            if conn is not None:
                idle.append(conn)

        tasks = []
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(send()))
        await asyncio.gather(*tasks)
        for conn in idle:
            conn.close()


async def cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# What the stack says: Prometheus text, the pods' seats.

SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})? (\S+)$", re.M)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    status, body = get(url)
    if status != 200:
        return {}
    return {
        (name, frozenset(LABEL.findall(labels or ""))): float(value)
        for name, labels, value in SAMPLE.findall(body.decode())
    }


def delta(after: Samples, before: Samples) -> Samples:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def total(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def seats_in_use(stack: Stack, pods: int) -> tuple[float, float]:
    """The pods' running and waiting requests now, summed over the fleet."""
    running = waiting = 0.0
    for i in range(pods):
        s = scrape(f"{stack.pod_url(i)}/metrics")
        running += total(s, "vllm:num_requests_running")
        waiting += total(s, "vllm:num_requests_waiting")
    return running, waiting


def queued_now(stack: Stack) -> float:
    return total(scrape(stack.metrics["extauthz"]), "llmgw_flow_queue_length")


# Phases.


@dataclass
class Phase:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    window_s: float = 0.0
    wall_s: float = 0.0
    client_cpu_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # extauthz, envoy
    seats: list[tuple[float, float]] = field(default_factory=list)  # (running, waiting) samples
    flow: Samples = field(default_factory=dict)  # extauthz's metrics, the phase's delta

    def of(self, tenant: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.tenant == tenant]

    def prompt_of(self, tenant: str) -> int:
        """The tenant's prompt tokens per request (every one of its prompts is as long)."""
        seen = [o.prompt_tokens for o in self.of(tenant) if o.prompt_tokens >= 0]
        return int(statistics.median(seen)) if seen else 0

    def tokens(self, tenant: str, output_only: bool = False) -> int:
        """What the tenant was served within the window."""
        prompt = 0 if output_only else self.prompt_of(tenant)
        return sum(o.out_in_window + (prompt if o.first_in_window else 0) for o in self.of(tenant))

    def ttft(self, tenant: str, q: float) -> float:
        return pct([o.ttft for o in self.of(tenant) if o.ok], q)

    def tenants(self) -> list[str]:
        return list(dict.fromkeys(o.tenant for o in self.outcomes))


def pct(values: list[float], q: float) -> float:
    values = [v for v in values if v == v]
    return float(np.percentile(values, q)) if values else float("nan")


class Run:
    """One stack's phases."""

    def __init__(self, stack: Stack, args: argparse.Namespace, keys: dict[str, str]) -> None:
        self.stack, self.args, self.keys = stack, args, keys
        self.roots = {
            p.name: p.pid for p in stack.processes if p.name in ("extauthz", "envoy") and p.pid
        }
        model = json.loads(get(f"{stack.base_url}/models", keys["light"])[1])["data"][0]["id"]
        self.client = Client(stack.listen.host, stack.listen.port, model, args.seed)
        self.phases: dict[str, Phase] = {}
        self.idle_cpu: dict[str, float] = {}  # CPU seconds a second, no load

    def group(self, tenant: str, concurrency: int, prompt: int, out: int) -> Group:
        return Group(tenant, self.keys[tenant], concurrency, prompt, out)

    async def measured(
        self, name: str, body: Callable[[Phase], Awaitable[None]]
    ) -> dict[str, float]:
        """The phase's load (`body`), with the stack's metrics, CPU and seats around it; a phase
        measured again (a steady round) adds to what it has. Returns this time's CPU seconds."""
        await self.drain()
        phase = self.phases.setdefault(name, Phase(name))
        flow0, cpu0, client0 = self.flow(), cpu_seconds(self.roots), time.process_time()
        start = time.perf_counter()
        sampler = asyncio.create_task(self.sample(phase))
        try:
            await body(phase)
        finally:
            await cancel([sampler])
        phase.wall_s += time.perf_counter() - start
        cpu1 = cpu_seconds(self.roots)
        cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
        for k, v in cpu.items():
            phase.cpu_s[k] = phase.cpu_s.get(k, 0.0) + v
        phase.client_cpu_s += time.process_time() - client0
        for sample, v in delta(self.flow(), flow0).items():
            phase.flow[sample] = phase.flow.get(sample, 0.0) + v
        return cpu

    def flow(self) -> Samples:
        return {k: v for k, v in scrape(self.stack.metrics["extauthz"]).items() if "flow" in k[0]}

    async def sample(self, phase: Phase) -> None:
        """Until cancelled with its phase (or, a bound, an hour later)."""
        deadline = time.monotonic() + 3600
        while time.monotonic() < deadline:
            phase.seats.append(await asyncio.to_thread(seats_in_use, self.stack, self.args.pods))
            await asyncio.sleep(SAMPLE_EVERY_S)

    async def drain(self) -> None:
        """Until the pods run nothing and nothing is queued (bounded), then the access log's
        outcomes a flush later."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            busy = await asyncio.to_thread(seats_in_use, self.stack, self.args.pods)
            if busy == (0.0, 0.0) and await asyncio.to_thread(queued_now, self.stack) == 0:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)

    def short(self, tenant: str, concurrency: int) -> Group:
        a = self.args
        return self.group(tenant, concurrency, a.short_prompt, a.short_tokens)

    async def warm(self) -> None:
        """Not measured: every tenant's first requests, the connections, the pods' first steps."""
        now = time.perf_counter()
        out: list[Outcome] = []
        stop = now + 2.0
        await asyncio.gather(
            *(self.client.loop(self.short(t, 2), stop, Window(now, stop), out) for t in TENANTS)
        )

    async def rest(self) -> None:
        """The services' CPU without load (the other stack idle too)."""
        cpu0 = cpu_seconds(self.roots)
        await asyncio.sleep(IDLE_S)
        self.idle_cpu = {k: (v - cpu0[k]) / IDLE_S for k, v in cpu_seconds(self.roots).items()}

    async def steady_round(self) -> Round:
        """One round of the steady phase: its requests, the CPU they cost."""
        before = len(self.phases["steady"].outcomes) if "steady" in self.phases else 0
        cpu = await self.measured("steady", self.steady)
        return Round(len(self.phases["steady"].outcomes) - before, cpu)

    async def steady(self, phase: Phase) -> None:
        a = self.args
        phase.window_s += a.steady_seconds
        g = self.short("steady", 1)
        await self.client.paced(g, a.steady_rate, a.steady_seconds, phase.outcomes)
        await asyncio.sleep(SETTLE_S)

    async def alone(self, phase: Phase) -> None:
        a = self.args
        now = time.perf_counter()
        window = Window(now, now + a.window)
        phase.window_s = a.window
        await asyncio.gather(
            *(
                self.client.loop(self.short(t, a.light), window.end, window, phase.outcomes)
                for t in ("light", "priority")
            )
        )

    async def flood(self, phase: Phase) -> None:
        a = self.args
        now = time.perf_counter()
        window = Window(now + a.ramp, now + a.ramp + a.window)
        phase.window_s = a.window
        g = self.group("flood", a.flood, a.flood_prompt, a.flood_tokens)
        stop = window.end + REQUEST_TIMEOUT_S  # a bound: it is cancelled once the others end
        flood = [asyncio.create_task(self.client.loop(g, stop, window, phase.outcomes))]
        try:
            await asyncio.sleep(a.ramp)
            await asyncio.gather(
                *(
                    self.client.loop(self.short(t, a.light), window.end, window, phase.outcomes)
                    for t in ("light", "priority")
                )
            )
        finally:
            await cancel(flood)

    async def fairness(self, phase: Phase) -> None:
        a = self.args
        now = time.perf_counter()
        window = Window(now + a.ramp, now + a.ramp + a.window)
        phase.window_s = a.window
        groups = [
            self.group("fair-short", a.fair, a.fair_prompt, a.fair_tokens),
            self.group("fair-long", a.fair, a.fair_prompt * a.long_factor, a.fair_tokens),
        ]
        loops = [
            asyncio.create_task(self.client.loop(g, window.end, window, phase.outcomes))
            for g in groups
        ]
        try:
            await asyncio.sleep(window.end - time.perf_counter())
        finally:
            await cancel(loops)  # the streams under way end at the window's end

    async def rest_of_phases(self) -> None:
        """Every phase but steady's, one after the other."""
        bodies = {"alone": self.alone, "flood": self.flood, "fairness": self.fairness}
        for name in PHASES:
            if name in bodies:
                await self.measured(name, bodies[name])


@dataclass(frozen=True)
class Round:
    """One arm's turn in one steady round."""

    requests: int
    cpu_s: dict[str, float]  # extauthz, envoy

    def ms(self, process: str) -> float:
        """CPU ms per request."""
        return 1e3 * ratio(self.cpu_s[process], self.requests)


async def interleaved(runs: dict[str, Run], rounds: int) -> dict[str, list[Round]]:
    """The steady phase, the arms taking turns: round r runs off then on if r is even, else on
    then off (ABBA): a drift of the machine's speed over the rounds weighs on both arms alike."""
    out: dict[str, list[Round]] = {arm: [] for arm in runs}
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for arm in order:
            out[arm].append(await runs[arm].steady_round())
    return out


async def bench(
    runs: dict[str, Run], args: argparse.Namespace, started: float
) -> dict[str, list[Round]]:
    """Both stacks up; one stack's load at a time. Returns the steady rounds per arm."""
    for run in runs.values():
        await run.warm()
        await run.drain()
        await run.rest()
    rounds = await interleaved(runs, args.steady_rounds)
    print(f"steady rounds: done at {time.monotonic() - started:.0f} s", flush=True)
    for arm, run in runs.items():
        await run.rest_of_phases()
        print(f"queue {arm}: done at {time.monotonic() - started:.0f} s", flush=True)
    return rounds


@contextlib.contextmanager
def arm_stack(arm: str, args: argparse.Namespace, root: Path) -> Iterator[Run]:
    """The arm's stack with the benchmark's tenants, up until the block ends (stopped however it
    ends)."""
    tiers = root / f"tiers-{arm}.yaml"
    tiers.write_text(tiers_yaml())
    settings = StackSettings(
        listen=Address(port=0),
        pods=args.pods,
        sim_args=("--time-scale", str(args.time_scale), "--max-num-seqs", str(args.seats)),
        tiers_file=tiers,
    )
    env = {
        "LLMGW_EXTAUTHZ__FLOW__ENABLED": str(ARMS[arm]).lower(),
        "LLMGW_ROUTER__FLEET__CAPACITY": str(args.seats),  # the router's seats: max_num_seqs
    }
    with contextlib.ExitStack() as running:
        with environ(env):  # only the services started here see it
            stack = running.enter_context(Stack(settings, root / arm))
        yield Run(stack, args, add_tenants(stack))


# The report.


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else 0.0


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


@dataclass(frozen=True)
class Row:
    metric: str
    off: float | None  # None: not applicable
    on: float
    target: str
    met: bool | None  # None: no target
    fmt: str = "{:.2f}"


def pair_ratios(rounds: dict[str, list[Round]], process: str) -> list[float]:
    """Each steady round's on/off ratio of CPU per request."""
    pairs = zip(rounds["off"], rounds["on"], strict=True)
    return [ratio(on.ms(process), off.ms(process)) for off, on in pairs]


def rows(arms: dict[str, dict[str, Phase]], rounds: dict[str, list[Round]]) -> list[Row]:
    def per_arm(f: Callable[[dict[str, Phase]], float]) -> tuple[float, float]:
        return f(arms["off"]), f(arms["on"])

    def ttft_ratio(tenant: str, q: float) -> Callable[[dict[str, Phase]], float]:
        return lambda p: ratio(p["flood"].ttft(tenant, q), p["alone"].ttft(tenant, q))

    def flood_share(p: dict[str, Phase]) -> float:
        f = p["flood"]
        return ratio(f.tokens("flood"), sum(f.tokens(t) for t in f.tenants()))

    def fair(output_only: bool) -> Callable[[dict[str, Phase]], float]:
        return lambda p: jain(
            [float(p["fairness"].tokens(t, output_only)) for t in ("fair-short", "fair-long")]
        )

    def errors(p: dict[str, Phase]) -> float:
        return sum(o.server_error for ph in p.values() for o in ph.outcomes)

    def cpu_ms(process: str) -> Callable[[dict[str, Phase]], float]:
        return lambda p: 1e3 * ratio(p["steady"].cpu_s[process], len(p["steady"].outcomes))

    out: list[Row] = []
    for tenant, limit in (("light", 2.0), ("priority", 1.5)):
        p50 = per_arm(ttft_ratio(tenant, 50))
        p90 = per_arm(ttft_ratio(tenant, 90))
        out.append(Row(f"{tenant} TTFT p50, flood / alone", *p50, "-", None, "{:.2f}x"))
        out.append(
            Row(f"{tenant} TTFT p90, flood / alone", *p90, f"<= {limit:g}x", p90[1] <= limit,
                "{:.2f}x")
        )  # fmt: skip
    share = per_arm(flood_share)
    out.append(Row("flooder's share of tokens served (flood)", *share, "-", None, "{:.1%}"))
    j = per_arm(fair(False))
    out.append(Row("Jain, prompt+output tokens (fairness)", *j, ">= 0.9", j[1] >= 0.9, "{:.3f}"))
    jo = per_arm(fair(True))
    out.append(Row("Jain, output tokens only (fairness)", *jo, "-", None, "{:.3f}"))
    e = per_arm(errors)
    out.append(Row("5xx other than shed (all phases)", *e, "0", e[1] == 0, "{:.0f}"))
    for process in ("extauthz", "envoy"):
        ms = per_arm(cpu_ms(process))
        r = ratio(ms[1], ms[0])
        pairs = pair_ratios(rounds, process)
        spread = f"{min(pairs):.2f}-{max(pairs):.2f}" if pairs else "-"
        out.append(Row(f"{process} CPU ms/request (steady)", *ms, "-", None, "{:.3f}"))
        out.append(
            Row(f"{process} CPU/request, on / off (round pairs {spread})", None, r, "0.95-1.05",
                abs(r - 1) <= 0.05, "{:.3f}")
        )  # fmt: skip
    return out


def table(arms: dict[str, dict[str, Phase]], rounds: dict[str, list[Round]]) -> str:
    lines = ["| metric | off | on | target | met |", "|---|---|---|---|---|"]
    for r in rows(arms, rounds):
        met = "-" if r.met is None else ("yes" if r.met else "**no**")
        off = "-" if r.off is None else r.fmt.format(r.off)
        lines.append(f"| {r.metric} | {off} | {r.fmt.format(r.on)} | {r.target} | {met} |")
    lines.append("")
    lines.append("`met` judges the `on` column (the queue); the ratios are each arm against its")
    lines.append("own `alone` phase; CPU ratios divide `on` by `off`, summed over the steady")
    lines.append("rounds; in brackets, the lowest and highest ratio of one round's pair.")
    return "\n".join(lines)


def rounds_table(rounds: dict[str, list[Round]]) -> str:
    """Each steady round: both arms' CPU ms per request and their ratio."""
    lines = [
        "| round | order | extauthz off | extauthz on | on / off | envoy off | envoy on | "
        "on / off | requests off / on |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, (off, on) in enumerate(zip(rounds["off"], rounds["on"], strict=True)):
        cells = [str(i + 1), " ".join(ARMS if i % 2 == 0 else reversed(ARMS))]
        for process in ("extauthz", "envoy"):
            a, b = off.ms(process), on.ms(process)
            cells += [f"{a:.3f}", f"{b:.3f}", f"{ratio(b, a):.3f}"]
        cells.append(f"{off.requests} / {on.requests}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for process in ("extauthz", "envoy"):
        pairs = pair_ratios(rounds, process)
        if pairs:
            lines.append(
                f"- {process}: on / off per round pair: min {min(pairs):.3f}, median "
                f"{statistics.median(pairs):.3f}, max {max(pairs):.3f}"
            )
    return "\n".join(lines)


def throughput(arms: dict[str, dict[str, Phase]]) -> str:
    lines = [
        "| phase | off tokens (tok/s) | on tokens (tok/s) | on vs off | off out (tok/s) | "
        "on out (tok/s) | seats used off / on |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in PHASES:
        cells = []
        for output_only in (False, True):
            for arm in ARMS:
                p = arms[arm][name]
                n = sum(p.tokens(t, output_only) for t in p.tenants())
                cells.append((n, n / p.window_s if p.window_s else 0.0))
        (off, off_s), (on, on_s), (_, off_o), (_, on_o) = cells
        seats = " / ".join(f"{running(arms[arm][name]):.1f}" for arm in ARMS)
        lines.append(
            f"| {name} | {off} ({off_s:.0f}) | {on} ({on_s:.0f}) | {ratio(on, off) - 1:+.1%} | "
            f"{off_o:.0f} | {on_o:.0f} | {seats} |"
        )
    return "\n".join(lines)


def running(p: Phase) -> float:
    return statistics.fmean(r for r, _ in p.seats) if p.seats else float("nan")


def details(arms: dict[str, dict[str, Phase]]) -> str:
    lines = [
        f"{'arm':<4}{'phase':<10}{'tenant':<11}{'reqs':>5}{'ok':>5}{'429':>5}{'shed':>5}"
        f"{'5xx':>5}{'cut':>5}{'ttft50':>8}{'ttft90':>8}{'ttft99':>8}{'q50':>7}{'q90':>7}"
        f"{'prompt':>7}{'tokens':>9}{'tok/s':>7}",
    ]
    for arm, phases in arms.items():
        for name, p in phases.items():
            for t in p.tenants():
                os_ = p.of(t)
                q = [o.queue_ms for o in os_ if o.ok]
                lines.append(
                    f"{arm:<4}{name:<10}{t:<11}{len(os_):>5}{sum(o.ok for o in os_):>5}"
                    f"{sum(o.status == 429 for o in os_):>5}"
                    f"{sum((o.status, o.code) == SHED for o in os_):>5}"
                    f"{sum(o.server_error for o in os_):>5}{sum(not o.done for o in os_):>5}"
                    f"{1e3 * p.ttft(t, 50):>8.0f}{1e3 * p.ttft(t, 90):>8.0f}"
                    f"{1e3 * p.ttft(t, 99):>8.0f}{pct(q, 50):>7.0f}{pct(q, 90):>7.0f}"
                    f"{p.prompt_of(t):>7}{p.tokens(t):>9}{p.tokens(t) / p.window_s:>7.0f}"
                )
            seats = "no samples"
            if p.seats:
                waiting = statistics.fmean(w for _, w in p.seats)
                seats = f"{running(p):.1f} running, {waiting:.1f} waiting (mean)"
            codes = sorted({o.code for o in p.outcomes if o.status not in (0, 200)})
            off = sum(o.ok and o.out_total != o.completion_tokens for o in p.outcomes)
            cpu = ", ".join(f"{k} {v:.1f}" for k, v in sorted(p.cpu_s.items()))
            lines.append(
                f"    {arm} {name}: {p.wall_s:.1f} s wall, window {p.window_s:.0f} s; pods: "
                + seats
                + f"; CPU s: {cpu}, client {p.client_cpu_s:.1f}; refusal codes {codes or '-'}"
                + f"; streams whose events != usage: {off}"
            )
    return "\n".join(lines)


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """The upper bound of the histogram bucket that holds quantile q (cumulative buckets)."""
    if not buckets or buckets[-1][1] <= 0:
        return float("nan")
    for le, count in buckets:
        if count >= q * buckets[-1][1]:
            return le
    return float("inf")


DISPATCHES = "llmgw_flow_dispatches_total"  # queued="true": it went through the queue
REFUSALS = "llmgw_flow_refusals_total"
WAIT = "llmgw_flow_queue_wait_seconds"


def flow_report(phases: dict[str, Phase]) -> str:
    """extauthz's flow metrics per phase (queue on): which path dispatches took, queue waits."""
    lines = []
    for name, p in phases.items():
        parts = []
        for t in p.tenants():
            tid = tenant_id(t)
            at_once = total(p.flow, DISPATCHES, tenant=tid, queued="false")
            waited = total(p.flow, DISPATCHES, tenant=tid, queued="true")
            refused = {
                dict(ls)["reason"]: v
                for (n, ls), v in p.flow.items()
                if n == REFUSALS and dict(ls).get("tenant") == tid and v
            }
            why = ", ".join(f"{k} {v:.0f}" for k, v in sorted(refused.items())) or "none"
            parts.append(f"{t} {at_once:.0f} at once, {waited:.0f} via the queue, left: {why}")
        lines.append(f"  {name}: dispatches: {'; '.join(parts)}")
        bands = sorted({dict(ls).get("band", "") for (n, ls) in p.flow if n.startswith(WAIT)})
        for band in bands:
            count = total(p.flow, WAIT + "_count", band=band)
            if not count:
                continue
            mean = total(p.flow, WAIT + "_sum", band=band) / count
            les = sorted({dict(ls)["le"] for (n, ls) in p.flow if n.endswith("_bucket")}, key=float)
            buckets = [(float(le), total(p.flow, WAIT + "_bucket", band=band, le=le)) for le in les]
            zero = total(p.flow, WAIT + "_bucket", band=band, le="0.001")
            lines.append(
                f"    band {band}: {count:.0f} dispatched, {zero:.0f} waited < 1 ms; wait mean "
                f"{1e3 * mean:.0f} ms, p50 <= {quantile(buckets, 0.5) * 1e3:.0f} ms, "
                f"p90 <= {quantile(buckets, 0.9) * 1e3:.0f} ms"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--pods", type=int, default=2)
    add("--seats", type=int, default=8, help="each pod's max_num_seqs = the router's capacity")
    add("--time-scale", type=float, default=0.5, help="wall seconds per simulated second")
    add("--window", type=float, default=15.0, help="seconds measured per phase")
    add("--ramp", type=float, default=3.0, help="seconds of load before a window")
    add("--flood", type=int, default=48, help="the flooder's streams")
    add("--flood-prompt", type=int, default=200, help="the flood's prompt tokens")
    add("--flood-tokens", type=int, default=512, help="the flood's output tokens")
    add("--light", type=int, default=2, help="the light and priority tenants' streams, each")
    add("--short-prompt", type=int, default=100, help="light, priority, steady prompt tokens")
    add("--short-tokens", type=int, default=16, help="light, priority, steady output tokens")
    add("--fair", type=int, default=16, help="each fair tenant's streams")
    add("--fair-prompt", type=int, default=100, help="the short fair tenant's prompt tokens")
    add("--long-factor", type=int, default=10, help="the long fair tenant's prompts: x longer")
    add("--fair-tokens", type=int, default=128, help="both fair tenants' output tokens")
    add("--steady-rate", type=float, default=40.0, help="steady: requests per second")
    add("--steady-rounds", type=int, default=6, help="steady: rounds, each arm in turn")
    add("--steady-seconds", type=float, default=4.0, help="steady: seconds per round per arm")
    add("--seed", type=int, default=1)
    args = parser.parse_args()
    resource.setrlimit(
        resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    )
    if args.steady_rounds < 1:
        parser.error("--steady-rounds: at least 1")
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stacks:
        runs = {arm: stacks.enter_context(arm_stack(arm, args, Path(tmp))) for arm in ARMS}
        print(f"both stacks up at {time.monotonic() - started:.0f} s", flush=True)
        rounds = uvloop.run(bench(runs, args, started))
    arms = {arm: run.phases for arm, run in runs.items()}
    idle = {arm: run.idle_cpu for arm, run in runs.items()}
    print(
        f"\nflow: {args.pods} pods x {args.seats} seats, time-scale {args.time_scale}; flood "
        f"{args.flood} x ({args.flood_prompt} in, {args.flood_tokens} out), light and priority "
        f"{args.light} each x ({args.short_prompt} in, {args.short_tokens} out), fairness "
        f"{args.fair} + {args.fair} x ({args.fair_prompt} or {args.fair_prompt * args.long_factor}"
        f" in, {args.fair_tokens} out), steady {args.steady_rate:g}/s, {args.steady_rounds} "
        f"rounds of {args.steady_seconds:g} s per arm (ABBA); windows {args.window:g} s\n"
    )
    print(table(arms, rounds))
    print(
        f"\nSteady rounds (CPU ms/request; both stacks up, one loaded at a time; "
        f"{args.steady_rate:g}/s for {args.steady_seconds:g} s per arm and round):\n"
    )
    print(rounds_table(rounds))
    print("\nTokens served per phase (prompt + output within the window; out: output only):\n")
    print(throughput(arms))
    print("\nPer tenant (ms; q: the gateway's x-llmgw-queue-ms; tokens within the window):\n")
    print(details(arms))
    print("\nextauthz flow metrics, queue on:\n")
    print(flow_report(arms["on"]))
    print(f"\nCPU at rest ({IDLE_S:g} s without load, both stacks up, before the phases):")
    for arm, cpu in idle.items():
        print(
            f"  queue {arm}: " + ", ".join(f"{k} {100 * v:.1f} %" for k, v in sorted(cpu.items()))
        )
    print(f"\nwall {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
