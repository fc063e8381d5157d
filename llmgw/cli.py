"""The `llmgw` command."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from extauthz import cli as extauthz_cli
from llmgw import config, envoyconf, logs
from llmgw.envoyconf import Address
from llmgw.stack import Stack, StackSettings

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
    return config.validate(
        StackSettings, {**settings.model_dump(), **update}, str(args.config or "arguments")
    )


def cmd_up(args: argparse.Namespace) -> int:
    from llmgw.launcher import supervise

    settings = _stack_settings(args)
    state_dir = args.state_dir / time.strftime("run-%Y%m%d-%H%M%S")
    return supervise(Stack(settings, state_dir), args.ready_file)


def cmd_render_envoy(args: argparse.Namespace) -> int:
    settings = config.load(envoyconf.EnvoySettings, args.config, "LLMGW_ENVOY")
    if settings.admin.port == 0:
        settings = settings.model_copy(update={"admin": Address(port=ADMIN_PORT)})
    pods = [envoyconf.parse_endpoint(u) for u in args.upstream]
    sys.stdout.write(envoyconf.render(settings, _listen(args.listen), pods))
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="llmgw", description=__doc__)
    top.add_argument("--log-level", default="info")
    sub = top.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run Envoy, Redis, the services and pods on this machine")
    up.add_argument("--config", type=Path, help="stack settings YAML (llmgw.stack.StackSettings)")
    up.add_argument("--listen", help="HOST:PORT for the OpenAI endpoint (default 127.0.0.1:8080)")
    up.add_argument("--pods", type=int, help="number of simulated vLLM pods (default 2)")
    up.add_argument(
        "--upstream",
        action="append",
        default=[],
        help="a real vLLM server, host:port or http://host:port (repeatable); no pods simulated",
    )
    up.add_argument("--sim-arg", action="append", default=[], help="extra flags for every pod")
    up.add_argument("--ready-file", type=Path, help="write base URL, keys and pods here as JSON")
    up.add_argument("--state-dir", type=Path, default=Path(".llmgw"), help="logs and configs")
    up.set_defaults(func=cmd_up)

    render = sub.add_parser("render-envoy", help="print the Envoy config for the given pods")
    render.add_argument("--config", type=Path, help="Envoy settings YAML (EnvoySettings)")
    render.add_argument("--listen", default="0.0.0.0:8080")
    render.add_argument("--upstream", action="append", required=True, help="host:port")
    render.set_defaults(func=cmd_render_envoy)

    extauthz_cli.register(sub)  # `tenants` and `keys`
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logs.setup(args.log_level)
    try:
        return int(args.func(args))
    except (config.ConfigError, ValueError) as exc:
        print(f"llmgw: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
