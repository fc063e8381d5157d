"""The compose deployment, checked by parsing (no Docker engine here) and by Envoy's validator."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmgw import cli, envoyconf

COMPOSE = Path(__file__).resolve().parent.parent / "compose"


def test_compose_file_has_the_stack() -> None:
    spec = yaml.safe_load((COMPOSE / "docker-compose.yaml").read_text())
    services = spec["services"]
    assert {"envoy", "redis", "otel-collector", "vllm-0", "vllm-1"} <= set(services)
    assert "./envoy.yaml:/etc/envoy/envoy.yaml:ro" in services["envoy"]["volumes"]
    for name in ("vllm-0", "vllm-1"):
        assert "--enable-force-include-usage" in services[name]["command"]


def test_compose_envoy_config_is_current_and_valid(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["render-envoy", "--listen", "0.0.0.0:8080"]
    argv += ["--upstream", "vllm-0:8000", "--upstream", "vllm-1:8000"]
    assert cli.main(argv) == 0
    rendered = capsys.readouterr().out
    assert (COMPOSE / "envoy.yaml").read_text() == rendered, (
        "compose/envoy.yaml is stale: re-render it with the command in docker-compose.yaml"
    )
    envoyconf.validate(COMPOSE / "envoy.yaml")
