"""Reading a rendered Envoy config (parsed YAML) in tests: how the pick and its outcomes travel."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

from tools import certs, envoyconf

Config = dict[str, Any]


def _manager(config: Config) -> Any:
    listener = next(x for x in config["static_resources"]["listeners"] if x["name"] == "openai")
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def http_filters(config: Config) -> list[str]:
    return [f["name"] for f in _manager(config)["http_filters"]]


def grpc_loggers(config: Config) -> dict[str, str]:
    """Each gRPC access log's name → the cluster it is sent to."""
    return {
        log["typed_config"]["common_config"]["log_name"]: log["typed_config"]["common_config"][
            "grpc_service"
        ]["envoy_grpc"]["cluster_name"]
        for log in _manager(config)["access_log"]
        if log["name"] == "envoy.access_loggers.http_grpc"
    }


def soon_filters(config: Config) -> dict[str, bool]:
    """Each router access log's name → whether it takes only the entries marked outcome_soon
    (else only the others): each entry goes to exactly one."""
    out = {}
    for log in _manager(config)["access_log"]:
        name = log["typed_config"].get("common_config", {}).get("log_name", "")
        if not name.startswith("router"):
            continue
        found = log["filter"]["metadata_filter"]
        assert found["matcher"]["filter"] == "envoy.filters.http.ext_authz"
        assert found["matcher"]["path"] == [{"key": "outcome_soon"}]
        only = found["matcher"]["value"] == {"present_match": True}
        assert found["match_if_key_not_found"] is not only
        assert only or found["matcher"]["value"] == {"null_match": {}}
        # Those wanted at once flushed at router_log_flush, the rest with the ledger's batches.
        flush = log["typed_config"]["common_config"]["buffer_flush_interval"]
        services = envoyconf.Services()
        assert flush == (services.router_log_flush if only else services.log_flush), name
        out[name] = only
    return out


def pick_sources(config: Config) -> list[Any]:
    """Where the pods cluster's override_host policy reads the pick."""
    pods = next(c for c in config["static_resources"]["clusters"] if c["name"] == "pods")
    policy = pods["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    return policy["typed_config"]["override_host_sources"]  # type: ignore[no-any-return]


def check_admin_private(config: Config) -> None:
    """The admin listens on loopback only; the `stats` listener sends GET /ready and GET
    /stats/prometheus to it (cluster `admin`, that loopback address) and 404s anything else."""
    admin = config["admin"]["address"]["socket_address"]
    assert ipaddress.ip_address(admin["address"]).is_loopback, admin
    listener = next(x for x in config["static_resources"]["listeners"] if x["name"] == "stats")
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (vhost,) = manager["route_config"]["virtual_hosts"]
    *routed, rest = vhost["routes"]
    get = [{"name": ":method", "string_match": {"exact": "GET"}}]
    assert [r["match"] for r in routed] == [
        {"path": p, "headers": get} for p in ("/ready", "/stats/prometheus")
    ]
    assert all(r["route"] == {"cluster": "admin"} for r in routed)
    assert rest == {"match": {"prefix": "/"}, "direct_response": {"status": 404}}
    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "admin")
    (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"]["socket_address"] == admin


def validated_with_certs(rendered: str, tls_dir: str, tmp: Path) -> None:
    """`envoy --mode validate` of a config that reads its certificates from `tls_dir` (a
    container's path, absent here: Envoy refuses a missing file), with fresh ones in its place."""
    local = certs.generate(tmp / "tls")
    path = tmp / "envoy.yaml"
    path.write_text(rendered.replace(f"{tls_dir}/", f"{local}/"))
    envoyconf.validate(path)
