"""Settings of `python -m extauthz` (file + LLMGW_EXTAUTHZ__… environment overrides)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from extauthz.types import TenantView
from llmgw import facts, tokenizer
from llmgw.config import Strict
from llmgw.facts import RequestFacts
from llmgw.kvblocks import KvHashing
from llmgw.secret import Secret
from llmgw.serve import ServeSettings
from llmgw.telemetry import MetricsSettings, TracingSettings
from llmgw.tokenizer import Prompt
from llmgw.topology import Topology, pop_deprecated

ENV_PREFIX = "LLMGW_EXTAUTHZ"
Tokens = Annotated[int, Field(ge=1, le=facts.MAX_OUTPUT_TOKENS)]


class SessionSettings(Strict):
    secret: Secret = Field(min_length=32)  # HMAC key; the same on every replica
    previous_secret: Secret | None = Field(default=None, min_length=32)  # during rotation
    worker_id: int = Field(default=0, ge=0, le=1023)  # unique per replica
    max_age_seconds: float = Field(default=86_400.0, ge=0)  # 0: sessions never expire


class DecisionSettings(Strict):
    # Keep Envoy's with_request_body.max_request_bytes equal to this (allow_partial_message: true).
    max_body_bytes: int = Field(default=2 * 1024 * 1024, gt=0)
    # The output cap per sequence of a chat or completion, unless the tenant's tier sets its own
    # (llmgw/tiers.py max_output_tokens): what the pod receives when the client names none, and
    # the most it may name (a larger cap is lowered: the answer ends with
    # finish_reason "length", as at the client's own cap). The reservation holds this cap, and
    # the unused part is refunded at settlement, so a larger one costs admissions in flight,
    # not quota. 4096: longer than nearly every chat answer, within every current model's
    # context, and still ~10 SDK-default requests in flight under a 40,000 TPM limit.
    max_output_tokens: Tokens = 4096
    # Each model's context (vLLM's max_model_len) as the operator knows it. The pods publish
    # theirs in /v1/models, which the router reads (the fleet's contexts): both bound the cap
    # appended to a request that names none, which vLLM would refuse above the context (and
    # itself lowers to what fits beside the prompt). Only needed for pods that do not publish it.
    max_model_len: dict[str, Tokens] = Field(default_factory=dict)
    # Each served model's tokenizer (its tokenizer.json, with the chat template beside it, as
    # the model's directory has them): that model's prompts are counted as its pods count them
    # (llmgw/tokenizer.py), not estimated. Loaded at start-up (one that does not load is an
    # error); a file changed on disk is loaded again, and the last good one kept if it fails.
    tokenizer: dict[str, Path] = Field(default_factory=dict)
    # … up to this size of prompt (UTF-8 bytes, template markers included: ~64k tokens of
    # English); a larger one is estimated and bounded as without a tokenizer, so that no body
    # holds the body pool's worker for more than ~0.1 s (0.3 s beside a test suite: tokenizing
    # costs 0.2-0.5 s a MiB on an idle core, bench/tokenize.py).
    tokenize_max_bytes: int = Field(default=256 * 1024, ge=0)
    # Without a tokenizer, the prompt estimate: characters / chars_per_token.
    chars_per_token: float = Field(default=4.0, gt=0)
    # A content part that is not text (an image; audio and video count alike): LLaVA-1.5 uses
    # 576 tokens an image, GPT-4o 765 for 1024×1024, Qwen2-VL ~1,300; set it for the models served.
    image_tokens: int = Field(default=1024, ge=0)
    max_prefix_blocks: int = Field(default=64, ge=0)  # leading 16-token blocks hashed (router)
    # The pods' prefix-cache block hashing: for a model with a tokenizer, the router looks the
    # request's blocks up in what the pods' KV events say they hold (router/kvindex.py).
    kv_hashing: KvHashing = KvHashing()
    # Bodies from this size on are read in a worker process (extauthz/bodypool.py).
    pool_body_bytes: int = Field(default=256 * 1024, ge=1)
    # … and from this size on when a model has a tokenizer: tokenizing costs 0.2-0.5 ms a KiB
    # (bench/tokenize.py), 20-100× the parse, so 8 KiB (~2 ms) hold the loop about as long as
    # 256 KiB of JSON.
    pool_tokenized_body_bytes: int = Field(default=8 * 1024, ge=1)
    # Body bytes this replica holds at once (received, in the body pool, being decided; by
    # declared length, extauthz/budget.py), in total and per tenant: past a tenant's share its
    # next check is a 429, past the total any check with a body is a 503, both at once. Sized
    # for a 1 GiB container: the pool's worker holds a copy of what it reads, and JSON's objects
    # take several times the bytes they came from.
    body_bytes_in_flight: int = Field(default=256 * 1024 * 1024, gt=0)
    # A check that has waited this long since Envoy had its body (authzhttp.BODY_AT: in Envoy's
    # queue for this server, and in it) is shed at once (503 overloaded, retry-after): with the
    # admission's own budget (admit_timeout_ms, 1 s) still within Envoy's wait for the check
    # (2 s), so the client gets an answer it can act on, not Envoy's timeout, and nobody's
    # quota is touched.
    shed_after_ms: float = Field(default=1000.0, gt=0)
    tenant_body_bytes_in_flight: int = Field(default=64 * 1024 * 1024, gt=0)
    # Each tenant's priority to vLLM's scheduler as x-vllm-priority (llmgw/priority.py). Off:
    # every request gets vLLM's default 0 (first come, first served); a client's own value still
    # never reaches the scheduler.
    engine_priority: bool = True
    # The Responses API's store (`store`, `previous_response_id`, GET /v1/responses/{id} and its
    # cancel): on only where the pods keep responses (vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1).
    # Off, they are refused and every Responses request is sent with "store": false.
    responses_store: bool = False

    @model_validator(mode="after")
    def _shares_fit(self) -> DecisionSettings:
        if not self.max_body_bytes <= self.tenant_body_bytes_in_flight <= self.body_bytes_in_flight:
            raise ValueError(
                "tenant_body_bytes_in_flight: between max_body_bytes (else a body of the largest "
                "size is never received) and body_bytes_in_flight"
            )
        return self

    @field_validator("tokenizer")
    @classmethod
    def _tokenizers_load(cls, paths: dict[str, Path]) -> dict[str, Path]:
        for model, path in paths.items():
            try:
                tokenizer.counter(path)
            except tokenizer.TokenizerError as exc:
                raise ValueError(f"{model}: {exc}") from exc
        return paths

    @property
    def pool_from_bytes(self) -> int:
        """The size from which a body is read in the body pool."""
        if self.tokenizer:
            return min(self.pool_body_bytes, self.pool_tokenized_body_bytes)
        return self.pool_body_bytes

    def prompt(self, request: dict[str, Any], model: str | None) -> Prompt | None:
        """The prompt under the model's tokenizer; None without one (or where it does not
        count: a template that refuses the messages, a file gone before it ever loaded)."""
        path = self.tokenizer.get(model) if model is not None else None
        if path is None:
            return None
        try:
            return tokenizer.counter(path).request(request, self.image_tokens)
        except tokenizer.TokenizerError:
            return None

    def output_cap(
        self, tenant: TenantView, request: RequestFacts, context: int | None = None
    ) -> int:
        """The most output per sequence a request of this tenant gets: the tier's cap, within
        `context` (the model's, for a request that names no cap; None: unknown) and within what
        the tenant's smallest token limit leaves beside the prompt for its `n` sequences (a
        larger cap would make every request that names none too large to ever be admitted)."""
        bounds = [tenant.max_output or self.max_output_tokens]
        if context is not None:
            bounds.append(context)
        if tenant.token_ceiling is not None:
            room = (tenant.token_ceiling - request.prompt_tokens) // max(request.n, 1)
            bounds.append(max(1, room))
        return min(bounds)


class FlowSettings(Strict):
    """Flow control (extauthz/flow.py), with the router inside: while no pod serving a model has
    a seat free, its admitted requests wait here, dispatched fairly as seats free."""

    enabled: bool = True
    # The longest any request waits, whatever its tier's queue_timeout_s: keep Envoy's wait for
    # the check (tools/envoyconf.py Services.timeout) above shed_after_ms + admit_timeout_ms +
    # this.
    max_wait_s: float = Field(default=20.0, gt=0)
    # The queue's bounds per replica, in requests and in the body bytes Envoy holds for them.
    max_queued: int = Field(default=1024, ge=1)
    tenant_max_queued: int = Field(default=256, ge=1)
    max_queued_bytes: int = Field(default=256 * 1024 * 1024, ge=1)
    tenant_max_queued_bytes: int = Field(default=64 * 1024 * 1024, ge=1)
    # The share of a model's seats kept for tenants below their fair share of them.
    headroom: float = Field(default=0.2, ge=0, lt=1)
    # Each priority band's weight in the dispatches among backlogged bands; a band not named
    # weighs its priority (band 1 against band 10: 1/11 of the dispatches).
    band_weights: dict[Annotated[int, Field(ge=1, le=10)], Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict
    )
    # Service received (tokens dispatched) halves every this many seconds.
    half_life_s: float = Field(default=60.0, gt=0)
    # A dispatched request counts against its tenant's fair share until its outcome, or this.
    hold_ttl_s: float = Field(default=600.0, gt=0)
    # How often a replica merges its service counts with the others' in Redis (with the rate
    # limiter in this process; else each replica counts its own).
    share_interval_s: float = Field(default=1.0, gt=0)
    # The share of a model's seats taken (this dispatch's included) from which a dispatch asks
    # Envoy for its outcome at once (its router_log_flush, 20 ms) rather than batched with the
    # rest (0.2 s): a late outcome only delays its seat's reuse, which matters once seats may run
    # out, and each prompt batch costs this process a gRPC message (bench/flow.py's steady CPU).
    # A request dispatched from the queue always asks.
    outcome_soon_from: float = Field(default=0.5, ge=0, le=1)


class Settings(Strict):
    serve: ServeSettings = ServeSettings()
    tracing: TracingSettings = TracingSettings()
    metrics: MetricsSettings = MetricsSettings()  # the held limiter's too
    log_level: str = "info"
    # Where the tenants come from, chosen at start: the tenants file (hot-reloaded), or the
    # admin API's PostgreSQL tables, followed (extauthz/follower.py), with `tenants_cache` the
    # snapshot it persists after each change and starts from while the database is down.
    tenants_source: Literal["file", "database"] = "file"
    tenants_file: Path = Path("tenants.yaml")
    tenants_database_url: Secret | None = None
    tenants_cache: Path | None = None
    tenants_poll_seconds: float = Field(default=1.0, gt=0, le=1.0)  # change seen within 2 s
    tiers_file: Path | None = None  # the tier table (llmgw/tiers.py); None: the built-in tiers
    reload_interval_seconds: float = Field(default=0.25, gt=0, le=0.5)
    decision: DecisionSettings = DecisionSettings()
    flow: FlowSettings = FlowSettings()
    sessions: SessionSettings
    # What this process holds (llmgw/topology.py): the rate limiter and the router in gateway
    # and grpc-check, the router alone in rls, the rate limiter alone in epp; None: neither.
    # The router (router/runtime.py) picks the pod here too, with its settings from
    # `router_config` and LLMGW_ROUTER__… overrides, as `python -m router` reads them; the rate
    # limiter (ratelimit/runtime.py) admits here, its settings from `ratelimit_config` and
    # LLMGW_RATELIMIT__… overrides. Envoy then makes no ext_proc or rate-limit call for them.
    topology: Topology | None = None
    router_config: Path | None = None
    ratelimit_config: Path | None = None
    # The longest an admission may take, Redis however slow (a borrowing one makes up to three
    # round trips, each within the limiter's failover.deadline_ms); past it the request goes on
    # unchecked, counted. Keep it well below Envoy's wait for this Check (2 s), which fails
    # closed.
    admit_timeout_ms: float = Field(default=1000.0, gt=0)
    # Answer Envoy's checks over HTTP too, on this port of serve.host (extauthz/httpserver.py;
    # Envoy's ext_authz `http_service` in the gateway topology, tools/envoyconf.py): no gRPC
    # plumbing per check. None: gRPC only. Health, metrics and access logs stay on gRPC.
    http_port: int | None = Field(default=None, ge=0, le=65535)
    # From SIGTERM, the check port drains at least this long before it closes (Envoy's health
    # check takes the replica out meanwhile: one answer does, or one interval plus its timeout),
    # whatever else the process waits for.
    http_drain_seconds: float = Field(default=2.0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _deprecated_booleans(cls, data: Any) -> Any:
        """`pick` and `admit` (each false by default): the topology that holds what they held."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        shape = pop_deprecated(data, {"admit": False, "pick": False}, "extauthz")
        if shape is not None and any(shape):
            admit, pick = shape
            data["topology"] = Topology.of(
                limiter_inside=admit, router_inside=pick, check_over_http=admit and pick
            )
        return data

    @property
    def holds_router(self) -> bool:
        return self.topology is not None and self.topology.router_inside

    @property
    def holds_limiter(self) -> bool:
        return self.topology is not None and self.topology.limiter_inside

    @model_validator(mode="after")
    def _tenants_source(self) -> Settings:
        if self.tenants_source == "database" and (
            self.tenants_database_url is None or self.tenants_cache is None
        ):
            raise ValueError(
                "tenants_source database: set tenants_database_url and tenants_cache (the "
                "snapshot a restart during an outage starts from)"
            )
        return self

    @model_validator(mode="after")
    def _configs_used(self) -> Settings:
        if self.router_config is not None and not self.holds_router:
            raise ValueError("router_config: no router in this topology: its settings do nothing")
        if self.ratelimit_config is not None and not self.holds_limiter:
            raise ValueError(
                "ratelimit_config: no rate limiter in this topology: its settings do nothing"
            )
        if self.decision.responses_store and not self.holds_router:
            raise ValueError(
                "decision.responses_store: a stored response's requests go to the pod that holds "
                "it, which only the router inside this process can send them to (topology gateway)"
            )
        return self
