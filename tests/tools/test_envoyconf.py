"""Every rendered Envoy config passes `envoy --mode validate`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from llmgw import authzhttp, wire
from llmgw.topology import Topology
from ratelimit import response
from ratelimit.response import rate_headers
from ratelimit.types import KindState, Unit, Verdict
from tests.envoy_config import (
    check_admin_private,
    grpc_loggers,
    http_filters,
    pick_sources,
    soon_filters,
)
from tests.http import call
from tools import cli, envoyconf
from tools.envoyconf import Address, EnvoySettings
from tools.procs import Process, bin_path, free_port, http_ok


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
    routes = hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    to_pods = [r for r in routes if "route" in r]  # the last is a 404 for every other path
    assert len(to_pods) == len(routes) - 1 and "direct_response" in routes[-1]
    for route in to_pods:
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


@pytest.mark.parametrize("spec", ["pod-0", "https://vllm:8000", "http://:80"])
def test_parse_endpoint_rejects(spec: str) -> None:
    with pytest.raises(ValueError, match="expected host:port"):
        envoyconf.parse_endpoint(spec)


BASE = ["render-envoy", "--upstream", "vllm-0:8000", "--extauthz", "extauthz:9001"]
BASE += ["--extauthz-http", "extauthz:9011"]
# Each topology's own flags: the service it runs apart.
APART = {
    Topology.GATEWAY: [],
    Topology.GRPC_CHECK: [],
    Topology.RLS: ["--ratelimit", "rl:9002"],
    Topology.EPP: ["--router", "r:9003"],
}


def rendered_with(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict:  # type: ignore[type-arg]
    assert cli.main(argv) == 0, capsys.readouterr().err
    path = tmp_path / "envoy.yaml"
    path.write_text(capsys.readouterr().out)
    envoyconf.validate(path)
    return yaml.safe_load(path.read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize("topology", list(Topology))
def test_each_topology_renders_its_shape(
    topology: Topology, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The check over HTTP only in the gateway; a rate-limit call only in rls and an ext_proc
    call only in epp; the pick read from ext_authz's metadata, and the router's access log sent
    to extauthz, where the router runs inside it."""
    argv = [*BASE, "--topology", topology.value, *APART[topology]]
    config = rendered_with(argv, tmp_path, capsys)
    (authz,) = [
        f["typed_config"]
        for f in config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
            "typed_config"
        ]["http_filters"]
        if f["name"] == "envoy.filters.http.ext_authz"
    ]
    assert ("http_service" in authz, "grpc_service" in authz) == (
        topology is Topology.GATEWAY,
        topology is not Topology.GATEWAY,
    )
    filters = http_filters(config)
    assert ("envoy.filters.http.ratelimit" in filters) == (topology is Topology.RLS)
    assert ("envoy.filters.http.ext_proc" in filters) == (topology is Topology.EPP)
    endpoint = [{"key": "x-gateway-destination-endpoint"}]
    namespace = "envoy.lb" if topology is Topology.EPP else "envoy.filters.http.ext_authz"
    assert pick_sources(config) == [{"metadata": {"key": namespace, "path": endpoint}}]
    if topology is Topology.EPP:  # no flow control: every outcome batched
        assert grpc_loggers(config) == {"router": "router"}
    else:
        assert grpc_loggers(config) == {"router": "extauthz", "router_soon": "extauthz"}
        assert soon_filters(config) == {"router": False, "router_soon": True}
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert {"extauthz", "extauthz_keys"} <= set(clusters)
    assert ("extauthz_http" in clusters) == (topology is Topology.GATEWAY)
    # Flow control holds checks (up to 20 s) only where the router is inside extauthz.
    service = authz.get("http_service", authz.get("grpc_service"))
    timeout = service["server_uri"]["timeout"] if "server_uri" in service else service["timeout"]
    assert timeout == ("2s" if topology is Topology.EPP else "22s")
    if topology is Topology.GATEWAY:
        (limits,) = clusters["extauthz_http"]["circuit_breakers"]["thresholds"]
        assert limits["max_connections"] == 64 + 1024  # the queued checks keep theirs


def test_a_topology_refuses_what_it_runs_elsewhere(capsys: pytest.CaptureFixture[str]) -> None:
    """A service apart that the topology runs inside extauthz, or the one it runs apart left
    without an address, is refused, naming the topology."""
    for topology, apart, message in (
        ("gateway", ["--ratelimit", "rl:9002"], "gateway has the rate limiter inside extauthz"),
        ("grpc-check", ["--router", "r:9003"], "grpc-check has the router inside extauthz"),
        ("rls", ["--router", "r:9003"], "rls has the router inside extauthz"),
        ("epp", ["--ratelimit", "rl:9002"], "epp has the rate limiter inside extauthz"),
        ("rls", [], "rls: needs the rate limiter's address"),
        ("epp", [], "epp: needs the router's address"),
    ):
        assert cli.main([*BASE, "--topology", topology, *apart]) == 2
        assert message in capsys.readouterr().err, (topology, apart)
    no_http = ["render-envoy", "--upstream", "vllm-0:8000", "--extauthz", "extauthz:9001"]
    assert cli.main(no_http) == 2
    assert "extauthz, extauthz_http: both or neither" in capsys.readouterr().err


def test_the_deprecated_flags_render_their_topology_and_warn(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--router-in-extauthz, --ratelimit-in-extauthz and --extauthz-keys (extauthz's HTTP port
    when the check went over gRPC) still render the topology they named, each logging that it is
    deprecated; the shape no topology has (both apart) is refused."""
    keys = ["render-envoy", "--upstream", "vllm-0:8000", "--extauthz", "extauthz:9001"]
    keys += ["--extauthz-keys", "extauthz:9011"]
    inside = ["--router-in-extauthz", "--ratelimit-in-extauthz"]
    old = {
        Topology.GATEWAY: [*BASE, *inside],
        Topology.GRPC_CHECK: [*keys, *inside],
        Topology.RLS: [*keys, "--router-in-extauthz", "--ratelimit", "rl:9002"],
        Topology.EPP: [*keys, "--ratelimit-in-extauthz", "--router", "r:9003"],
    }
    for topology, argv in old.items():
        assert cli.main([*BASE, "--topology", topology.value, *APART[topology]]) == 0
        new = capsys.readouterr()
        assert "deprecated" not in new.err
        assert cli.main(argv) == 0
        got = capsys.readouterr()
        assert got.out == new.out, topology
        warned = {json.loads(line)["msg"] for line in got.err.splitlines()}
        flags = [a for a in argv if a in ("--extauthz-keys", *inside)]
        assert len(warned) == len(flags) and all(
            any(m.startswith(f"{flag} is deprecated") for m in warned) for flag in flags
        ), warned
    assert cli.main([*keys, "--ratelimit", "rl:9002", "--router", "r:9003"]) == 2
    assert "no topology has the rate limiter apart, the router apart" in capsys.readouterr().err
    assert cli.main([*BASE, "--topology", "gateway", "--router-in-extauthz"]) == 2
    assert "--topology is given" in capsys.readouterr().err


def test_render_envoy_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["render-envoy", "--upstream", "vllm-0:8000", "--upstream", "vllm-1:8000"]
    argv += ["--extauthz", "extauthz:9001", "--ratelimit", "10.0.0.7:9002"]  # a name, an IP
    argv += ["--extauthz-http", "extauthz:9011", "--topology", "rls"]
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


def test_the_check_over_http(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In the gateway topology ext_authz calls extauthz's HTTP port (HTTP/1.1), takes every
    metadata key of the contract from the answer's headers, and keeps the breaker's 503 (sent
    as a 429)."""
    assert cli.main([*BASE, "--topology", "gateway"]) == 0
    path = tmp_path / "http.yaml"
    path.write_text(capsys.readouterr().out)
    envoyconf.validate(path)
    config = yaml.safe_load(path.read_text())
    (authz,) = [
        f["typed_config"]
        for f in config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
            "typed_config"
        ]["http_filters"]
        if f["name"] == "envoy.filters.http.ext_authz"
    ]
    assert "grpc_service" not in authz
    assert "pack_as_bytes" not in authz["with_request_body"]  # gRPC only: no body over HTTP
    service = authz["http_service"]
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    http = clusters[service["server_uri"]["cluster"]]
    assert "typed_extension_protocol_options" not in http  # HTTP/1.1, not h2
    address = http["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"] == {"address": "extauthz", "port_value": 9011}
    answer = service["authorization_response"]
    from_headers = {p["exact"] for p in answer["dynamic_metadata_from_headers"]["patterns"]}
    assert from_headers == authzhttp.METADATA
    mappers = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]["local_reply_config"]["mappers"]
    assert mappers[0]["filter"]["metadata_filter"]["matcher"]["filter"] == "llmgw.authn"
    breaker = mappers[1]
    assert breaker["status_code"] == 503
    (status, meta) = breaker["filter"]["and_filter"]["filters"]
    assert status["status_code_filter"]["comparison"]["value"]["default_value"] == 429
    assert meta["metadata_filter"]["matcher"]["path"] == [{"key": "status"}]
    assert meta["metadata_filter"]["matcher"]["value"] == {"string_match": {"exact": "503"}}


def test_every_header_the_check_sets_reaches_its_place() -> None:
    """Names the decision and the limiter answer with, against the matchers Envoy is given: on
    success, upstream headers upstream and client headers to the client, none of them both
    unless it is the session; on a denial, every header to the client."""

    def matches(name: str, exact: tuple[str, ...], prefixes: tuple[str, ...]) -> bool:
        return name in exact or name.startswith(prefixes)

    upstream = [
        wire.HEADER_TENANT,
        wire.HEADER_TIER,
        wire.HEADER_PRIORITY,
        wire.HEADER_VLLM_PRIORITY,
        wire.HEADER_TOKEN_ESTIMATE,
        wire.HEADER_SESSION,
        wire.HEADER_REQUEST_ID,
        wire.HEADER_MODEL,
    ]
    for name in upstream:
        assert matches(name, authzhttp.UPSTREAM_EXACT, authzhttp.UPSTREAM_PREFIXES), name
    state = KindState("requests", 10, Unit.MINUTE, 0, 1000, 10, 1)
    verdict = Verdict(
        tenant="t",
        tier="standard",
        refusal="rate_limited",
        refused=state,
        requests=state,
        tokens=KindState("tokens", 100, Unit.MINUTE, 0, 1000, 100, 1),
        retry_after_ms=1000,
        shadow=False,
    )
    to_client = [name for name, _ in rate_headers(verdict)]
    to_client += [wire.HEADER_SESSION, wire.HEADER_QUEUE_MS]
    for name in to_client:
        assert name in authzhttp.CLIENT_ON_SUCCESS, name
        if name not in (wire.HEADER_SESSION, wire.HEADER_QUEUE_MS):
            assert not matches(name, authzhttp.UPSTREAM_EXACT, authzhttp.UPSTREAM_PREFIXES)
    for refusal in ("rate_limited", "circuit_open", "too_large", "insufficient_quota"):
        headers, _ = response.refusal(dataclasses.replace(verdict, refusal=refusal))
        for name, _ in headers:
            assert name in authzhttp.CLIENT_EXACT, name


def test_render_envoy_refuses_an_admin_off_loopback(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["render-envoy", "--upstream", "vllm-0:8000", "--insecure-no-auth"]
    assert cli.main([*argv, "--admin", "0.0.0.0:9901"]) == 2
    assert "not a loopback address" in capsys.readouterr().err
    assert cli.main([*argv, "--stats", "0.0.0.0:9902"]) == 0
    check_admin_private(yaml.safe_load(capsys.readouterr().out))


def test_the_stats_listener_serves_readiness_and_metrics_and_nothing_else(tmp_path: Path) -> None:
    """A real Envoy: /ready and /stats/prometheus through the stats listener; the admin's other
    endpoints (stopping Envoy, its config with every address) are a 404 there."""
    admin, stats = Address(port=free_port()), Address(port=free_port())
    settings = EnvoySettings(admin=admin, stats=stats)
    config = render_and_validate(tmp_path, settings, [Address(port=free_port())])
    check_admin_private(config)
    argv = [bin_path("envoy"), "-c", str(tmp_path / "envoy.yaml"), "--disable-hot-restart"]
    argv += ["--base-id", str(admin.port), "--concurrency", "1", "--log-level", "warn"]
    envoy = Process(
        "envoy", argv, http_ok(f"http://127.0.0.1:{stats.port}/ready"), tmp_path / "e.log"
    )
    try:
        envoy.start(60)
        base = f"http://127.0.0.1:{stats.port}"
        assert call("GET", f"{base}/ready").body == b"LIVE\n"
        assert b"envoy_server_live" in call("GET", f"{base}/stats/prometheus").body
        for method, path in [
            ("POST", "/quitquitquit"),
            ("GET", "/config_dump"),
            ("POST", "/logging?level=trace"),
            ("GET", "/stats"),
            ("POST", "/ready"),
            ("GET", "/stats/prometheus/../../config_dump"),
        ]:
            assert call(method, f"{base}{path}").status == 404, (method, path)
        assert envoy.alive
    finally:
        envoy.stop()
