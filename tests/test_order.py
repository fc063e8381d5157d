"""The suite's order (tests/conftest.py): unit tests, then end-to-end ones, then real vLLM."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import pytest_collection_modifyitems


class Item:
    def __init__(self, name: str, *markers: str) -> None:
        self.name = name
        self.markers = markers

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.markers else None


def test_real_vllm_runs_last_and_each_tier_keeps_its_order() -> None:
    items: list[Any] = [
        Item("fidelity", "vllm"),
        Item("gateway", "e2e"),
        Item("supervised", "e2e", "vllm"),
        Item("unit"),
        Item("launcher", "e2e"),
        Item("unit2"),
    ]
    pytest_collection_modifyitems(items)
    assert [i.name for i in items] == [
        "unit",
        "unit2",
        "gateway",
        "launcher",
        "fidelity",
        "supervised",
    ]


def test_the_vllm_marker_is_registered(pytestconfig: pytest.Config) -> None:
    assert any(m.startswith("vllm:") for m in pytestconfig.getini("markers"))
