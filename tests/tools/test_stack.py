"""The stack's composition without starting it: which engine serves each pod."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from tools.stack import PATIENT_SCRAPES, Stack, StackSettings


@pytest.mark.parametrize(
    ("settings", "engines"),
    [
        ({"pods": 2}, ["sim", "sim"]),
        ({"pods": 2, "engine": "vllm"}, ["vllm", "vllm"]),
        ({"pods": 1, "engine": "vllm", "sim_pods": 2}, ["vllm", "sim", "sim"]),
        ({"pods": 0, "upstreams": ("a:1", "b:2")}, ["external", "external"]),
    ],
)
def test_each_pod_names_its_engine(
    settings: dict[str, object], engines: list[str], tmp_path: Path
) -> None:
    stack = Stack(StackSettings.model_validate(settings), tmp_path)
    assert [stack.pod_engine(i) for i in range(len(engines))] == engines


@pytest.mark.parametrize(
    "settings",
    [{"sim_pods": 1}, {"sim_pods": 1, "engine": "vllm", "pods": 0, "upstreams": ("a:1",)}],
)
def test_simulated_pods_beside_real_ones_need_real_ones(settings: dict[str, object]) -> None:
    with pytest.raises(ValidationError, match="sim_pods"):
        StackSettings.model_validate(settings)


@pytest.mark.parametrize(("engine", "patient"), [("sim", False), ("vllm", True)])
def test_real_pods_are_scraped_patiently(engine: str, patient: bool, tmp_path: Path) -> None:
    """A CPU pod's /metrics takes up to 75 ms: past the router's default 50 ms timeout."""
    stack = Stack(StackSettings.model_validate({"engine": engine}), tmp_path)
    assert (PATIENT_SCRAPES.items() <= stack._router_settings().items()) is patient
