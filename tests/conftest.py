"""The whole suite: unit tests first, then the end-to-end ones (tests/e2e/, marked `e2e`)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.hookimpl(trylast=True)  # after tests/e2e/conftest.py has marked its tests
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fast tests first, so that a broken unit fails in seconds, not after the stacks; the
    order within each part stays pytest's (stable sort)."""
    items.sort(key=lambda item: item.get_closest_marker("e2e") is not None)


@pytest.fixture(autouse=True)
def _collect_garbage() -> Iterator[None]:
    """Whatever a test leaves to the garbage collector (an unclosed client's socket) is collected
    in its own teardown, so its ResourceWarning fails that test, not a later one by chance."""
    yield
    gc.collect()
