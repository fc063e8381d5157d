"""The whole suite: unit tests first, then the end-to-end ones (tests/e2e/, marked `e2e`), then
the real-vLLM tier (marked `vllm`): it waits for the vLLM environment, which `make test`
installs in the background meanwhile."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

TIERS = ("vllm", "e2e")  # the later tiers, most significant first


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
