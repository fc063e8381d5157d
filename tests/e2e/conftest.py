"""End-to-end tests: each starts a whole stack (Envoy, Redis, the services, simulated pods) on
free ports, and is marked `e2e` here (`-m "not e2e"` leaves them out; `make test` runs them last).
The fixtures that run the stack."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tools.envoyconf import Address, EnvoySettings, Health, Outlier, Timeouts
from tools.stack import PATIENT_SCRAPES as ROUTER_PATIENCE
from tools.stack import Stack, StackSettings

# Pods 20x faster than an H100 so end-to-end tests stay quick; shapes and ordering are unchanged.
FAST_PODS = ("--time-scale", "0.05")


def stack_settings(pods: int = 2, **envoy: Any) -> StackSettings:
    return StackSettings(
        listen=Address(port=0),
        pods=pods,
        sim_args=FAST_PODS,
        envoy=EnvoySettings(
            health=Health(interval="0.25s", timeout="0.5s"),
            outlier=Outlier(base_ejection_time="1s", interval="0.25s"),
            timeouts=Timeouts(upstream_idle="10s", stream_idle="30s"),
            slow_start="1s",
            **envoy,
        ),
    )


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One stack shared by the tests that only send traffic through it."""
    with Stack(stack_settings(), tmp_path_factory.mktemp("stack")) as running:
        yield running


@pytest.fixture
def own_stack(tmp_path: Path) -> Iterator[Stack]:
    """A stack of this test's own, for tests that break pods."""
    with Stack(stack_settings(pods=3), tmp_path / "stack") as running:
        yield running


# What these tests are about (affinity, picks) needs the router's view of the fleet, not the
# machine's speed: a machine busy with a second test suite delayed scrapes past their 50 ms
# timeout and 0.5 s staleness, and a pod whose view went stale lost a session's turn. The stack
# gives real pods' routers the same patience.
PATIENT_SCRAPES = {f"LLMGW_ROUTER__{name}": value for name, value in ROUTER_PATIENCE.items()}


def api_key(stack: Stack, tier: str = "platinum") -> str:
    return next(t["api_key"] for t in stack.tenants if t["tier"] == tier)


HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test in this folder is end to end (a hook sees the whole session: keep to ours)."""
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.e2e)
