"""The `llmgw` command."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from extauthz import cli as extauthz_cli
from llmgw import config, logs
from llmgw.config import deprecated
from llmgw.tls import ENVOY_IDENTITY
from llmgw.topology import Topology
from tools import certs, envoyconf, spend, usage
from tools.engine import InstallError
from tools.envoyconf import Address
from tools.stack import Stack, StackSettings

ADMIN_PORT = 9901  # Envoy's conventional admin port, for rendered deployments


def _listen(spec: str) -> Address:
    host, _, port = spec.rpartition(":")
    return Address(host=host or "127.0.0.1", port=int(port))


def _stack_settings(args: argparse.Namespace) -> StackSettings:
    settings = config.load(StackSettings, args.config, "LLMGW_STACK")
    update: dict[str, object] = {}
    if args.listen:
        update["listen"] = _listen(args.listen)
    if args.pods is not None:
        update["pods"] = args.pods
    if args.upstream:
        update["upstreams"] = args.upstream
    if args.sim_arg:
        update["sim_args"] = [a for arg in args.sim_arg for a in arg.split()]
    if args.engine:
        update["engine"] = args.engine
    if args.vllm_arg:
        vllm_args = [a for arg in args.vllm_arg for a in shlex.split(arg)]
        update["vllm"] = {**settings.vllm.model_dump(), "args": vllm_args}
    if args.tokenizer:
        update["tokenizer"] = args.tokenizer
    if args.responses_store:
        update["responses_store"] = True
    update["admin"] = not args.no_admin_api
    if args.database_url:
        update["database_url"] = args.database_url
    if settings.postgres_dir is None:  # the local ledger outlives one run of the stack
        update["postgres_dir"] = args.state_dir / "postgres"
    return config.validate(
        StackSettings, {**settings.model_dump(), **update}, str(args.config or "arguments")
    )


def cmd_up(args: argparse.Namespace) -> int:
    from tools.launcher import supervise

    # Owner-only, whatever the children create (Envoy's access log, Redis's files, configs).
    os.umask(0o077)
    settings = _stack_settings(args)
    state_dir = args.state_dir / time.strftime("run-%Y%m%d-%H%M%S")
    return supervise(Stack(settings, state_dir), args.ready_file)


RENDERED_SERVICES = ("extauthz", "ratelimit", "router", "ledger")


def cmd_render_envoy(args: argparse.Namespace) -> int:
    if args.extauthz is None and not args.insecure_no_auth:
        raise ValueError(
            "render-envoy: no --extauthz HOST:PORT: the gateway would serve the pods to anyone "
            "who reaches it. Pass --insecure-no-auth to render it anyway."
        )
    settings = config.load(envoyconf.EnvoySettings, args.config, "LLMGW_ENVOY")
    update: dict[str, Address | str | envoyconf.UpstreamTls] = {}
    if args.admin:
        update["admin"] = _listen(args.admin)
    elif settings.admin.port == 0:
        update["admin"] = Address(port=ADMIN_PORT)
    if args.stats:
        update["stats"] = _listen(args.stats)
    if args.pod_key_env:
        update["pod_key_env"] = args.pod_key_env
    if args.access_log:
        update["access_log_path"] = args.access_log
    if args.otlp:
        update["otlp"] = envoyconf.parse_endpoint(args.otlp)
    if args.tls:  # where Envoy reads them: `llmgw certs` names the files
        pair, ca = f"{args.tls}/{ENVOY_IDENTITY}", f"{args.tls}/{certs.CA_FILE}"
        update["tls"] = envoyconf.UpstreamTls(cert=f"{pair}.crt", key=f"{pair}.key", ca=ca)
    # Validated again: a model_copy would take an admin on 0.0.0.0 unchecked.
    settings = envoyconf.EnvoySettings.model_validate({**settings.model_dump(), **update})
    named = {
        name: envoyconf.parse_endpoint(getattr(args, name))
        for name in RENDERED_SERVICES
        if getattr(args, name)
    }
    if args.extauthz_http and args.extauthz_keys:
        raise ValueError("--extauthz-keys: deprecated, and --extauthz-http is given: drop it")
    http = args.extauthz_http or args.extauthz_keys
    services = envoyconf.Services.model_validate(
        {
            **named,
            "topology": _topology(args),
            "extauthz_http": envoyconf.parse_endpoint(http) if http else None,
        }
    )
    pods = [envoyconf.parse_endpoint(u) for u in args.upstream]
    sys.stdout.write(envoyconf.render(settings, _listen(args.listen), pods, services))
    return 0


def _topology(args: argparse.Namespace) -> Topology:
    """--topology, else the shape the deprecated flags name (the check over HTTP unless
    extauthz's HTTP port came as --extauthz-keys), else the gateway."""
    old = {
        "--router-in-extauthz": (args.router_in_extauthz, "--topology"),
        "--ratelimit-in-extauthz": (args.ratelimit_in_extauthz, "--topology"),
        "--extauthz-keys": (args.extauthz_keys is not None, "--extauthz-http and --topology"),
    }
    given = [flag for flag, (on, _) in old.items() if on]
    if not given:
        return Topology(args.topology or Topology.GATEWAY)
    if args.topology:
        raise ValueError(f"{', '.join(given)}: deprecated, and --topology is given: drop it")
    for flag in given:
        deprecated(flag, old[flag][1])
    return Topology.of(
        limiter_inside=args.ratelimit_in_extauthz,
        router_inside=args.router_in_extauthz,
        check_over_http=args.extauthz_keys is None,
    )


def cmd_certs(args: argparse.Namespace) -> int:
    out = certs.generate(args.out)
    print(
        f"{out}: {certs.CA_FILE}, {ENVOY_IDENTITY}.crt/key, "
        + ", ".join(f"{s}.crt/key" for s in certs.SERVICES)
    )
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="llmgw", description=__doc__)
    top.add_argument("--log-level", default="info")
    sub = top.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run Envoy, Redis, the services and pods on this machine")
    up.add_argument("--config", type=Path, help="stack settings YAML (tools.stack.StackSettings)")
    up.add_argument("--listen", help="HOST:PORT for the OpenAI endpoint (default 127.0.0.1:8080)")
    up.add_argument("--pods", type=int, help="number of pods (default 2)")
    up.add_argument(
        "--engine",
        choices=["sim", "vllm"],
        help="what serves the pods: sim (default; the simulator) or vllm (real vLLM, its CPU "
        "build, in the environment `make vllm` installs, serving a tiny model made on first use)",
    )
    up.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        help="extra flags for every vLLM pod, split as a shell would (repeatable)",
    )
    up.add_argument(
        "--upstream",
        action="append",
        default=[],
        help="a real vLLM server, host:port or http://host:port (repeatable); no pods started",
    )
    up.add_argument("--sim-arg", action="append", default=[], help="extra flags for every pod")
    up.add_argument(
        "--tokenizer",
        type=Path,
        help="the served model's tokenizer.json: the pods and the gateway count prompts with it",
    )
    up.add_argument(
        "--no-admin-api",
        action="store_true",
        help="no admin API: extauthz follows the tenants file (`llmgw keys`) instead of the "
        "database the admin API writes",
    )
    up.add_argument(
        "--responses-store",
        action="store_true",
        help="keep the Responses API's responses on the pods (store, previous_response_id, "
        "GET /v1/responses/ID); default: stateless",
    )
    up.add_argument(
        "--ready-file",
        type=Path,
        help="also write base URL, keys and pods here as JSON (the run directory's ready.json)",
    )
    up.add_argument(
        "--database-url", help="PostgreSQL for the usage ledger (default: a local server of ours)"
    )
    up.add_argument("--state-dir", type=Path, default=Path(".llmgw"), help="logs and configs")
    up.set_defaults(func=cmd_up)

    render = sub.add_parser("render-envoy", help="print the Envoy config for the given pods")
    render.add_argument("--config", type=Path, help="Envoy settings YAML (EnvoySettings)")
    render.add_argument("--listen", default="0.0.0.0:8080")
    render.add_argument("--upstream", action="append", required=True, help="host:port")
    for name in RENDERED_SERVICES:
        render.add_argument(f"--{name}", metavar="HOST:PORT", help=f"the {name} service (gRPC)")
    render.add_argument(
        "--topology",
        choices=[t.value for t in Topology],
        help="how Envoy checks and where the rate limiter and the router run (README, "
        "Topologies): gateway (default; the check over HTTP, both inside extauthz), grpc-check "
        "(over gRPC), rls (the rate limiter apart: --ratelimit), epp (the router apart: --router)",
    )
    render.add_argument(
        "--extauthz-http",
        metavar="HOST:PORT",
        help="extauthz's HTTP port (its `http_port`): Envoy asks it whose key a request carries, "
        "at the headers, before buffering any body; in the gateway topology it checks there too",
    )
    render.add_argument("--extauthz-keys", metavar="HOST:PORT", help="deprecated: --extauthz-http")
    for flag in ("--router-in-extauthz", "--ratelimit-in-extauthz"):
        render.add_argument(flag, action="store_true", help="deprecated: --topology")
    render.add_argument("--otlp", metavar="HOST:PORT", help="OpenTelemetry collector (OTLP/gRPC)")
    render.add_argument(
        "--admin", metavar="HOST:PORT", help=f"admin (default 127.0.0.1:{ADMIN_PORT})"
    )
    render.add_argument(
        "--stats",
        metavar="HOST:PORT",
        help="a listener serving only the admin's /ready and /stats/prometheus (probes, scrapes)",
    )
    render.add_argument(
        "--access-log",
        metavar="PATH",
        help="Envoy's file access log, every entry as JSON lines: what the ledger's reconciler "
        "(python -m ledger.sidecar, beside Envoy) recovers the gRPC access log's losses from",
    )
    render.add_argument(
        "--pod-key-env",
        metavar="NAME",
        help="Envoy's environment variable holding the pods' vLLM --api-key (sent as "
        "`authorization: Bearer KEY`)",
    )
    render.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="render without --extauthz: no API key checked, no tenant, no quota",
    )
    render.add_argument(
        "--tls",
        metavar="DIR",
        help="mutual TLS to the services with Envoy's certificates from `llmgw certs`, as Envoy "
        "reads them: DIR/ca.crt, DIR/envoy.crt, DIR/envoy.key (without it: plaintext, and "
        "whoever reaches the services' ports can report outcomes)",
    )
    render.set_defaults(func=cmd_render_envoy)

    made = sub.add_parser(
        "certs",
        help="a fresh CA, Envoy's client certificate and each service's server certificate "
        "(mutual TLS between Envoy and the services)",
    )
    made.add_argument("--out", type=Path, required=True, help="directory (made 0700)")
    made.set_defaults(func=cmd_certs)

    extauthz_cli.register(sub)  # `tenants` and `keys`
    usage.register(sub)  # `usage`, from the ledger
    spend.register(sub)  # `spend`: money budgets in Redis
    return top


def main(argv: list[str] | None = None) -> int:
    top = parser()
    args = top.parse_args(argv)
    if args.func is cmd_up and args.engine == "vllm" and args.upstream:
        top.error(
            "up: --engine vllm starts pods of its own; --upstream names pods someone else runs: "
            "give one or the other"
        )
    logs.setup(args.log_level)
    try:
        return int(args.func(args))
    except (config.ConfigError, ValueError) as exc:
        print(f"llmgw: {exc}", file=sys.stderr)
        return 2
    except InstallError as exc:
        print(f"llmgw: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
