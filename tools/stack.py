"""The local stack: Redis, simulated or real pods, the services, then Envoy in front.

One composition used by `llmgw up` and by the test fixtures, so that what the tests run is what a
user runs.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Literal

import redis
from pydantic import Field, SecretStr, model_validator

from extauthz.demo import seed_demo
from llmgw.config import Strict, renamed, reveal
from llmgw.kvblocks import KvHashing
from llmgw.responses import STORE_ENV
from llmgw.tls import ENVOY_IDENTITY
from llmgw.topology import Topology, pop_deprecated
from router.fleet import KvEndpoint, KvEventSettings
from sim.types import SimSettings
from tools import certs, envoyconf
from tools.engine import (
    BLOCK_SIZE,
    HASH_ALGO,
    HASH_SEED,
    VllmSettings,
    ensure_model,
    kv_events_config,
    pod_argv,
    pod_env,
)
from tools.envoyconf import Address, EnvoySettings, Services, UpstreamTls
from tools.postgres import Postgres
from tools.procs import (
    Process,
    StartError,
    bin_path,
    free_port,
    grpc_serving,
    http_ok,
    redis_ping,
    stop_all,
)
from tools.serving import Serving

SIM_MODULE = "sim"
POD_KEY_ENV = "VLLM_API_KEY"  # vLLM's variable for --api-key; Envoy's too (pod_key_env)
ServiceName = Literal["extauthz", "ratelimit", "router", "ledger"]
PodEngine = Literal["sim", "vllm", "external"]
# The router's scrapes of real pods: a CPU pod's /metrics takes up to 75 ms, more while it
# computes on the same cores, past the 50 ms timeout (the pod would never be pickable).
PATIENT_SCRAPES = {"FLEET__SCRAPE_TIMEOUT": "1.0", "FLEET__STALE_AFTER": "10.0"}


class StackSettings(Strict):
    listen: Address = Address(host="127.0.0.1", port=8080)
    pods: int = Field(default=2, ge=0)
    # Real vLLM servers (host:port or http://host:port); when given, no pods are simulated.
    upstreams: tuple[str, ...] = ()
    # The pods' vLLM --api-key: the upstreams' if they ask for one; None with simulated pods:
    # one is generated, so that only the gateway and the router reach their /v1.
    pod_api_key: SecretStr | None = None
    # What serves the pods this stack starts: the simulator, or real vLLM (its CPU build).
    engine: Literal["sim", "vllm"] = "sim"
    # With a tokenizer, the pods publish their KV events and the router routes on them (README,
    # Routing, "KV events"); off: its approximate prefix index alone (bench/routing's "router").
    kv_events: bool = True
    vllm: VllmSettings = VllmSettings()
    # With engine vllm, this many simulated pods after the real ones: one fleet of both.
    sim_pods: int = Field(default=0, ge=0)
    sim_args: tuple[str, ...] = ()  # extra flags for each simulated pod: `python -m sim --help`
    # The served model's tokenizer.json: the simulated pods count prompts with it (`--tokenizer`)
    # and extauthz reserves them by it (decision.tokenizer). Real vLLM pods: their model's own,
    # always.
    tokenizer: Path | None = None
    pod_args: tuple[tuple[str, ...], ...] = ()  # more flags for pod i, after sim_args
    # The callout services in front of the pods. Rate limits read extauthz's tenant context, so
    # without extauthz they count nothing.
    # The ledger settles tokens and keeps the usage ledger, in PostgreSQL.
    services: tuple[ServiceName, ...] = ("extauthz", "ratelimit", "router", "ledger")
    # The admin API (admin/: tenants, keys, usage) on a free loopback port, on the stack's
    # PostgreSQL (the ledger's), with a token made for the run; the demo tenants imported, and
    # extauthz following the database (the source of truth then: the tenants file is only
    # imported at start). `llmgw up` runs it; off, extauthz follows the tenants file.
    admin: bool = False
    # How Envoy checks and where the rate limiter and the router run (llmgw/topology.py); the
    # gateway is what compose and k8s run.
    topology: Topology = Topology.GATEWAY
    # An existing PostgreSQL server for the ledger; None: start one, its data in `postgres_dir`
    # (None: inside the run's state directory, gone with it).
    database_url: str | None = None
    postgres_dir: Path | None = None
    # The tier table (llmgw/tiers.py): ratelimit, extauthz, the ledger (breakers).
    tiers_file: Path | None = None
    # How long a token reservation waits for the ledger's settlement (then it stays charged).
    ratelimit_reservation_ttl_s: float = Field(default=3600.0, gt=0)
    # extauthz hands each tenant's priority to the pods' scheduler (x-vllm-priority); off: all 0.
    engine_priority: bool = True
    # The Responses API's store: the pods keep responses (VLLM_ENABLE_RESPONSES_API_STORE) and
    # the gateway routes a stored response's requests to its pod (README, "Stored responses").
    responses_store: bool = False
    # Mutual TLS between Envoy and the services (llmgw/tls.py), with certificates made for the
    # run in its state directory: only Envoy reports outcomes. Off only to measure what it costs.
    tls: bool = True
    envoy: EnvoySettings = EnvoySettings()
    start_timeout: float = 60.0

    @model_validator(mode="before")
    @classmethod
    def _deprecated_booleans(cls, data: Any) -> Any:
        """router_in_extauthz, ratelimit_in_extauthz and extauthz_http (each true by default;
        the check went over HTTP only with both inside): their topology."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        old = {"ratelimit_in_extauthz": True, "router_in_extauthz": True, "extauthz_http": True}
        shape = pop_deprecated(data, old, "stack settings")
        if shape is not None:
            limiter, router, http = shape
            data["topology"] = Topology.of(
                limiter_inside=limiter,
                router_inside=router,
                check_over_http=http and limiter and router,
            )
        return data

    @model_validator(mode="after")
    def _sim_pods_beside_real_ones(self) -> StackSettings:
        if self.sim_pods and (self.engine != "vllm" or self.upstreams):
            raise ValueError("sim_pods: simulated pods beside real ones need engine vllm")
        return self

    @model_validator(mode="before")
    @classmethod
    def _old_tier_table_name(cls, data: object) -> object:
        return renamed(data, {"ratelimit_limits": "tiers_file"}, "stack ")


class Stack:
    """Start in dependency order, stop in reverse; every child dies with its parent."""

    def __init__(self, settings: StackSettings, state_dir: Path) -> None:
        self.settings = settings
        self.state_dir = state_dir
        self.processes: list[Process] = []
        self.pod_processes: list[Process] = []
        self.pods: list[Address] = []
        self.serving: list[Serving] = []  # what pods[i] serves
        self.listen = settings.listen
        self.admin = settings.envoy.admin
        self.redis_port = 0
        # Redis's `requirepass`, for this Stack's lifetime: a restarted Redis gets the same argv.
        # Hex: redis-server reads an argv value starting with "--" as the next option, and
        # token_urlsafe starts with "--" once in 4,096 (a stack that then failed to start).
        self.redis_password = secrets.token_hex(24)
        self.pod_api_key = reveal(settings.pod_api_key)
        self.database_url: str | None = None
        # The admin API's URL (not Envoy's admin: `admin_url`) and its token, made for the run.
        self.admin_api_url: str | None = None
        self.admin_token = secrets.token_hex(32)
        self.services = Services()
        self.metrics: dict[str, str] = {}
        self.tenants_file = state_dir / "tenants.yaml"
        # The operator's own file, not a copy: its edits reload in every service.
        self.tiers_file = settings.tiers_file.resolve() if settings.tiers_file else None
        self.tenants: list[dict[str, str]] = []
        self.tokenizer = settings.tokenizer.resolve() if settings.tokenizer else None
        # Each pod's KV events (with a tokenizer: the gateway hashes requests as the pods do),
        # on ipc paths in a directory of ours (a short path: a socket's is at most 107 bytes).
        self.kv_events: list[KvEndpoint] = []
        self._kv_dir: Path | None = None
        self.certs = state_dir / "tls"  # ca.crt, envoy.crt/key, NAME.crt/key (tools/certs.py)
        # The run's CA, in memory only: tests issue certificates of it (`ca.write`).
        self.ca = certs.Authority()

    # Composition.

    def start(self) -> Stack:
        # Owner-only: the logs, the rendered configs and the tenants file are the operator's.
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.state_dir.chmod(0o700)
        if self.settings.tls:
            certs.generate(self.certs, self.ca)
        try:
            self._start_redis()
            self._start_pods()
            self._start_services()
            self._start_envoy()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        stop_all(self.processes)
        if self._kv_dir is not None:
            shutil.rmtree(self._kv_dir, ignore_errors=True)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _process(
        self,
        name: str,
        argv: list[str],
        ready: Any,
        env: dict[str, str] | None = None,
        start_timeout: float | None = None,
    ) -> Process:
        timeout = self.settings.start_timeout if start_timeout is None else start_timeout
        proc = Process(name, argv, ready, self.state_dir / f"{name}.log", env, timeout)
        self.processes.append(proc)
        return proc

    def _start_redis(self) -> None:
        self.redis_port = free_port()
        argv = [bin_path("redis-server"), "--bind", "127.0.0.1", "--port", str(self.redis_port)]
        # Append-only file, fsync every second: counters survive a Redis restart (supervisor).
        argv += ["--save", "", "--appendonly", "yes", "--appendfsync", "everysec"]
        argv += ["--dir", str(self.state_dir)]
        # In argv, not logged anywhere; redis-server replaces its process title (ps shows
        # `redis-server 127.0.0.1:PORT`), so the password is not in /proc/PID/cmdline either.
        argv += ["--requirepass", self.redis_password]
        ready = redis_ping("127.0.0.1", self.redis_port, self.redis_password)
        self._process("redis", argv, ready).start()

    def _start_pods(self) -> None:
        if self.settings.upstreams:
            self.pods = [envoyconf.parse_endpoint(u) for u in self.settings.upstreams]
            self.serving = [
                Serving.upstream(self.pod_url(i), self.pod_api_key) for i in range(len(self.pods))
            ]
            return
        if self.settings.pods < 1:
            raise ValueError("need --pods >= 1 or at least one --upstream")
        self.pod_api_key = self.pod_api_key or secrets.token_hex(32)
        count = self.settings.pods + self.settings.sim_pods
        self.pods = [Address(port=free_port()) for _ in range(count)]
        real: list[Process] = []
        if self.settings.engine == "vllm":
            model = ensure_model(self.settings.vllm)
            self.tokenizer = model.resolve() / "tokenizer.json"
        if self.tokenizer is not None and self.settings.kv_events:
            self._kv_dir = Path(tempfile.mkdtemp(prefix="llmgw-kv-"))
            self.kv_events = [
                KvEndpoint(
                    publish=f"ipc://{self._kv_dir}/{i}.pub",
                    replay=f"ipc://{self._kv_dir}/{i}.replay",
                )
                for i in range(count)
            ]
        if self.settings.engine == "vllm":
            real = [self._vllm_process(i, model) for i in range(self.settings.pods)]
        simulated = [self._pod_process(i) for i in range(len(real), count)]
        self.pod_processes = real + simulated
        self.serving = [Serving.vllm(self.settings.vllm)] * len(real)
        self.serving += [Serving.simulated(self._sim_flags(i)) for i in range(len(real), count)]
        for proc in self.pod_processes:
            proc.spawn()
        for proc in self.pod_processes:
            proc.wait_ready()

    def _pod_process(self, index: int) -> Process:
        pod = self.pods[index]
        argv = [sys.executable, "-m", SIM_MODULE, *self._sim_flags(index)]
        ready = http_ok(f"http://{pod.host}:{pod.port}/health")
        # Seeded as real pods are (the simulator reads it as vLLM does).
        env = {**(self._pod_key_env() or os.environ), "PYTHONHASHSEED": HASH_SEED}
        return self._process(f"pod-{index}", argv, ready, env | self._store_env())

    def _sim_flags(self, index: int) -> list[str]:
        pod = self.pods[index]
        flags = ["--host", pod.host, "--port", str(pod.port)]
        if self.settings.engine == "vllm":  # beside real pods: serving what they serve, as they do
            vllm = self.settings.vllm
            flags += ["--model", vllm.served_model_name, "--block-size", str(BLOCK_SIZE)]
            flags += ["--max-model-len", str(vllm.max_model_len)]
        else:
            # Every stream ends with usage, for settlement; Envoy strips it where not asked for.
            flags += ["--usage-mode", "final"]  # usage.lua strips only usage-only chunks, for now
        # vLLM's priority scheduler, as compose and k8s run it (sim_args may say fcfs instead).
        flags += ["--scheduling-policy", "priority"]
        flags += ["--seed", str(index), "--force-include-usage", *self.settings.sim_args]
        if self.tokenizer is not None:
            flags += ["--tokenizer", str(self.tokenizer)]
        if self.kv_events:
            flags += ["--prefix-caching-hash-algo", HASH_ALGO]
            flags += ["--kv-events-config", kv_events_config(self.kv_events[index])]
        if index < len(self.settings.pod_args):
            flags += self.settings.pod_args[index]
        return flags

    def _sim_block_size(self) -> int:
        """The simulated pods' block size: `--block-size` in sim_args, else the simulator's."""
        args = self.settings.sim_args
        sizes = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--block-size"]
        sizes += [a.partition("=")[2] for a in args if a.startswith("--block-size=")]
        return int(sizes[-1]) if sizes else SimSettings().block_size

    def _vllm_process(self, index: int, model: Path) -> Process:
        pod = self.pods[index]
        events = self.kv_events[index] if self.kv_events else None
        argv = pod_argv(self.settings.vllm, model, pod.host, pod.port, events)
        env = pod_env(self.settings.vllm, index, self._pod_key_env() or os.environ)
        env |= self._store_env()
        ready = http_ok(f"http://{pod.host}:{pod.port}/health")
        return self._process(f"pod-{index}", argv, ready, env, self.settings.vllm.start_timeout)

    def _store_env(self) -> dict[str, str]:
        """vLLM's switch for its store of responses (the simulator reads it too)."""
        return {STORE_ENV: "1"} if self.settings.responses_store else {}

    def _pod_key_env(self) -> dict[str, str] | None:
        """The environment with the pods' key (not in argv: `ps` shows that), or None."""
        if self.pod_api_key is None:
            return None
        return {**os.environ, POD_KEY_ENV: self.pod_api_key}

    def _start_services(self) -> None:
        """Each service the settings name, with the settings it needs from the stack."""
        settings: dict[ServiceName, dict[str, str]] = {
            "extauthz": {
                "TENANTS_FILE": str(self.tenants_file),
                "SESSIONS__SECRET": secrets.token_hex(32),
                "DECISION__MAX_BODY_BYTES": str(self.settings.envoy.max_request_bytes),
                "DECISION__ENGINE_PRIORITY": str(self.settings.engine_priority).lower(),
                "DECISION__RESPONSES_STORE": str(self.settings.responses_store).lower(),
            },
            "ratelimit": {
                "REDIS__HOST": "127.0.0.1",
                "REDIS__PORT": str(self.redis_port),
                "REDIS__PASSWORD": self.redis_password,
                "RESERVATION_TTL_S": str(self.settings.ratelimit_reservation_ttl_s),
            },
            "router": self._router_settings(),
            "ledger": {
                "REDIS__HOST": "127.0.0.1",
                "REDIS__PORT": str(self.redis_port),
                "REDIS__PASSWORD": self.redis_password,
            },
        }
        if self.tokenizer is not None:  # JSON: a YAML mapping, as the override is read
            model = self.serving[0].model
            if model is None:
                raise StartError("a tokenizer needs the pods' model name: their /v1/models")
            tokenizers = {model: str(self.tokenizer)}
            settings["extauthz"]["DECISION__TOKENIZER"] = json.dumps(tokenizers)
        if self.kv_events:  # requests' blocks hashed as the pods hash theirs
            block = BLOCK_SIZE if self.settings.engine == "vllm" else self._sim_block_size()
            hashing = KvHashing(algo=HASH_ALGO, seed=HASH_SEED, block_size=block)
            settings["extauthz"]["DECISION__KV_HASHING"] = hashing.model_dump_json()
        if "ledger" in self.settings.services:
            settings["ledger"]["DATABASE_URL"] = self._database()
            # What the gRPC access log did not deliver, from Envoy's file (ledger/reconcile.py).
            settings["ledger"]["RECONCILE__ACCESS_LOG"] = str(self.access_log)
        if "extauthz" in self.settings.services:
            self.tenants = seed_demo(self.tenants_file)
        if self.settings.admin:
            self._start_admin()  # the tenants file imported into the database first
            settings["extauthz"] |= {
                "TENANTS_SOURCE": "database",
                "TENANTS_DATABASE_URL": self._database(),
                "TENANTS_CACHE": str(self.state_dir / "tenants.cache.yaml"),
            }
        if self.tiers_file is not None:
            # The tier table: ratelimit's limits, and the tiers extauthz lets a tenant name.
            for name in ("ratelimit", "extauthz", "ledger"):  # the ledger: each tier's breaker
                settings[name]["TIERS_FILE"] = str(self.tiers_file)
        names = self.settings.services
        topology = self.settings.topology
        inside = {"router": topology.router_inside, "ratelimit": topology.limiter_inside}
        # Run inside extauthz, not as processes of their own.
        held = [n for n in names if inside.get(n) and "extauthz" in names]
        held_env: dict[str, str] = {}
        for name in held:
            prefix = f"LLMGW_{name.upper()}__"
            held_env |= {prefix + k: v for k, v in settings[name].items()}
        if held:
            settings["extauthz"]["TOPOLOGY"] = self._holding(held)
        http = None
        if "extauthz" in names:  # Envoy asks it whose key a request carries, at the headers
            http = Address(port=free_port())
            settings["extauthz"]["HTTP_PORT"] = str(http.port)
        addresses = {
            name: self._start_service(name, settings[name], held_env if name == "extauthz" else {})
            for name in names
            if name not in held
        }
        self.services = Services.model_validate(
            {
                **addresses,
                "topology": topology,
                "extauthz_http": http,
                "routed": "router" in names,
            }
        )
        for name in held:  # their metrics are served by the process that holds them
            self.metrics[name] = self.metrics["extauthz"]
        if "router" in names and self.pod_processes:
            self._wait_pickable()

    def _holding(self, held: list[ServiceName]) -> Topology:
        """extauthz's topology: the stack's, or, when the stack leaves out a service that
        topology puts inside extauthz, the one in which extauthz holds just the other."""
        topology = self.settings.topology
        limiter, router = "ratelimit" in held, "router" in held
        if (limiter, router) == (topology.limiter_inside, topology.router_inside):
            return topology
        return Topology.of(limiter_inside=limiter, router_inside=router, check_over_http=False)

    def _wait_pickable(self) -> None:
        """Until the router has scraped every simulated pod and knows its model's context: a
        burst sent as soon as the stack is up would otherwise find no pod it may pick (Envoy's
        fallback would), or get the tier's output cap whatever the pods' context."""
        wanted = [f'llmgw_router_pod_pickable{{pod="{p.host}:{p.port}"}} 1.0' for p in self.pods]
        deadline = time.monotonic() + self.settings.start_timeout
        while True:
            with urllib.request.urlopen(self.metrics["router"], timeout=5) as reply:
                text = reply.read().decode()
            known = "llmgw_router_model_context_tokens{" in text
            if known and all(line in text for line in wanted):
                return
            if time.monotonic() > deadline:
                raise StartError(f"the router never found the pods pickable: {wanted}")
            time.sleep(0.05)

    def _router_settings(self) -> dict[str, str]:
        settings = {
            "FLEET__PODS": json.dumps([f"{p.host}:{p.port}" for p in self.pods]),
            "REDIS__HOST": "127.0.0.1",
            "REDIS__PORT": str(self.redis_port),
            "REDIS__PASSWORD": self.redis_password,
        }
        if self.pod_api_key is not None:  # for its /v1/models scrapes
            settings["FLEET__POD_API_KEY"] = self.pod_api_key
        if self.kv_events:
            pods = [f"{p.host}:{p.port}" for p in self.pods]
            endpoints = dict(zip(pods, self.kv_events, strict=True))
            kv = KvEventSettings(endpoints=endpoints)
            settings["FLEET__KV_EVENTS"] = kv.model_dump_json()
        if self.engine == "vllm":
            settings |= PATIENT_SCRAPES
        return settings

    def _start_admin(self) -> None:
        """The admin API, importing the tenants file (the demo tenants) into the database."""
        port = free_port()
        settings = {
            "HOST": "127.0.0.1",
            "PORT": str(port),
            "DATABASE_URL": self._database(),
            "ADMIN_TOKEN": self.admin_token,
            # The tenants' breakers, whose state it serves (admin/breakers.py).
            "REDIS__HOST": "127.0.0.1",
            "REDIS__PORT": str(self.redis_port),
            "REDIS__PASSWORD": self.redis_password,
        }
        if self.tenants_file.exists():
            settings["IMPORT_TENANTS_FILE"] = str(self.tenants_file)
        if self.tiers_file is not None:
            settings["TIERS_FILE"] = str(self.tiers_file)
        env = {**os.environ, **{f"LLMGW_ADMIN__{k}": v for k, v in settings.items()}}
        url = f"http://127.0.0.1:{port}"
        ready = http_ok(f"{url}/health")
        self._process("admin", [sys.executable, "-m", "admin"], ready, env).start()
        self.admin_api_url = url
        self.metrics["admin"] = f"{url}/metrics"

    def _database(self) -> str:
        """The stack's database (the ledger's and the admin API's): the one the settings name,
        else a local server of ours, started once."""
        if self.database_url is not None:
            return self.database_url
        if self.settings.database_url is not None:
            self.database_url = self.settings.database_url
            return self.database_url
        home = self.settings.postgres_dir or self.state_dir / "postgres"
        server = Postgres(
            home, self.state_dir / "postgres.log", start_timeout=self.settings.start_timeout
        )
        self.processes.append(server)
        server.start()
        self.database_url = server.url
        return self.database_url

    def _start_service(self, name: str, settings: dict[str, str], env: dict[str, str]) -> Address:
        """`python -m NAME` with its settings as LLMGW_NAME__... overrides (and `env`); ready
        when SERVING."""
        port, metrics_port, health_port = free_port(), free_port(), free_port()
        settings = {
            **settings,
            "SERVE__PORT": str(port),
            "SERVE__METRICS_PORT": str(metrics_port),
            "SERVE__HEALTH_PORT": str(health_port),
        }
        if self.settings.tls:
            settings["SERVE__TLS__CERT"] = str(self.certs / f"{name}.crt")
            settings["SERVE__TLS__KEY"] = str(self.certs / f"{name}.key")
            settings["SERVE__TLS__CA"] = str(self.certs / certs.CA_FILE)
        if (otlp := self.settings.envoy.otlp) is not None:
            settings["TRACING__OTLP_ENDPOINT"] = f"http://{otlp.host}:{otlp.port}"
        overrides = {f"LLMGW_{name.upper()}__{k}": v for k, v in settings.items()}
        env = {**os.environ, **env, **overrides}
        ready = grpc_serving(f"127.0.0.1:{health_port}")
        self._process(name, [sys.executable, "-m", name], ready, env).start()
        self.metrics[name] = f"http://127.0.0.1:{metrics_port}/metrics"
        return Address(port=port)

    def _start_envoy(self) -> None:
        if self.listen.port == 0:
            self.listen = self.listen.model_copy(update={"port": free_port(self.listen.host)})
        if self.admin.port == 0:
            self.admin = self.admin.model_copy(update={"port": free_port(self.admin.host)})
        settings = self.settings.envoy.model_copy(
            update={
                "admin": self.admin,
                "access_log_path": str(self.access_log),
                "pod_key_env": None if self.pod_api_key is None else POD_KEY_ENV,
                "tls": self.envoy_tls,
            }
        )
        config = self.state_dir / "envoy.yaml"
        # Owner-only whatever the umask, like the logs (the pods' key is in Envoy's environment).
        with os.fdopen(os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(envoyconf.render(settings, self.listen, self.pods, self.services))
        argv = [bin_path("envoy"), "-c", str(config), "--disable-hot-restart"]
        argv += ["--base-id", str(self.admin.port), "--concurrency", str(settings.concurrency)]
        argv += ["--file-flush-interval-msec", "200", "--log-level", "warn"]
        self._process(
            "envoy", argv, http_ok(f"{self.admin_url}/ready"), self._pod_key_env()
        ).start()

    @property
    def envoy_tls(self) -> UpstreamTls | None:
        """Envoy's side of the run's mutual TLS: its client pair and the CA."""
        if not self.settings.tls:
            return None
        pem = {k: str(self.certs / f"{ENVOY_IDENTITY}.{k}") for k in ("crt", "key")}
        return UpstreamTls(cert=pem["crt"], key=pem["key"], ca=str(self.certs / certs.CA_FILE))

    # Operations used by the launcher and by fault tests.

    def renew(self, name: str) -> Process:
        """Stop child `name` if it still runs and put a fresh, unstarted Process in its place:
        the same argv, environment, readiness probe, port and log file (tools.supervisor)."""
        old = next(p for p in self.processes if p.name == name)
        old.stop()
        new = old.fresh()
        self.processes[self.processes.index(old)] = new  # start order is stop order: keep it
        if old in self.pod_processes:
            self.pod_processes[self.pod_processes.index(old)] = new
        return new

    def restart(self, name: str) -> Process:
        """Start child `name` again and wait until it is ready, e.g. after a fault test."""
        return self.renew(name).start()

    def restart_pod(self, index: int) -> Process:
        """Start pod `index` again on its port, e.g. after a fault test killed it."""
        return self.restart(self.pod_processes[index].name)

    def healthy_pods(self) -> set[str]:
        """`host:port` of the pods Envoy would route to now (health-checked and not ejected)."""
        with urllib.request.urlopen(f"{self.admin_url}/clusters?format=json", timeout=5) as r:
            clusters = json.load(r)["cluster_statuses"]
        healthy = set()
        for cluster in clusters:
            if cluster["name"] != "pods":
                continue
            for host in cluster.get("host_statuses", []):
                flags = host.get("health_status", {})
                bad = [k for k, v in flags.items() if k != "eds_health_status" and v is True]
                if not bad and flags.get("eds_health_status", "HEALTHY") == "HEALTHY":
                    sock = host["address"]["socket_address"]
                    healthy.add(f"{sock['address']}:{sock['port_value']}")
        return healthy

    def envoy_stats(self) -> dict[str, int]:
        """Envoy's counters and gauges by name."""
        with urllib.request.urlopen(f"{self.admin_url}/stats?format=json", timeout=5) as r:
            stats = json.load(r)["stats"]
        return {s["name"]: int(s["value"]) for s in stats if "value" in s}

    def wait_healthy(self, expected: set[str], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.healthy_pods() == expected:
                return
            time.sleep(0.1)
        raise StartError(f"healthy pods {self.healthy_pods()} != {expected} after {timeout}s")

    # What scripts and users need to reach the stack.

    @property
    def base_url(self) -> str:
        return f"http://{self.listen.host}:{self.listen.port}/v1"

    @property
    def access_log(self) -> Path:
        """The file Envoy writes: the settings', else the state directory's."""
        named = self.settings.envoy.access_log_path
        return Path(named) if named else self.state_dir / "access.log"

    @property
    def admin_url(self) -> str:
        return f"http://{self.admin.host}:{self.admin.port}"

    @property
    def redis_url(self) -> str:
        """With the password: for the ready file (0600) only."""
        return f"redis://:{self.redis_password}@127.0.0.1:{self.redis_port}/0"

    def redis_client(self) -> redis.Redis:
        """A client of the stack's Redis, authenticated (for scripts and tests)."""
        return redis.Redis(port=self.redis_port, password=self.redis_password)

    @property
    def engine(self) -> PodEngine:
        return "external" if self.settings.upstreams else self.settings.engine

    def pod_engine(self, index: int) -> PodEngine:
        """What serves pod `index`: the real pods come first, then the simulated ones."""
        if self.engine == "vllm" and index >= self.settings.pods:
            return "sim"
        return self.engine

    def pod_url(self, index: int) -> str:
        pod = self.pods[index]
        return f"http://{pod.host}:{pod.port}"

    def ready_info(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "tenants": self.tenants,
            "pods": [
                {
                    "url": self.pod_url(i),
                    "simulated": self.pod_engine(i) == "sim",
                    "engine": self.pod_engine(i),
                    "model": self.serving[i].model,
                    "max_model_len": self.serving[i].max_model_len,
                    "pid": self.pod_processes[i].pid if self.pod_processes else None,
                }
                for i in range(len(self.pods))
            ],
            "redis_url": self.redis_url,
            "database_url": self.database_url,
            "processes": {proc.name: proc.pid for proc in self.processes},
            "envoy_admin_url": self.admin_url,
            "admin_url": self.admin_api_url,
            "admin_token": self.admin_token if self.admin_api_url else None,
            "console_url": f"{self.admin_api_url}/console/" if self.admin_api_url else None,
            "metrics": self.metrics,
            "logs": str(self.state_dir),
        }
