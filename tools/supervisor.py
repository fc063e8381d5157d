"""Keep the local stack's children running: a child that dies is restarted with backoff.

Generic over `Stack.processes`: whatever the stack starts (Redis, PostgreSQL, pods, services,
Envoy) is watched the same way. A restart is `Stack.renew(name)`: a fresh `Process` with the same
argv, environment, readiness probe, port and log file. Nothing here blocks longer than one
readiness probe, so one child restarting never delays noticing another one's death.

Per child: RUNNING → (exits) → WAITING (backoff) → STARTING (spawned, probed until ready or
the child's own `start_timeout`: a minute for a service, minutes for a real vLLM pod) → RUNNING.
A start that fails or times out goes back to WAITING with a longer delay; a child that stayed up
`reset_after_s` starts again from the shortest delay.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from tools.procs import Process

log = logging.getLogger("tools.supervisor")


class Supervised(Protocol):
    """What the supervisor needs of a stack (tools.stack.Stack)."""

    @property
    def processes(self) -> list[Process]: ...

    def renew(self, name: str) -> Process: ...


@dataclass(frozen=True)
class Backoff:
    initial_s: float = 0.1
    factor: float = 2.0
    max_s: float = 30.0
    reset_after_s: float = 30.0  # up this long: the next crash waits `initial_s` again

    def delay(self, failures: int) -> float:
        """Wait before restart attempt number `failures` (1, 2, ...) of a crash series."""
        return float(min(self.max_s, self.initial_s * self.factor ** max(0, failures - 1)))


class State(enum.Enum):
    RUNNING = "running"
    WAITING = "waiting"
    STARTING = "starting"


@dataclass
class Child:
    name: str
    state: State = State.RUNNING
    failures: int = 0  # consecutive, within one crash series
    restarts: int = 0  # successful restarts since the launcher started
    since: float = 0.0  # RUNNING: when it became ready; else when it went down
    due: float = 0.0  # WAITING: when to spawn; STARTING: readiness deadline


@dataclass
class SupervisorMetrics:
    """Prometheus metrics of the supervisor, in their own registry (served by the launcher)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.exits = Counter(
            "llmgw_child_exits", "Children that exited unasked", ["child"], registry=self.registry
        )
        self.restarts = Counter(
            "llmgw_child_restarts",
            "Children restarted and ready again",
            ["child"],
            registry=self.registry,
        )
        self.failed_starts = Counter(
            "llmgw_child_failed_starts",
            "Restart attempts that exited or were not ready in time",
            ["child"],
            registry=self.registry,
        )
        self.up = Gauge(
            "llmgw_child_up", "1 if the child runs and is ready", ["child"], registry=self.registry
        )


class Supervisor:
    """Call `step()` periodically from the thread that started the stack (children get
    SIGTERM when the thread that spawned them dies: tools.procs)."""

    def __init__(
        self,
        stack: Supervised,
        backoff: Backoff = Backoff(),
        on_restart: Callable[[Process], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: SupervisorMetrics | None = None,
    ) -> None:
        self.stack = stack
        self.backoff = backoff
        self.on_restart = on_restart
        self.clock = clock
        self.metrics = metrics or SupervisorMetrics()
        self.children: dict[str, Child] = {}

    def restarts(self) -> dict[str, int]:
        return {name: child.restarts for name, child in self.children.items()}

    def step(self) -> None:
        """One pass over every child; bounded by one readiness probe per starting child."""
        now = self.clock()
        for proc in list(self.stack.processes):
            child = self.children.get(proc.name)
            if child is None:  # started by the stack, or added since the last pass
                child = self.children[proc.name] = Child(proc.name, since=now)
                self.metrics.up.labels(proc.name).set(1)
            if child.state is State.RUNNING:
                self._check_running(child, proc, now)
            elif child.state is State.WAITING:
                if now >= child.due:
                    self._spawn(child, now)
            else:
                self._check_starting(child, proc, now)

    def _check_running(self, child: Child, proc: Process, now: float) -> None:
        if proc.alive:
            if child.failures and now - child.since >= self.backoff.reset_after_s:
                child.failures = 0
            return
        self.metrics.exits.labels(child.name).inc()
        self.metrics.up.labels(child.name).set(0)
        if now - child.since >= self.backoff.reset_after_s:
            child.failures = 0
        log.error(
            "child exited",
            extra={"child": child.name, "pid": proc.pid, "code": proc.returncode},
        )
        child.since = now
        self._wait(child, now)

    def _wait(self, child: Child, now: float) -> None:
        child.failures += 1
        child.state = State.WAITING
        child.due = now + self.backoff.delay(child.failures)
        log.info(
            "child restart scheduled",
            extra={"child": child.name, "attempt": child.failures, "delay_s": child.due - now},
        )

    def _spawn(self, child: Child, now: float) -> None:
        try:
            proc = self.stack.renew(child.name).spawn()
        except OSError as exc:
            log.error("child spawn failed", extra={"child": child.name, "error": str(exc)})
            self.metrics.failed_starts.labels(child.name).inc()
            self._wait(child, now)
            return
        child.state = State.STARTING
        child.due = now + proc.start_timeout

    def _check_starting(self, child: Child, proc: Process, now: float) -> None:
        if proc.alive and proc.ready():
            child.state = State.RUNNING
            child.restarts += 1
            down_s = self.clock() - child.since
            child.since = self.clock()
            self.metrics.restarts.labels(child.name).inc()
            self.metrics.up.labels(child.name).set(1)
            log.warning(
                "child restarted",
                extra={
                    "child": child.name,
                    "pid": proc.pid,
                    "restarts": child.restarts,
                    "down_s": round(down_s, 3),
                },
            )
            if self.on_restart is not None:
                self.on_restart(proc)
            return
        if proc.alive and now < child.due:
            return
        log.error(
            "child restart failed",
            extra={
                "child": child.name,
                "code": proc.returncode,
                "timed_out": proc.alive,
                "log_tail": proc.log_tail(5),
            },
        )
        proc.kill()
        self.metrics.failed_starts.labels(child.name).inc()
        self._wait(child, now)
