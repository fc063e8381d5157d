"""CPU per request per process, and the latency the gateway adds, for every configuration.

One fast fake pod (bench/fakepod.py: raw asyncio, answers at once) behind one stack at a time:
Envoy alone, + extauthz, + ratelimit and + router (both inside extauthz), the full chain (+ ledger,
with PostgreSQL; Envoy checks over HTTP), the full chain checked over gRPC instead, with the rate
limiter apart (its own process behind Envoy's rate-limit filter), and with the router apart
instead (behind ext_proc): each topology (llmgw/topology.py); and each shape with every callout
pointed at trivial handlers (bench/trivial.py: the floor of one HTTP or gRPC check, or two gRPC
callouts, and two access logs); last, the floor of the full chain's shape again, each Check held
idle until it runs at the full chain's req/s. In a closed loop a faster stack is also a cheaper one
per request (each process wakes for more requests at a time), so that row is the floor the full
chain's own work is measured against. For each, a fixed non-stream load (closed
loop, `--requests` at `--concurrency`) and each process's utime+stime from /proc (all threads,
and every child process, e.g. PostgreSQL's backends), before and after, divided by requests.

By default the stack (Envoy `--concurrency 1`, services, Redis, PostgreSQL, pod) is pinned to
one core and the load generator (this process, bench/loadgen.py) to the other, so req/s is
"on one core" and the client's CPU is its own; `--no-pin` leaves the scheduler alone.

Then, with Envoy alone, the full chain (checked over HTTP and over gRPC) and its trivial floor up
side by side: added latency of non-stream requests at a low fixed rate (open loop), and time to
first token at `--streams` concurrent streams of varied length (so that they do not arrive in
bursts), each against direct-to-pod, in alternating rounds; first with the stack still on one
core, then with every process moved to all cores.

    python -m bench.cpu [--requests 3000] [--concurrency 16] [--rate 20] [--streams 16]
    python -m bench.cpu --only "full chain;trivial handlers"   # those CPU rows, no latency tables
    python -m bench.cpu --only "full chain" --no-tls   # without mutual TLS to the services
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import uvloop

from bench import loadgen
from bench.loadgen import Samples, Target
from llmgw import wire
from llmgw.topology import Topology
from tools.envoyconf import Address, EnvoySettings, Services
from tools.procs import Process, StartError, free_port, grpc_serving, http_ok
from tools.stack import ServiceName, Stack, StackSettings

REPO = Path(__file__).resolve().parent.parent
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROMPT = [{"role": "user", "content": "Summarise the plot of a short story in one line."}]
TICK = os.sysconf("SC_CLK_TCK")
T = TypeVar("T")

FULL: tuple[ServiceName, ...] = ("extauthz", "ratelimit", "router", "ledger")


@dataclass(frozen=True)
class Config:
    label: str
    services: tuple[ServiceName, ...] | None  # None: trivial handlers
    note: str  # what the row adds
    topology: Topology = Topology.GATEWAY  # how Envoy checks, what runs apart (llmgw/topology.py)
    paced: bool = False  # trivial handlers held idle to the full chain's req/s


# Rows in table order.
CONFIGS = [
    Config("Envoy alone", (), "no callouts"),
    Config("+ extauthz", ("extauthz",), "ext_authz"),
    Config("+ ratelimit", ("extauthz", "ratelimit"), "admits inside extauthz, Redis"),
    Config("+ router", ("extauthz", "ratelimit", "router"), "picks inside extauthz + access log"),
    Config("full chain", FULL, "+ ledger access log, PostgreSQL"),
    Config(
        "full chain, check over gRPC",
        FULL,
        "ext_authz's gRPC service instead of HTTP (grpc-check)",
        Topology.GRPC_CHECK,
    ),
    Config(
        "full chain, ratelimit apart",
        FULL,
        "+ rate-limit call (python -m ratelimit; rls)",
        Topology.RLS,
    ),
    Config(
        "full chain, router apart",
        FULL,
        "+ ext_proc call (python -m router; epp)",
        Topology.EPP,
    ),
    Config("trivial handlers", None, "1 HTTP check + 2 access logs: the full chain's shape"),
    Config("trivial, check over gRPC", None, "1 gRPC check + 2 access logs", Topology.GRPC_CHECK),
    Config("trivial, rate-limit call", None, "+ rate limit: the rls shape", Topology.RLS),
    Config("trivial, ext_proc call", None, "+ ext_proc: the epp shape", Topology.EPP),
    Config(
        "trivial, at the full chain's rate",
        None,
        "1 callout, each Check held idle: no more CPU, fewer requests a wakeup",
        paced=True,
    ),
]
# Measured in this order (the floors before the full chain, which stays up after; the paced
# floor after it, at its req/s).
ORDER = [0, 1, 2, 3, 5, 6, 7, 9, 10, 11, 8, 4, 12]
COLUMNS = (
    "envoy",
    "extauthz",
    "ratelimit",
    "router",
    "ledger",
    "trivial",
    "redis",
    "postgres",
    "pod",
)
FLOOR = "trivial handlers"
GRPC, GRPC_FLOOR = "full chain, check over gRPC", "trivial, check over gRPC"
RLS, RLS_FLOOR = "full chain, ratelimit apart", "trivial, rate-limit call"
EPP, EPP_FLOOR = "full chain, router apart", "trivial, ext_proc call"
PACED = "trivial, at the full chain's rate"
INDEX = {c.label: i for i, c in enumerate(CONFIGS)}
# Where the stack runs for the latency tables: as in the CPU table, then on every core.
PLACEMENTS = ("stack on 1 core", "unpinned, 2 cores")
# Limits far above this load: every request is admitted (a 429 would skip the pod and the router).
LIMITS = """\
tenants:
  demo-platinum:
    requests: {second: 10000000, minute: 100000000}
    tokens: {minute: 10000000000}
"""


# CPU accounting from /proc.


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid → (ppid, utime+stime+cutime+cstime in ticks) for every process now."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:  # gone meanwhile
            continue
        # After the command: state, ppid, ..., utime (14th field), stime, cutime, cstime.
        table[int(entry)] = (int(fields[1]), sum(int(x) for x in fields[11:15]))
    return table


def _tree(roots: dict[str, int], table: dict[int, tuple[int, int]]) -> dict[str, list[int]]:
    """The pids of each named process and all its descendants."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out = {}
    for name, root in roots.items():
        pids, todo = [], [root]
        while todo:
            pid = todo.pop()
            if pid in table:
                pids.append(pid)
                todo += children.get(pid, [])
        out[name] = pids
    return out


def cpu_seconds(roots: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named process with all its threads and descendants; a child
    reaped meanwhile is in its parent's cutime/cstime, so nothing is lost or counted twice."""
    table = _proc_table()
    return {
        name: sum(table[pid][1] for pid in pids) / TICK
        for name, pids in _tree(roots, table).items()
    }


def set_cores(roots: dict[str, int], cores: set[int]) -> None:
    """Move every thread of the named processes and their descendants to `cores`."""
    for pids in _tree(roots, _proc_table()).values():
        for pid in pids:
            with contextlib.suppress(OSError):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(int(tid), cores)


def self_cpu() -> float:
    t = os.times()
    return t.user + t.system  # this process only: the stack's children are not the client


# The stacks.


class TrivialStack(Stack):
    """The same Envoy configuration with every gRPC service pointed at bench/trivial.py."""

    def __init__(self, settings: StackSettings, state_dir: Path, delay_ms: float = 0.0) -> None:
        super().__init__(settings, state_dir)
        self.delay_ms = delay_ms

    def _start_services(self) -> None:
        port = free_port()
        argv = [sys.executable, "-m", "bench.trivial", "--port", str(port)]
        argv += ["--pick", ",".join(f"{p.host}:{p.port}" for p in self.pods)]
        argv += ["--check-delay-ms", str(self.delay_ms)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        a = Address(port=port)
        topology = self.settings.topology
        http = Address(port=free_port())  # the key at the headers; the check too in a gateway
        argv += ["--http-port", str(http.port)]
        self._process("trivial", argv, grpc_serving(f"127.0.0.1:{port}"), env).start(
            self.settings.start_timeout
        )
        self.services = Services(
            topology=topology,
            extauthz=a,
            extauthz_http=http,
            ratelimit=None if topology.limiter_inside else a,
            router=None if topology.router_inside else a,
            ledger=a,
        )


def column(name: str) -> str:
    return "pod" if name.startswith("pod") else name


@dataclass
class Cpu:
    label: str
    note: str
    requests: int = 0
    elapsed: float = 0.0
    us: dict[str, float] = field(default_factory=dict)  # µs per request by column
    idle_us: float = 0.0  # of the total: background CPU at idle over the same window
    client_us: float = 0.0
    grpc_calls: float = 0.0
    errors: int = 0

    @property
    def rps(self) -> float:
        return self.requests / self.elapsed

    @property
    def total(self) -> float:
        return sum(self.us.values())


@dataclass
class Pinning:
    stack: set[int] | None
    client: set[int] | None

    @contextlib.contextmanager
    def for_children(self) -> Iterator[None]:
        """Processes started inside inherit the stack's cores; this one returns to its own."""
        if self.stack is not None:
            os.sched_setaffinity(0, self.stack)
        try:
            yield
        finally:
            if self.client is not None:
                os.sched_setaffinity(0, self.client)


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path, pin: Pinning) -> None:
        self.args = args
        self.tmp = tmp
        self.pin = pin
        self.runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        self.limits = tmp / "limits.yaml"
        self.limits.write_text(LIMITS)
        self.pod_address = Address(port=free_port())
        argv = [sys.executable, "-m", "bench.fakepod", "--port", str(self.pod_address.port)]
        argv += ["--token-interval-ms", str(args.token_interval_ms)]
        self.pod = Process(
            "pod",
            argv,
            http_ok(f"http://127.0.0.1:{self.pod_address.port}/health"),
            tmp / "pod.log",
            {**os.environ, "PYTHONPATH": str(REPO)},
        )

    def run(self, coro: Any) -> Any:
        return self.runner.run(coro)

    def stack(self, config: Config, delay_ms: float = 0.0) -> Stack:
        label, services = config.label, config.services
        settings = StackSettings(
            listen=Address(port=0),
            upstreams=(f"{self.pod_address.host}:{self.pod_address.port}",),
            services=services or (),
            topology=config.topology,
            # Mutual TLS between Envoy and the services, as deployed; bench/trivial.py speaks
            # plaintext (its floor is without TLS), and --no-tls measures what TLS costs.
            tls=services is not None and not self.args.no_tls,
            tiers_file=self.limits,
            envoy=EnvoySettings(concurrency=1),
        )
        state = self.tmp / label.replace(" ", "_").replace("+", "plus")
        with self.pin.for_children():
            if services is None:
                return TrivialStack(settings, state, delay_ms).start()
            return Stack(settings, state).start()

    def target(self, stack: Stack) -> Target:
        # Platinum; the trivial handlers accept any key, but Envoy refuses one not shaped as ours.
        key = stack.tenants[-1]["api_key"] if stack.tenants else f"{wire.KEY_PREFIX}bench"
        return Target(stack.listen.host, stack.listen.port, api_key=key)

    def body(self) -> dict[str, object]:
        return {"model": MODEL, "messages": PROMPT, "max_tokens": 8, "stream": False}

    def stream_bodies(self) -> list[dict[str, object]]:
        """Streams of 0.5x to 1.5x `--stream-tokens` tokens, so that they do not stay in step."""
        n = self.args.stream_tokens
        return [
            {"model": MODEL, "messages": PROMPT, "max_tokens": k, "stream": True}
            for k in range(max(1, n // 2), n + n // 2 + 1)
        ]

    def roots(self, stack: Stack) -> dict[str, int]:
        roots = {p.name: p.pid for p in stack.processes if p.pid is not None}
        roots["pod"] = self.pod.pid or 0
        return roots

    def measure_cpu(self, label: str, note: str, stack: Stack) -> Cpu:
        args = self.args
        target = self.target(stack)
        roots = self.roots(stack)
        warm = self.run(loadgen.closed_loop(target, self.body(), args.concurrency, 300))
        if warm.errors:
            print(f"# {label}: warm-up statuses {warm.statuses}", file=sys.stderr)
        time.sleep(1.0)
        idle0 = cpu_seconds(roots)
        time.sleep(args.idle_seconds)
        idle_rate = sum(cpu_seconds(roots).values()) - sum(idle0.values())
        idle_rate /= args.idle_seconds

        stats0 = stack.envoy_stats()
        cpu0, client0, t0 = cpu_seconds(roots), self_cpu(), time.perf_counter()
        samples: Samples = self.run(
            loadgen.closed_loop(target, self.body(), args.concurrency, args.requests)
        )
        time.sleep(args.settle_seconds)  # the last access-log batches are flushed and handled
        window = time.perf_counter() - t0
        cpu1, client1 = cpu_seconds(roots), self_cpu()
        stats1 = stack.envoy_stats()

        n = samples.count
        result = Cpu(label, note, n, samples.elapsed, errors=samples.errors)
        for name in roots:
            col = column(name)
            result.us[col] = result.us.get(col, 0.0) + (cpu1[name] - cpu0[name]) / n * 1e6
        result.idle_us = idle_rate * window / n * 1e6
        result.client_us = (client1 - client0) / n * 1e6
        calls = sum(
            stats1.get(f"cluster.{c}.upstream_rq_total", 0)
            - stats0.get(f"cluster.{c}.upstream_rq_total", 0)
            for c in ("extauthz", "extauthz_http", "ratelimit", "router", "ledger")
        )
        result.grpc_calls = calls / n
        if samples.errors:
            print(f"# {label}: statuses {samples.statuses}", file=sys.stderr)
        return result

    def alternate(
        self, targets: dict[str, Target], rounds: int, once: Callable[[Target], Any]
    ) -> dict[str, Samples]:
        out = {name: Samples() for name in targets}
        names = list(targets)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                out[name].extend(self.run(once(targets[name])))
        return out


# Tables.


def us(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f}"


def cpu_table(rows: list[Cpu], args: argparse.Namespace, pinned: bool) -> str:
    present = [c for c in COLUMNS if any(c in r.us for r in rows)]
    head = ["configuration", "req/s", *present, "**stack total**", "Δ vs row above"]
    head += ["of which idle bg", "callouts/req", "non-200", "load gen (not in total)"]
    lines = [
        f"CPU per request, µs (utime+stime from /proc over {args.requests:,} non-stream requests "
        f"at c={args.concurrency}, max_tokens 8; "
        + ("stack pinned to one core, load generator to the other" if pinned else "no pinning")
        + "; Envoy --concurrency 1)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    previous: float | None = None
    for i, r in enumerate(rows):
        cells = [f"{r.label} ({r.note})", f"{r.rps:,.0f}"]
        cells += [us(r.us.get(c)) for c in present]
        delta = r.total - previous if previous is not None and 0 < i < 5 else None
        cells += [f"**{r.total:,.0f}**", "—" if delta is None else f"{delta:+,.0f}"]
        cells += [us(r.idle_us), f"{r.grpc_calls:.2f}", str(r.errors), us(r.client_us)]
        lines.append("| " + " | ".join(cells) + " |")
        previous = r.total
    by = {r.label: r for r in rows}
    if "full chain" not in by or FLOOR not in by:
        return "\n".join(lines)
    full, floor = by["full chain"], by[FLOOR]
    ratio = full.total / floor.total
    lines += [
        "",
        f"- full chain: **{full.total / 1e3:.2f} ms** CPU/request (target ≤ 2.2 ms: "
        f"{'met' if full.total <= 2200 else 'NOT met'}); "
        f"without the pod {(full.total - full.us.get('pod', 0)) / 1e3:.2f} ms",
        f"- full chain / trivial-handler floor of its shape: **{ratio:.2f}×** (target ≤ 1.3×: "
        f"{'met' if ratio <= 1.3 else 'NOT met'}); without the pod "
        f"{(full.total - full.us.get('pod', 0)) / (floor.total - floor.us.get('pod', 0)):.2f}×",
    ]
    if PACED in by:
        paced = by[PACED]
        lines.append(
            f"- full chain / the same floor at its req/s ({paced.rps:,.0f} against "
            f"{full.rps:,.0f}): **{full.total / paced.total:.2f}×**; the floor itself costs "
            f"{paced.total / floor.total:.2f}× as much a request there as at its own "
            f"{floor.rps:,.0f} req/s"
        )
    for label, floor_label in (
        (GRPC, GRPC_FLOOR),
        (RLS, RLS_FLOOR),
        (EPP, EPP_FLOOR),
    ):
        if label in by and floor_label in by:
            apart, apart_floor = by[label], by[floor_label]
            lines.append(
                f"- {label}: {apart.total / 1e3:.2f} ms, "
                f"{apart.total / apart_floor.total:.2f}× its floor ({floor_label}); the full "
                f"chain saves {apart.total - full.total:,.0f} µs a request"
            )
    lines += [
        "- ratelimit alone (without extauthz) is not a configuration: its descriptors are built "
        "from extauthz's metadata, so Envoy would make no rate-limit call at all.",
    ]
    return "\n".join(lines)


def pct(s: list[float], q: float) -> float:
    return float(np.percentile(s, q)) * 1e3


def latency_table(
    title: str,
    samples: dict[tuple[str, str], Samples],
    first: bool,
    target: float,
    compare: tuple[str, str],
) -> str:
    lines = [
        title,
        "",
        "| placement | path | p50 ms | p99 ms | p50 added vs direct | p50 added vs Envoy alone "
        "| p99 added vs Envoy alone | samples | req/s | non-200 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def q(placement: str, name: str, p: float) -> float:
        s = samples[(placement, name)]
        return pct(s.first if first else s.total, p)

    placements = list(dict.fromkeys(p for p, _ in samples))
    for placement in placements:
        for (where, name), s in samples.items():
            if where != placement:
                continue
            p50, p99 = q(where, name, 50), q(where, name, 99)
            cells = [placement, name, f"{p50:.2f}", f"{p99:.2f}"]
            cells += [f"{p50 - q(where, 'direct to pod', 50):+.2f}"]
            cells += [f"{p50 - q(where, 'Envoy alone', 50):+.2f}"]
            cells += [f"{p99 - q(where, 'Envoy alone', 99):+.2f}"]
            cells += [str(s.count), f"{s.count / s.elapsed:,.1f}", str(s.errors)]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    a, b = compare
    for placement in placements:
        added = q(placement, a, 50) - q(placement, b, 50)
        lines.append(
            f"- {placement}: {a} − {b}, p50: **{added:.2f} ms** (target ≤ {target:g} ms: "
            f"{'met' if added <= target else 'NOT met'})"
        )
        if (placement, FLOOR) in samples:
            floor = q(placement, FLOOR, 50) - q(placement, b, 50)
            lines.append(
                f"  - of which the floor ({FLOOR}: the same callouts answering at once): "
                f"{floor:.2f} ms"
            )
        if (placement, GRPC) in samples:
            grpc = q(placement, GRPC, 50) - q(placement, b, 50)
            lines.append(f"  - {GRPC}: {grpc:.2f} ms")
    return "\n".join(lines)


def pinning(enabled: bool) -> Pinning:
    cores = sorted(os.sched_getaffinity(0))
    if not enabled or len(cores) < 2:
        return Pinning(None, None)
    return Pinning({cores[0]}, set(cores[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--idle-seconds", type=float, default=2.0)
    parser.add_argument("--settle-seconds", type=float, default=1.0)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--rate-seconds", type=float, default=10.0, help="per path, in 2 rounds")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stream-seconds", type=float, default=10.0, help="per path, 2 rounds")
    parser.add_argument("--stream-tokens", type=int, default=32)
    parser.add_argument("--token-interval-ms", type=float, default=10.0)
    parser.add_argument("--no-pin", action="store_true", help="do not pin stack and client")
    parser.add_argument(
        "--no-tls", action="store_true", help="plaintext between Envoy and the services"
    )
    parser.add_argument(
        "--only",
        help="';'-separated configurations to measure (e.g. 'full chain;trivial handlers'); "
        "CPU table only, no latency tables",
    )
    args = parser.parse_args()
    labels = [c.label for c in CONFIGS]
    only = set(labels) if args.only is None else {x.strip() for x in args.only.split(";")}
    if unknown := only - set(labels):
        parser.error(f"--only: unknown {sorted(unknown)}; choose from {labels}")
    pin = pinning(not args.no_pin)
    if pin.client is not None:
        os.sched_setaffinity(0, pin.client)

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stacks:
        bench = Bench(args, Path(tmp), pin)
        stacks.callback(bench.runner.close)
        with pin.for_children():
            bench.pod.start()
        stacks.callback(bench.pod.stop)
        rows: dict[int, Cpu] = {}
        kept: dict[str, Stack] = {}
        for i in ORDER:
            config = CONFIGS[i]
            label = config.label
            if label not in only:
                continue
            delay_ms = 0.0
            if config.paced:
                full, floor = rows.get(INDEX["full chain"]), rows.get(INDEX[FLOOR])
                if full is None or floor is None:
                    continue  # nothing to pace it to
                # The wait that slows each request's round trip to the full chain's.
                in_flight_ms = args.concurrency * 1e3
                delay_ms = max(0.0, in_flight_ms / full.rps - in_flight_ms / floor.rps)
            print(f"# {label} ...", file=sys.stderr, flush=True)
            try:
                stack = bench.stack(config, delay_ms)
            except StartError as exc:
                print(f"# {label}: cannot start: {exc}", file=sys.stderr)
                raise
            try:
                rows[i] = bench.measure_cpu(label, config.note, stack)
            finally:
                if label in ("Envoy alone", "full chain", GRPC, FLOOR):
                    kept[label] = stack
                    stacks.callback(stack.stop)
                else:
                    stack.stop()

        if args.only is not None:
            print(cpu_table([rows[i] for i in sorted(rows)], args, pin.stack is not None))
            return
        pod = Target(bench.pod_address.host, bench.pod_address.port)
        targets = {"direct to pod": pod}
        targets |= {name: bench.target(s) for name, s in kept.items()}
        rate: dict[tuple[str, str], Samples] = {}
        streams: dict[tuple[str, str], Samples] = {}
        stream_s = args.stream_tokens * args.token_interval_ms / 1e3
        for placement in PLACEMENTS if pin.stack is not None else ("no pinning",):
            if placement == PLACEMENTS[1]:
                every = (pin.stack or set()) | (pin.client or set())
                for s in kept.values():
                    set_cores(bench.roots(s), every)
                os.sched_setaffinity(0, every)
            print(f"# latency at a fixed rate, {placement} ...", file=sys.stderr, flush=True)
            got = bench.alternate(
                targets,
                2,
                lambda t: loadgen.paced(t, bench.body(), args.rate, args.rate_seconds / 2),
            )
            rate |= {(placement, name): v for name, v in got.items()}
            print(f"# streams, {placement} ...", file=sys.stderr, flush=True)
            got = bench.alternate(
                targets,
                2,
                lambda t: loadgen.closed_loop(
                    t,
                    bench.stream_bodies(),
                    args.streams,
                    seconds=args.stream_seconds / 2,
                    stagger=stream_s,
                ),
            )
            streams |= {(placement, name): v for name, v in got.items()}

    print(cpu_table([rows[i] for i in range(len(CONFIGS))], args, pin.stack is not None))
    print()
    print(
        latency_table(
            f"Non-stream latency at {args.rate:g} req/s (open loop, max_tokens 8, "
            f"{args.rate_seconds:g} s per path and placement in alternating rounds; client-side, "
            "request written → last byte read)",
            rate,
            first=False,
            target=3.0,
            compare=("full chain", "Envoy alone"),
        )
    )
    print()
    print(
        latency_table(
            f"Time to first token at {args.streams} concurrent streams (closed loop, staggered; "
            f"{args.stream_tokens // 2}-{args.stream_tokens * 3 // 2} tokens "
            f"{args.token_interval_ms:g} ms apart per stream; {args.stream_seconds:g} s per path "
            "and placement in alternating rounds; request written → first content event read)",
            streams,
            first=True,
            target=3.0,
            compare=("full chain", "direct to pod"),
        )
    )


if __name__ == "__main__":
    main()
