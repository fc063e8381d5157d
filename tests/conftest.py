"""The whole suite: unit tests first, then the end-to-end ones (tests/e2e/, marked `e2e`), then
the real-vLLM tier (marked `vllm`): it waits for the vLLM environment, which `make test`
installs in the background meanwhile."""

from __future__ import annotations

import gc
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.ratelimit.rl_redis import flushall, redis_port, start_redis
from tools.postgres import Postgres
from tools.procs import Process

TIERS = ("vllm", "e2e")  # the later tiers, most significant first


def scope_of(nodeid: str) -> str:
    """What one worker runs whole under `make test` (pytest-xdist, `-n 2 --dist loadfile`): a
    module, so that its stacks start once, or the real-vLLM tier, named so (`test_vllm*`
    modules, `[vllm]` parameters), so that its pods start one at a time (two at once would need
    twice the cores) and after the rest (it sorts last, below). Checked against the `vllm`
    marks at collection."""
    module, _, name = nodeid.partition("::")
    if Path(module).name.startswith("test_vllm") or name.endswith("[vllm]"):
        return "vllm"
    return module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return Scheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """The tier's names and its marks agree, or the workers would run it beside the rest."""
    for item in session.items:
        named = scope_of(item.nodeid) == "vllm"
        if named != (item.get_closest_marker("vllm") is not None):
            raise pytest.UsageError(
                f"{item.nodeid}: the real-vLLM tier's tests are marked `vllm` and named so "
                "(a test_vllm* module or a [vllm] parameter: tests/conftest.py scope_of)"
            )


@pytest.hookimpl(trylast=True)  # after tests/e2e/conftest.py has marked its tests
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fast tests first, so that a broken unit fails in seconds, not after the stacks; real
    vLLM last, so that its installation overlaps the rest; the order within each part stays
    pytest's (stable sort)."""
    items.sort(key=lambda item: tuple(item.get_closest_marker(m) is not None for m in TIERS))


@pytest.fixture(autouse=True)
def _collect_garbage() -> Iterator[None]:
    """Whatever a test leaves to the garbage collector (an unclosed client's socket) is collected
    in its own teardown, so its ResourceWarning fails that test, not a later one by chance."""
    yield
    gc.collect()


# A real PostgreSQL (tools.postgres): the ledger's and the tenants database's tests.


@pytest.fixture(scope="session")
def shared_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    proc = start_redis(tmp_path_factory.mktemp("redis"))
    yield proc
    proc.stop()


@pytest.fixture
def redis(shared_redis: Process) -> int:
    """The shared redis-server's port, emptied for this test (a directory's own `redis` may
    replace it)."""
    port = redis_port(shared_redis)
    flushall(port)
    return port


@pytest.fixture(scope="session")
def shared_pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Postgres]:
    pg = Postgres(tmp_path_factory.mktemp("pg") / "postgres")
    pg.start(60)
    yield pg
    pg.stop()


@pytest.fixture
def own_pg(tmp_path: Path) -> Iterator[list[Postgres]]:
    """A server of this test's own, for tests that kill it; [-1] is the current one."""
    procs = [Postgres(tmp_path / "postgres")]
    procs[0].start(60)
    yield procs
    procs[-1].stop()


@pytest.fixture
async def db(shared_pg: Postgres) -> AsyncIterator[str]:
    """The URL of an empty database of this test's own on the shared server."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(shared_pg.url)
    try:
        await admin.execute(f"CREATE DATABASE {name}")
        yield shared_pg.url.rsplit("/", 1)[0] + f"/{name}"
        await admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
    finally:
        await admin.close()
