"""Every rendered Envoy config passes `envoy --mode validate`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmgw import cli, envoyconf
from llmgw.envoyconf import Address, EnvoySettings
from tests.envoy_config import grpc_loggers, http_filters, pick_sources


def render_and_validate(tmp_path: Path, settings: EnvoySettings, pods: list[Address]) -> dict:  # type: ignore[type-arg]
    path = tmp_path / "envoy.yaml"
    path.write_text(envoyconf.render(settings, Address(port=8080), pods))
    envoyconf.validate(path)
    return yaml.safe_load(path.read_text())  # type: ignore[no-any-return]


def cluster(config: dict) -> dict:  # type: ignore[type-arg]
    return config["static_resources"]["clusters"][0]  # type: ignore[no-any-return]


def test_local_stack_config_is_valid(tmp_path: Path) -> None:
    config = render_and_validate(
        tmp_path, EnvoySettings(), [Address(port=8001), Address(port=8002)]
    )
    assert cluster(config)["type"] == "STATIC"
    assert config["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"


def test_dns_pods_use_strict_dns(tmp_path: Path) -> None:
    config = render_and_validate(tmp_path, EnvoySettings(), [Address(host="vllm", port=8000)])
    assert cluster(config)["type"] == "STRICT_DNS"


def test_access_log_config_is_valid(tmp_path: Path) -> None:
    settings = EnvoySettings(access_log_path=str(tmp_path / "access.log"))
    config = render_and_validate(tmp_path, settings, [Address(port=8001)])
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    assert hcm["typed_config"]["access_log"]


def test_retries_never_follow_a_response(tmp_path: Path) -> None:
    config = render_and_validate(tmp_path, EnvoySettings(), [Address(port=8001)])
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    for route in hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]:
        policy = route["route"]["retry_policy"]
        assert set(policy["retry_on"].split(",")) == {
            "connect-failure",
            "refused-stream",
            "reset",
            "retriable-status-codes",
        }
        assert policy["retriable_status_codes"] == [503]
        assert route["route"]["timeout"] == "0s"  # no total timeout on streams


def test_override_host_reads_the_pickers_metadata(tmp_path: Path) -> None:
    config = render_and_validate(tmp_path, EnvoySettings(), [Address(port=8001)])
    policy = cluster(config)["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    source = policy["typed_config"]["override_host_sources"][0]
    assert source == {
        "metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}
    }


@pytest.mark.parametrize("fallback", ["least_request", "round_robin"])
def test_fallback_policy_is_configurable(tmp_path: Path, fallback: str) -> None:
    settings = EnvoySettings(fallback_policy=fallback)  # type: ignore[arg-type]
    config = render_and_validate(tmp_path, settings, [Address(port=8001)])
    policy = cluster(config)["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    inner = policy["typed_config"]["fallback_policy"]["policies"][0]["typed_extension_config"]
    assert inner["name"] == f"envoy.load_balancing_policies.{fallback}"


@pytest.mark.parametrize(
    ("spec", "host", "port"),
    [("10.0.0.1:8000", "10.0.0.1", 8000), ("http://vllm-0:8000/", "vllm-0", 8000)],
)
def test_parse_endpoint(spec: str, host: str, port: int) -> None:
    assert envoyconf.parse_endpoint(spec) == Address(host=host, port=port)


@pytest.mark.parametrize("spec", ["vllm", "https://vllm:8000", "http://:80"])
def test_parse_endpoint_rejects(spec: str) -> None:
    with pytest.raises(ValueError, match="expected host:port"):
        envoyconf.parse_endpoint(spec)


def test_the_router_inside_extauthz_makes_no_ext_proc_call(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The pick is read from ext_authz's metadata and the router's outcomes go to extauthz;
    with the router apart, ext_proc and envoy.lb as before."""
    base = ["render-envoy", "--upstream", "vllm-0:8000", "--extauthz", "extauthz:9001"]
    configs = {}
    for name, extra in (("inside", ["--router-in-extauthz"]), ("apart", ["--router", "r:9003"])):
        assert cli.main(base + extra) == 0
        path = tmp_path / f"{name}.yaml"
        path.write_text(capsys.readouterr().out)
        envoyconf.validate(path)
        configs[name] = yaml.safe_load(path.read_text())
    sources = {name: pick_sources(c) for name, c in configs.items()}
    endpoint = [{"key": "x-gateway-destination-endpoint"}]
    assert sources["inside"] == [
        {"metadata": {"key": "envoy.filters.http.ext_authz", "path": endpoint}}
    ]
    assert sources["apart"] == [{"metadata": {"key": "envoy.lb", "path": endpoint}}]
    assert "envoy.filters.http.ext_proc" not in http_filters(configs["inside"])
    assert "envoy.filters.http.ext_proc" in http_filters(configs["apart"])
    assert grpc_loggers(configs["inside"]) == {"router": "extauthz"}
    assert grpc_loggers(configs["apart"]) == {"router": "router"}
    no_extauthz = ["render-envoy", "--upstream", "vllm-0:8000", "--insecure-no-auth"]
    for argv in ([*base, "--router", "r:9003"], no_extauthz):
        assert cli.main([*argv, "--router-in-extauthz"]) != 0
        assert "router_in_extauthz: needs extauthz, and no router" in capsys.readouterr().err


def test_render_envoy_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["render-envoy", "--upstream", "vllm-0:8000", "--upstream", "vllm-1:8000"]
    argv += ["--extauthz", "extauthz:9001", "--ratelimit", "10.0.0.7:9002"]  # a name, an IP
    assert cli.main(argv) == 0
    path = tmp_path / "out.yaml"
    path.write_text(capsys.readouterr().out)
    envoyconf.validate(path)
    clusters = {
        c["name"]: c["type"]
        for c in yaml.safe_load(path.read_text())["static_resources"]["clusters"]
    }
    assert (clusters["extauthz"], clusters["ratelimit"]) == ("STRICT_DNS", "STATIC")


def test_tracing_config_is_valid(tmp_path: Path) -> None:
    settings = EnvoySettings(otlp=Address(host="127.0.0.1", port=4317))
    config = render_and_validate(tmp_path, settings, [Address(port=8001)])
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    assert hcm["typed_config"]["tracing"]["provider"]["name"] == "envoy.tracers.opentelemetry"
    assert "otel" in {c["name"] for c in config["static_resources"]["clusters"]}


def test_memory_is_bounded_per_connection_and_in_all(tmp_path: Path) -> None:
    settings = EnvoySettings(max_heap_bytes=1 << 30, max_streams_per_connection=64)
    config = render_and_validate(tmp_path, settings, [Address(port=8001)])
    overload = config["overload_manager"]
    heap = next(m for m in overload["resource_monitors"] if m["name"].endswith("fixed_heap"))
    assert heap["typed_config"]["max_heap_size_bytes"] == 1 << 30
    shed = {a["name"]: a["triggers"][0]["threshold"]["value"] for a in overload["actions"]}
    assert shed["envoy.overload_actions.stop_accepting_requests"] == 0.95
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    options = hcm["typed_config"]
    assert options["http2_protocol_options"]["max_concurrent_streams"] == 64
    assert options["request_timeout"] == "30s"  # receiving a request is bounded
    assert options["normalize_path"] and options["merge_slashes"]
