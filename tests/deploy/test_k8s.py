"""The Kubernetes manifests (deploy/k8s/), checked without a cluster.

- Every built-in resource validates against the Kubernetes schemas (`kubernetes-validate`,
  strict: unknown fields are errors). The ServiceMonitors (a CRD the validator has no schema
  for) are checked against the Services they select.
- The Envoy config the manifests mount is the template's current rendering and validates; each
  of its clusters names a Service and port of the manifests.
- Every service's environment is accepted by that service's own settings schema (unknown keys
  are errors there), probes are gRPC health on the gRPC port, and each service has a PDB and an
  HPA; NetworkPolicies let only Envoy reach the services and only the services reach the stores.
- The gateway topology, as the local stack runs it: the router and the rate limiter run inside
  extauthz (its TOPOLOGY, the one Envoy's config is rendered for): no router or ratelimit
  Deployment, Service or policy, no ext_proc or rate-limit filter; extauthz's router and
  rate-limit settings are accepted by their own schemas, name the headless Service `vllm` and
  Redis, and the policies let extauthz reach both. The InferencePool example (inference-pool/)
  stays a standalone router, in picker mode.
- The admin API: one replica behind a ClusterIP Service no Ingress, LoadBalancer or Envoy route
  reaches (operators port-forward), its token and database from Secrets, settings its own
  `--check-config` accepts; no one but Prometheus reaches it, and it reaches only PostgreSQL, Redis
  and DNS. extauthz follows the admin API's tables, its snapshot cached on a writable emptyDir.
"""

from __future__ import annotations

import importlib
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from admin import routes as admin_routes
from admin.__main__ import cli as admin_cli
from admin.settings import Settings as AdminSettings
from deploy.render_k8s import RENDER, configmap, rendered
from extauthz.__main__ import admitting, picking
from extauthz.settings import Settings as ExtauthzSettings
from ledger.settings import Settings as LedgerSettings
from llmgw import config, wire
from llmgw.topology import Topology
from tests.envoy_config import (
    check_admin_private,
    grpc_loggers,
    pick_sources,
    validated_with_certs,
)
from tools import certs

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
VERSION = "1.33.0"
SERVICES = {"extauthz": 9001, "ledger": 9004}  # gRPC, called by Envoy
ADMIN = "admin"  # HTTP, called by no one in the cluster
TLS_ENVOY, TLS_SERVICE = "/etc/envoy-tls", "/etc/llmgw-tls"  # the Secret llmgw-tls, mounted
# extauthz reaches Redis for the rate limiter and the router it holds: quotas, the fleet load.
# The ledger's reconciler runs in Envoy's pods (envoy.yaml, ledger-reconcile). The admin API
# keeps the tenants in PostgreSQL; extauthz follows them there.
STORES = {
    "redis": {"extauthz", "ledger", "envoy", ADMIN},  # the admin: the breakers' state
    "postgres": {"ledger", "envoy", ADMIN, "extauthz"},
}
# The one Secret of the PostgreSQL URL (the ledger's, the admin's, extauthz's tenants').
DATABASE_URL = {"secretKeyRef": {"name": "llmgw-postgres", "key": "database-url"}}


def docs() -> list[dict[str, Any]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def find(kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs() if d["kind"] == kind and d["metadata"]["name"] == name)


def workload(name: str) -> dict[str, Any]:
    return next(
        d
        for d in docs()
        if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] == name
    )


def container(name: str) -> dict[str, Any]:
    return dict(workload(name)["spec"]["template"]["spec"]["containers"][0])


# Custom resources: the validator has no schema for them; the tests below check them.
CRD_GROUPS = (
    "monitoring.coreos.com/",
    "inference.networking.k8s.io/",
    "gateway.networking.k8s.io/",
)
MANIFESTS = sorted(K8S.glob("*.yaml")) + sorted(K8S.glob("*/*.yaml"))


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_validates_against_the_kubernetes_schemas(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc is None or doc["apiVersion"].startswith(CRD_GROUPS):
            continue
        kubernetes_validate.validate(doc, VERSION, strict=True)
        assert doc["metadata"].get("namespace") in ("llmgw", None)


def test_the_service_monitors_select_services_and_ports_that_exist() -> None:
    services = [d for d in docs() if d["kind"] == "Service"]
    monitors = [d for d in docs() if d["kind"] == "ServiceMonitor"]
    scraped: set[str] = set()
    for monitor in monitors:
        labels = monitor["spec"]["selector"]["matchLabels"]
        chosen = [s for s in services if labels.items() <= s["metadata"]["labels"].items()]
        assert chosen, monitor["metadata"]["name"]
        for service in chosen:
            ports = {p["name"] for p in service["spec"]["ports"]}
            assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
            scraped.add(service["metadata"]["name"])
    assert scraped == {*SERVICES, ADMIN, "envoy", "vllm"}


def test_the_mounted_envoy_config_is_the_template_rendering_and_validates(tmp_path: Path) -> None:
    envoy_yaml = rendered()
    assert (K8S / "envoy-config.yaml").read_text() == configmap(envoy_yaml), (
        "deploy/k8s/envoy-config.yaml is stale: python -m deploy.render_k8s > it"
    )
    mounted = find("ConfigMap", "envoy-config")["data"]["envoy.yaml"]
    assert mounted == envoy_yaml
    # Envoy opens its access log's directory (the pod's emptyDir) at start.
    log_dir = RENDER[RENDER.index("--access-log") + 1].rpartition("/")[0]
    validated_with_certs(mounted.replace(log_dir, str(tmp_path)), TLS_ENVOY, tmp_path)
    for needed in ("ext_authz", "http_grpc"):
        assert needed in mounted
    # The router and the rate limiter are extauthz's: no ext_proc or rate-limit call; the pick
    # is read from ext_authz's metadata and the router's access log goes to extauthz.
    assert "envoy.filters.http.ext_proc" not in mounted
    assert "ratelimit.v3.RateLimit" not in mounted
    config = yaml.safe_load(mounted)
    assert "router" not in {c["name"] for c in config["static_resources"]["clusters"]}
    sources = pick_sources(config)
    assert [src["metadata"]["key"] for src in sources] == [wire.EXTAUTHZ_NAMESPACE]
    loggers = {"ledger": "ledger", "router": "extauthz", "router_soon": "extauthz"}
    assert grpc_loggers(config) == loggers
    check_admin_private(config)
    # Every cluster but the admin (Envoy's own loopback) names a Service of the manifests.
    services = {d["metadata"]["name"]: d for d in docs() if d["kind"] == "Service"}
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "admin":
            continue
        assert cluster["type"] == "STRICT_DNS", cluster["name"]
        for group in cluster["load_assignment"]["endpoints"]:
            for endpoint in group["lb_endpoints"]:
                sock = endpoint["endpoint"]["address"]["socket_address"]
                service = services[sock["address"]]
                assert sock["port_value"] in {p["port"] for p in service["spec"]["ports"]}
                if service["metadata"]["name"] in (*SERVICES, "vllm"):
                    assert service["spec"]["clusterIP"] == "None"  # every replica resolved


def test_probes_and_scrapes_reach_envoy_through_its_stats_listener() -> None:
    """Nothing outside the pod reaches the admin (loopback): the readiness probe, the Service,
    the ServiceMonitor and the NetworkPolicy name the stats listener's port."""
    config = yaml.safe_load(rendered())
    stats = next(x for x in config["static_resources"]["listeners"] if x["name"] == "stats")
    port = stats["address"]["socket_address"]["port_value"]
    envoy = container("envoy")
    assert {p["name"]: p["containerPort"] for p in envoy["ports"]} == {"http": 8080, "stats": port}
    assert envoy["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "stats"}
    ports = find("Service", "envoy")["spec"]["ports"]
    assert {p["name"]: p["targetPort"] for p in ports} == {"http": "http", "stats": "stats"}
    endpoints = find("ServiceMonitor", "llmgw-envoy")["spec"]["endpoints"]
    assert [(e["port"], e["path"]) for e in endpoints] == [("stats", "/stats/prometheus")]
    assert ingress_from("envoy") == [({"anyone"}, {8080}), ({"monitoring"}, {port})]


def bytes_of(quantity: str) -> int:
    """A Kubernetes memory quantity (binary suffixes, or plain bytes) in bytes."""
    for i, suffix in enumerate(("Ki", "Mi", "Gi", "Ti"), start=1):
        if quantity.endswith(suffix):
            return int(quantity.removesuffix(suffix)) * 1024**i
    return int(quantity)


def test_envoys_memory_limit_leaves_room_above_its_heap_bound() -> None:
    """The overload manager sheds near max_heap_size_bytes; a memory limit below that (plus
    what Envoy holds outside its heap) kills the pod first, and every stream with it."""
    overload = yaml.safe_load(rendered())["overload_manager"]
    heap = next(m for m in overload["resource_monitors"] if m["name"].endswith("fixed_heap"))
    bound = heap["typed_config"]["max_heap_size_bytes"]
    limit = bytes_of(container("envoy")["resources"]["limits"]["memory"])
    assert limit >= bound + 512 * 1024**2, (limit, bound)


def env_of(name: str, box: dict[str, Any] | None = None) -> dict[str, str]:
    """The container's environment (workload `name`'s first, else `box`), with Secret and
    downward-API values stood in for."""
    out = {}
    for var in (box or container(name)).get("env", []):
        if "value" in var:
            out[var["name"]] = var["value"]
        elif "secretKeyRef" in var["valueFrom"]:
            out[var["name"]] = (
                "postgresql://u:p@postgres:5432/db"
                if "URL" in var["name"]
                else secrets.token_hex(32)
            )
        else:
            out[var["name"]] = "0"
    return out


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_each_service_runs_our_image_with_settings_it_accepts(name: str) -> None:
    box = container(name)
    assert box["args"] == [name] and box["image"].startswith("llmgw:")
    settings_module = importlib.import_module(f"{name}.settings")
    prefix = f"LLMGW_{name.upper()}"
    settings = config.load(settings_module.Settings, None, prefix, env_of(name))
    assert settings.serve.port == SERVICES[name]
    assert settings.serve.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in box["ports"]}
    health = settings.serve.health_port
    expected = {"grpc": SERVICES[name], "metrics": settings.serve.metrics_port, "health": health}
    if name == "extauthz":  # Envoy's checks, over HTTP
        expected["http-check"] = settings.http_port
    assert ports == expected
    for probe in ("readinessProbe", "livenessProbe"):  # kubelet speaks no TLS: its own port
        assert box[probe]["grpc"] == {"port": health}
    if "startupProbe" in box:  # extauthz: serving once the tenants snapshot is loaded
        assert box["startupProbe"]["grpc"] == {"port": health}
    # Mutual TLS (llmgw/tls.py) with its own pair and the CA from llmgw-tls, no other key.
    tls = settings.serve.tls
    assert tls is not None
    files = {f"{name}.crt", f"{name}.key", certs.CA_FILE}
    assert {tls.cert, tls.key, tls.ca} == {Path(TLS_SERVICE, f) for f in files}
    assert mounted_secret(name, TLS_SERVICE) == files
    assert box["resources"]["requests"] and box["resources"]["limits"]
    assert box["securityContext"]["readOnlyRootFilesystem"] is True
    spec = workload(name)["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert find("PodDisruptionBudget", name)["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": name
    }
    hpa = find("HorizontalPodAutoscaler", name)["spec"]
    assert hpa["scaleTargetRef"]["name"] == name
    assert hpa["scaleTargetRef"]["kind"] == workload(name)["kind"]


def test_each_envoy_has_the_ledgers_reconciler_of_its_access_log_beside_it() -> None:
    """No outcome lost (ledger/reconcile.py): Envoy's file access log, flushed every 200 ms, on
    an emptyDir its pod's ledger-reconcile reads with the ledger's own settings and Secrets."""
    spec = workload("envoy")["spec"]["template"]["spec"]
    boxes = {c["name"]: c for c in spec["containers"]}
    envoy, sidecar = boxes["envoy"], boxes["ledger-reconcile"]
    assert envoy["args"][envoy["args"].index("--file-flush-interval-msec") + 1] == "200"
    assert (
        sidecar["args"] == ["ledger.sidecar"] and sidecar["image"] == container("ledger")["image"]
    )
    env = env_of("envoy", sidecar)
    settings = config.load(LedgerSettings, None, "LLMGW_LEDGER", env)
    assert settings.reconcile is not None
    log = str(settings.reconcile.access_log)
    assert log == RENDER[RENDER.index("--access-log") + 1]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for box in (envoy, sidecar):
        mounts = {m["name"]: m["mountPath"] for m in box["volumeMounts"]}
        assert mounts["access-log"] == log.rpartition("/")[0], box["name"]
    assert volumes["access-log"] == {"name": "access-log", "emptyDir": {}}
    assert "tls" not in {m["name"] for m in sidecar["volumeMounts"]}  # Envoy's key is Envoy's
    assert sidecar["securityContext"]["runAsGroup"] == spec["securityContext"]["fsGroup"]
    health = settings.serve.health_port
    for probe in ("readinessProbe", "livenessProbe"):
        assert sidecar[probe]["grpc"] == {"port": health}
    ledger = {v["name"]: v for v in container("ledger")["env"]}
    for var in sidecar["env"]:
        if "valueFrom" in var or var["name"].startswith("LLMGW_LEDGER__REDIS__"):
            assert var == ledger[var["name"]], var["name"]  # the ledger's stores, credentials


def example_secret(name: str, key: str) -> str:
    path = K8S / "examples" / "secrets.yaml"
    doc = next(d for d in yaml.safe_load_all(path.read_text()) if d["metadata"]["name"] == name)
    return str(doc["stringData"][key])


@pytest.mark.parametrize("name", sorted([*SERVICES, ADMIN]))
def test_each_service_refuses_the_example_secrets_as_they_are(name: str) -> None:
    """Applied unedited, examples/secrets.yaml would make its placeholders the session HMAC key,
    the Redis password and the admin token: the services refuse to start with them."""
    env = env_of(name)
    for var in container(name)["env"]:
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None and "URL" not in var["name"]:
            env[var["name"]] = example_secret(ref["name"], ref["key"])
    settings_module = importlib.import_module(f"{name}.settings")
    with pytest.raises(config.ConfigError, match="placeholder"):
        config.load(settings_module.Settings, None, f"LLMGW_{name.upper()}", env)


def test_the_pods_key_reaches_the_pods_envoy_and_the_router_from_one_secret() -> None:
    """vLLM asks for VLLM_API_KEY on /v1; Envoy sends it from its environment (never in the
    ConfigMap), the router in extauthz with its /v1/models scrapes."""
    ref = {"secretKeyRef": {"name": "llmgw-vllm", "key": "api-key"}}
    wanted = {"vllm": "VLLM_API_KEY", "envoy": "VLLM_API_KEY"}
    wanted["extauthz"] = "LLMGW_ROUTER__FLEET__POD_API_KEY"
    for name, variable in wanted.items():
        var = next(v for v in container(name)["env"] if v["name"] == variable)
        assert var["valueFrom"] == ref, name
    assert example_secret("llmgw-vllm", "api-key")
    config = yaml.safe_load(rendered())
    openai = next(x for x in config["static_resources"]["listeners"] if x["name"] == "openai")
    (vhost,) = openai["filter_chains"][0]["filters"][0]["typed_config"]["route_config"][
        "virtual_hosts"
    ]
    header = {"key": "authorization", "value": "Bearer %ENVIRONMENT(VLLM_API_KEY)%"}
    assert vhost["request_headers_to_add"] == [
        {"header": header, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
    ]


def mounted_secret(name: str, path: str) -> set[str]:
    """The files of the Secret llmgw-tls that workload `name` mounts at `path`."""
    mount = next(m for m in container(name)["volumeMounts"] if m["mountPath"] == path)
    volumes = workload(name)["spec"]["template"]["spec"]["volumes"]
    secret = next(v for v in volumes if v["name"] == mount["name"])["secret"]
    assert secret["secretName"] == "llmgw-tls"
    return {item["path"] for item in secret["items"] if item["key"] == item["path"]}


def test_envoy_mounts_its_client_pair_where_its_config_reads_it() -> None:
    config = yaml.safe_load(rendered())
    named = set()
    for cluster in config["static_resources"]["clusters"]:
        if "transport_socket" in cluster:
            context = cluster["transport_socket"]["typed_config"]["common_tls_context"]
            (pair,) = context["tls_certificates"]
            named |= {pair["certificate_chain"]["filename"], pair["private_key"]["filename"]}
            named.add(context["validation_context"]["trusted_ca"]["filename"])
    files = {"envoy.crt", "envoy.key", certs.CA_FILE}
    assert named == {f"{TLS_ENVOY}/{f}" for f in files}
    assert mounted_secret("envoy", TLS_ENVOY) == files


def test_extauthz_replicas_get_distinct_session_worker_ids() -> None:
    """Session IDs are Snowflake IDs: two replicas with one worker ID could mint the same."""
    assert workload("extauthz")["kind"] == "StatefulSet"
    var = next(v for v in container("extauthz")["env"] if v["name"].endswith("SESSIONS__WORKER_ID"))
    assert "apps.kubernetes.io/pod-index" in var["valueFrom"]["fieldRef"]["fieldPath"]


def test_redis_asks_for_the_password_every_client_gets_from_one_secret() -> None:
    ref = {"secretKeyRef": {"name": "llmgw-redis", "key": "password"}}
    redis = container("redis")
    env = {v["name"]: v.get("valueFrom") for v in redis["env"]}
    assert env == {"REDIS_PASSWORD": ref, "REDISCLI_AUTH": ref}  # the server, its probe
    args = redis["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"  # expanded by Kubernetes
    assert "grep -q PONG" in " ".join(redis["readinessProbe"]["exec"]["command"])  # not NOAUTH
    # The rate limiter in extauthz keeps the counters, the router in it publishes the fleet load.
    clients = {
        "ledger": ["LLMGW_LEDGER__REDIS__PASSWORD"],
        "extauthz": ["LLMGW_RATELIMIT__REDIS__PASSWORD", "LLMGW_ROUTER__REDIS__PASSWORD"],
        ADMIN: ["LLMGW_ADMIN__REDIS__PASSWORD"],  # the breakers' state
    }
    for name, wanted in clients.items():
        env = {v["name"]: v.get("valueFrom") for v in container(name)["env"]}
        assert [env.get(var) for var in wanted] == [ref] * len(wanted), name
    secrets = yaml.safe_load_all((K8S / "examples" / "secrets.yaml").read_text())
    assert (
        "password"
        in next(d for d in secrets if d["metadata"]["name"] == "llmgw-redis")["stringData"]
    )


def ingress_from(target: str) -> list[tuple[set[str], set[int]]]:
    """(pod names or 'monitoring' or 'anyone', ports) per ingress rule of the target's policy."""
    policies = [
        d
        for d in docs()
        if d["kind"] == "NetworkPolicy"
        and d["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/name") == target
    ]
    assert len(policies) == 1, target
    rules = []
    for rule in policies[0]["spec"]["ingress"]:
        peers = set()
        for peer in rule["from"]:
            if "podSelector" in peer:
                peers.add(peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"])
            elif "namespaceSelector" in peer:
                peers.add(peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"])
            else:
                peers.add("anyone")
        rules.append((peers, {p["port"] for p in rule["ports"]}))
    return rules


def egress_to(source: str) -> list[tuple[set[str], set[int]]] | None:
    """(pod names or 'anyone', ports) per egress rule of the source's policy; None: egress is
    not restricted."""
    (policy,) = [
        d
        for d in docs()
        if d["kind"] == "NetworkPolicy"
        and d["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/name") == source
    ]
    if "Egress" not in policy["spec"]["policyTypes"]:
        return None
    rules = []
    for rule in policy["spec"].get("egress", []):
        peers = {
            p["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for p in rule.get("to", [])
        }
        rules.append((peers or {"anyone"}, {p["port"] for p in rule["ports"]}))
    return rules


def test_network_policies_let_only_envoy_reach_the_services_and_services_the_stores() -> None:
    deny = find("NetworkPolicy", "default-deny-ingress")["spec"]
    assert (
        deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and "ingress" not in deny
    )
    for name, port in SERVICES.items():
        metrics = env_of(name)[f"LLMGW_{name.upper()}__SERVE__METRICS_PORT"]
        from_envoy = {port, 9011} if name == "extauthz" else {port}  # + its HTTP check port
        assert ingress_from(name) == [({"envoy"}, from_envoy), ({"monitoring"}, {int(metrics)})]
    for store, clients in STORES.items():
        rules = ingress_from(store)
        assert len(rules) == 1 and rules[0][0] == clients
    # The admin API: Prometheus alone (operators port-forward, which no policy sees), and it
    # reaches PostgreSQL, Redis (the breakers' state) and DNS alone.
    admin = config.load(AdminSettings, None, "LLMGW_ADMIN", env_of(ADMIN))
    assert ingress_from(ADMIN) == [({"monitoring"}, {admin.port})]
    postgres = container("postgres")["ports"][0]["containerPort"]
    assert admin.redis is not None and admin.redis.host == "redis"
    assert egress_to(ADMIN) == [
        ({"postgres"}, {postgres}),
        ({"redis"}, {admin.redis.port}),
        ({"anyone"}, {53}),
    ]
    assert ({"anyone"}, {8080}) in ingress_from("envoy")
    # The pods: Envoy's requests and the scrapes of the router in extauthz; Prometheus.
    port = workload("vllm")["spec"]["template"]["spec"]["containers"][0]["ports"][0]
    events = {
        p["containerPort"]
        for p in workload("vllm")["spec"]["template"]["spec"]["containers"][0]["ports"][1:]
    }
    assert ingress_from("vllm") == [
        ({"envoy", "extauthz"}, {port["containerPort"]}),
        ({"extauthz"}, events),  # the KV events: the router's subscriptions alone
        ({"monitoring"}, {port["containerPort"]}),
    ]
    # Every policy selects a workload of the manifests (none is left for a removed router).
    names = {
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
        for d in docs()
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    for policy in (d for d in docs() if d["kind"] == "NetworkPolicy"):
        selected = policy["spec"]["podSelector"].get("matchLabels", {})
        assert not selected or selected["app.kubernetes.io/name"] in names, policy
        for rule in policy["spec"].get("ingress", []) + policy["spec"].get("egress", []):
            for peer in rule.get("from", rule.get("to", [])):
                if "podSelector" in peer:
                    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"] in names


def extauthz_holding(
    monkeypatch: pytest.MonkeyPatch, service: str, prefix: str
) -> ExtauthzSettings:
    """extauthz's settings, with the environment of the part it holds (its `prefix` keys) set
    as extauthz reads it. The part has no Deployment, Service, PDB or HPA of its own, and only
    its own settings apply inside extauthz: a SERVE__PORT of its own would also leave the
    image's health check two ports to choose from."""
    kinds = ("Deployment", "StatefulSet", "Service", "PodDisruptionBudget")
    kinds += ("HorizontalPodAutoscaler",)
    assert not [d for d in docs() if d["kind"] in kinds and d["metadata"]["name"] == service]
    env = env_of("extauthz")
    settings = config.load(ExtauthzSettings, None, "LLMGW_EXTAUTHZ", env)
    keys = [k for k in env if k.startswith(prefix)]
    assert keys and not [k for k in keys if "__SERVE__" in k or "__TRACING__" in k]
    for key in [k for k in os.environ if k.startswith(prefix)]:
        monkeypatch.delenv(key)
    for key in keys:
        monkeypatch.setenv(key, env[key])
    return settings


def test_extauthz_holds_the_router_and_there_is_no_router_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the local stack runs it: extauthz picks (the gateway topology, Envoy's config's too),
    with router settings the router's own schema and plugin profile accept (read as extauthz
    reads them), pods from the headless Service `vllm` and the fleet load published to the
    `redis` Service."""
    settings = extauthz_holding(monkeypatch, "router", "LLMGW_ROUTER__")
    assert settings.topology is Topology.GATEWAY
    assert "--topology" in RENDER and RENDER[RENDER.index("--topology") + 1] == "gateway"
    router = picking(settings)  # extauthz's own reading: schema, plugins and profile
    vllm = find("Service", "vllm")
    assert vllm["spec"]["clusterIP"] == "None"  # every pod resolved
    assert router.fleet.dns is not None and router.fleet.dns.name == "vllm"
    assert router.fleet.dns.port in {p["port"] for p in vllm["spec"]["ports"]}
    assert router.redis is not None
    assert router.redis.host == "redis" and router.redis.password is not None
    assert router.redis.port in {p["port"] for p in find("Service", "redis")["spec"]["ports"]}
    assert router.redis.cluster is False


def test_the_router_subscribes_where_the_pods_publish_and_hashes_as_they_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each pod binds its KV-event sockets on the ports the router in extauthz connects to,
    and hashes its blocks with the algorithm and seed extauthz hashes requests with."""
    settings = extauthz_holding(monkeypatch, "router", "LLMGW_ROUTER__")
    events = picking(settings).fleet.kv_events
    assert events is not None
    args = container("vllm")["args"]
    config = json.loads(
        next(a for a in args if a.startswith("--kv-events-config=")).split("=", 1)[1]
    )
    assert config["enable_kv_cache_events"] and config["publisher"] == "zmq"
    assert config["endpoint"] == f"tcp://*:{events.port}"  # bound: vLLM connects to others
    assert config["replay_endpoint"] == f"tcp://*:{events.replay_port}"
    endpoint = events.endpoint("10.0.0.7:8000")
    assert endpoint is not None and endpoint.publish == f"tcp://10.0.0.7:{events.port}"
    hashing = settings.decision.kv_hashing
    assert f"--prefix-caching-hash-algo={hashing.algo}" in args
    assert env_of("vllm")["PYTHONHASHSEED"] == hashing.seed


def test_the_inference_pool_example_points_at_the_router_in_picker_mode() -> None:
    example = [
        d for d in yaml.safe_load_all((K8S / "inference-pool" / "picker.yaml").read_text()) if d
    ]
    pool = next(d for d in example if d["kind"] == "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    # The pool's pods are the vLLM pods, on the port they serve.
    vllm = workload("vllm")["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= vllm["metadata"]["labels"].items()
    port = vllm["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert pool["spec"]["targetPorts"] == [{"number": port}]
    # The picker reference names the router's Service and gRPC port.
    ref = pool["spec"]["endpointPickerRef"]
    service = next(d for d in example if d["kind"] == "Service")
    assert ref["name"] == service["metadata"]["name"]
    assert ref["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    route = next(d for d in example if d["kind"] == "HTTPRoute")
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["metadata"]["name"])
    # The router, in picker mode, with settings it accepts, probed on the protocol's services.
    deployment = next(d for d in example if d["kind"] == "Deployment")
    box = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {v["name"]: v["value"] for v in box["env"]}
    from router.settings import Settings

    settings = config.load(Settings, None, "LLMGW_ROUTER", env)
    assert settings.inference_pool.enabled
    assert settings.serve.port == ref["port"]["number"]
    assert settings.fleet.dns is not None and settings.fleet.dns.port == port
    assert box["readinessProbe"]["grpc"] == {"port": settings.serve.port, "service": "readiness"}
    assert box["livenessProbe"]["grpc"] == {"port": settings.serve.port, "service": "liveness"}


def test_extauthz_holds_the_rate_limiter_and_there_is_no_ratelimit_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the local stack runs it: extauthz admits (the gateway topology), with rate-limit
    settings the rate limiter's own schema accepts (read as extauthz reads them), its counters
    in the `redis` Service with the shared password, and the same cluster switch as the
    router's."""
    settings = extauthz_holding(monkeypatch, "ratelimit", "LLMGW_RATELIMIT__")
    assert settings.holds_limiter
    env = env_of("extauthz")
    limiter = admitting(settings)  # extauthz's own reading
    assert limiter.redis.host == "redis"
    assert limiter.redis.port in {p["port"] for p in find("Service", "redis")["spec"]["ports"]}
    assert limiter.redis.password is not None
    assert str(limiter.redis.cluster).lower() == env["LLMGW_ROUTER__REDIS__CLUSTER"]
    assert limiter.replicas >= 2  # degraded mode assumes at least the HPA's minimum


def admin_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The admin container's environment (Secrets stood in for), set as the process's."""
    env = env_of(ADMIN)
    for key in [k for k in os.environ if k.startswith("LLMGW_ADMIN__")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def test_the_admin_api_runs_our_image_with_settings_its_check_config_accepts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    box = container(ADMIN)
    assert box["args"] == [ADMIN] and box["image"] == container("ledger")["image"]
    env = admin_env(monkeypatch)
    empty = tmp_path / "admin.yaml"
    empty.write_text("{}\n")
    assert admin_cli(["--check-config", str(empty)]) == 0, capsys.readouterr().err
    settings = config.load(AdminSettings, None, "LLMGW_ADMIN", env)
    assert settings.host == "0.0.0.0"  # the probes and Prometheus reach the pod's address
    assert {p["name"]: p["containerPort"] for p in box["ports"]} == {"http": settings.port}
    assert box["resources"]["requests"] and box["resources"]["limits"]
    assert box["securityContext"]["readOnlyRootFilesystem"] is True
    assert workload(ADMIN)["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def dicts(node: Any) -> Iterator[dict[str, Any]]:
    """Every mapping in a parsed YAML tree."""
    if isinstance(node, dict):
        yield node
        node = list(node.values())
    if isinstance(node, list):
        for value in node:
            yield from dicts(value)


def test_the_admin_api_is_one_replica_behind_a_cluster_ip_service_only() -> None:
    """Logins live in the process's memory, and one writer: one replica, replaced (never two
    at once). Its Service is in-cluster only, and nothing routes to it: no NodePort,
    LoadBalancer, Ingress or Gateway route, no cluster of Envoy's."""
    spec = workload(ADMIN)["spec"]
    assert workload(ADMIN)["kind"] == "Deployment"
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    assert not [d for d in docs() if d["metadata"]["name"] == ADMIN and "Autoscaler" in d["kind"]]
    service = find("Service", ADMIN)["spec"]
    assert service.get("type", "ClusterIP") == "ClusterIP" and service.get("clusterIP") != "None"
    assert not [p for p in service["ports"] if "nodePort" in p]
    port = config.load(AdminSettings, None, "LLMGW_ADMIN", env_of(ADMIN)).port
    assert port in {p["port"] for p in service["ports"]}  # port-forward svc/admin 8086
    # No other Service selects its pod; no Ingress or Gateway API route names it.
    labels = workload(ADMIN)["spec"]["template"]["metadata"]["labels"]
    for doc in docs() + [
        d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d
    ]:
        if doc["kind"] == "Service" and doc["metadata"]["name"] != ADMIN:
            selector = doc["spec"].get("selector") or {"none": "none"}
            assert not selector.items() <= labels.items(), doc["metadata"]["name"]
        if doc["kind"] in ("Ingress", "HTTPRoute", "GRPCRoute", "Gateway"):
            assert ADMIN not in {d.get("name") for d in dicts(doc["spec"])}, doc["kind"]
    # No address of Envoy's config is the admin Service (its own admin is on its loopback).
    addresses = {d["address"] for d in dicts(yaml.safe_load(rendered())) if "port_value" in d}
    assert "vllm" in addresses and not [a for a in addresses if a.split(".")[0] == ADMIN]
    header = (K8S / "admin.yaml").read_text()
    assert f"kubectl -n llmgw port-forward svc/{ADMIN} {port}" in header
    assert f"http://127.0.0.1:{port}/console/" in header


def resolved(box: dict[str, Any], port: int | str) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    named = {p["name"]: p["containerPort"] for p in box["ports"]}
    return port if isinstance(port, int) else named[port]


def test_the_admin_apis_probes_ask_its_health_and_liveness_no_database() -> None:
    """Started and ready: /health (200 while the database answers) on its port. Alive: an open
    route on its port that does not ask the database, so an outage does not restart it."""
    box = container(ADMIN)
    port = config.load(AdminSettings, None, "LLMGW_ADMIN", env_of(ADMIN)).port
    for probe in ("startupProbe", "readinessProbe"):
        get = box[probe]["httpGet"]
        assert (get["path"], resolved(box, get["port"])) == ("/health", port), probe
    live = box["livenessProbe"]["httpGet"]
    assert resolved(box, live["port"]) == port
    (route,) = [r for r in admin_routes.ROUTES if r.method == "GET" and r.path == live["path"]]
    assert not route.auth and route.operation == "metrics"


def test_the_admin_token_and_database_come_from_secrets() -> None:
    env = {v["name"]: v for v in container(ADMIN)["env"]}
    assert env["LLMGW_ADMIN__DATABASE_URL"]["valueFrom"] == DATABASE_URL
    ledger = {v["name"]: v for v in container("ledger")["env"]}
    assert ledger["LLMGW_LEDGER__DATABASE_URL"]["valueFrom"] == DATABASE_URL  # the same one
    ref = env["LLMGW_ADMIN__ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert example_secret(ref["name"], ref["key"])  # examples/secrets.yaml has it
    for name, var in env.items():
        if any(word in name for word in ("TOKEN", "URL", "PASSWORD", "SECRET")):
            assert "value" not in var, name  # never a literal


def test_extauthz_follows_the_database_with_its_cache_on_a_writable_volume() -> None:
    """Tenants from the admin API's tables; the last snapshot cached where the read-only root
    file system lets it be written, on an emptyDir, which outlives a restart of the container:
    restarted while the database is down, extauthz serves from it."""
    settings = config.load(ExtauthzSettings, None, "LLMGW_EXTAUTHZ", env_of("extauthz"))
    assert settings.tenants_source == "database" and settings.tenants_cache is not None
    env = {v["name"]: v for v in container("extauthz")["env"]}
    assert env["LLMGW_EXTAUTHZ__TENANTS_DATABASE_URL"]["valueFrom"] == DATABASE_URL
    box = container("extauthz")
    assert box["securityContext"]["readOnlyRootFilesystem"] is True
    (mount,) = [
        m
        for m in box["volumeMounts"]
        if settings.tenants_cache.parent.is_relative_to(m["mountPath"])
    ]
    assert not mount.get("readOnly")
    volumes = workload("extauthz")["spec"]["template"]["spec"]["volumes"]
    assert next(v for v in volumes if v["name"] == mount["name"]) == {
        "name": mount["name"],
        "emptyDir": {},
    }
    assert "LLMGW_EXTAUTHZ__TENANTS_FILE" not in env  # nothing else claims to be the source


def test_the_admins_one_time_import_reads_the_tenants_secret_where_it_is_mounted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Migrating from the file mode (admin.yaml's header): the import the header sets names the
    file of the Secret llmgw-tenants where the admin mounts it (optional: none needed after),
    and its `--check-config` accepts the example's tenants file there."""
    header = (K8S / "admin.yaml").read_text()
    path = Path(header.split("LLMGW_ADMIN__IMPORT_TENANTS_FILE=", 1)[1].split()[0])
    (mount,) = [m for m in container(ADMIN)["volumeMounts"] if path.parent == Path(m["mountPath"])]
    volumes = workload(ADMIN)["spec"]["template"]["spec"]["volumes"]
    secret = next(v for v in volumes if v["name"] == mount["name"])["secret"]
    assert secret == {"secretName": "llmgw-tenants", "optional": True} and mount["readOnly"]
    example = tmp_path / path.name
    example.write_text(example_secret("llmgw-tenants", path.name))
    admin_env(monkeypatch)
    monkeypatch.setenv("LLMGW_ADMIN__IMPORT_TENANTS_FILE", str(example))
    empty = tmp_path / "admin.yaml"
    empty.write_text("{}\n")
    assert admin_cli(["--check-config", str(empty)]) == 0, capsys.readouterr().err
