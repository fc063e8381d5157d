"""The simulator's nouns: pod settings, fault switches and what the engine is asked to do."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator

from llmgw import tokenizer as tokenizers
from llmgw.config import Strict
from llmgw.kvblocks import DEFAULT_SEED, HashAlgo, KvHashing

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"

FinishReason = Literal["stop", "length"]
SchedulingPolicy = Literal["fcfs", "priority"]
# per-chunk: vLLM >= 0.20 with --enable-force-include-usage (usage on every chunk, role chunk
# included); final: vLLM 0.18 (one usage-only chunk ends every stream).
UsageMode = Literal["per-chunk", "final"]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class KvEventsConfig(Strict):
    """vLLM's `--kv-events-config` (the fields it takes; the simulator publishes over ZMQ)."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = Field(default=10_000, ge=1)
    hwm: int = Field(default=100_000, ge=0)
    max_queue_size: int = Field(default=100_000, ge=1)
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


class SimSettings(Strict):
    """One pod. Durations the profile yields are simulated seconds (what the GPU would take);
    the pod sleeps `simulated / speed_factor * time_scale` wall seconds."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (in-process pods in tests)
    model: str = DEFAULT_MODEL
    profile: str = "h100-llama-8b"
    speed_factor: float = Field(default=1.0, gt=0)  # > 1: a faster GPU than the profile's
    time_scale: float = Field(default=1.0, gt=0)  # 0.1: ten times faster wall clock, same metrics
    seed: int = 0
    # None: the profile's (vLLM's default for that GPU).
    max_num_seqs: int | None = Field(default=None, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)  # token budget per step
    num_gpu_blocks: int = Field(default=28000, ge=1)  # ~450k tokens: Llama-3.1-8B on one 80 GB H100
    block_size: int = Field(default=16, ge=1)
    max_model_len: int = Field(default=131072, ge=2)
    force_include_usage: bool = False
    usage_mode: UsageMode = "per-chunk"  # what force_include_usage does (as vLLM 0.32 and 0.33)
    scheduling_policy: SchedulingPolicy = "fcfs"
    # vLLM's --api-key (or VLLM_API_KEY): /v1/* needs `Authorization: Bearer KEY`. None: open.
    api_key: SecretStr | None = None
    # The served model's tokenizer.json (its chat template beside it): prompts are counted as a
    # real pod of that model counts them (llmgw/tokenizer.py). None: a token is 4 characters.
    tokenizer: Path | None = None
    # vLLM's --prefix-caching-hash-algo and the PYTHONHASHSEED it seeds with (None: vLLM's
    # default seed): with a tokenizer, blocks are hashed as a real pod's (llmgw/kvblocks.py).
    prefix_caching_hash_algo: HashAlgo = "sha256"
    hash_seed: str | None = None
    kv_events_config: KvEventsConfig = KvEventsConfig()
    # vLLM's VLLM_ENABLE_RESPONSES_API_STORE: finished Responses are kept for GET
    # /v1/responses/{id} and `previous_response_id` (sim/store.py).
    enable_responses_api_store: bool = False
    # vLLM never evicts (its own FIXME calls it a leak); the simulator drops the oldest past this.
    responses_api_store_max: int = Field(default=10_000, ge=1)

    def kv_hashing(self) -> KvHashing:
        """How this pod hashes a tokenized prompt's blocks: every full block of it."""
        seed = DEFAULT_SEED if self.hash_seed is None else self.hash_seed
        blocks = self.max_model_len // self.block_size + 1
        return KvHashing(
            algo=self.prefix_caching_hash_algo,
            seed=seed,
            block_size=self.block_size,
            max_blocks=blocks,
        )

    @field_validator("tokenizer")
    @classmethod
    def _loads(cls, path: Path | None) -> Path | None:
        if path is not None:
            try:
                tokenizers.counter(path)
            except tokenizers.TokenizerError as exc:
                raise ValueError(str(exc)) from exc
        return path


class Faults(Strict):
    """Runtime fault switches (`PUT /admin/faults` merges fields into the current value)."""

    error_rate: float = Field(default=0.0, ge=0, le=1)
    error_status: Literal[500, 503] = 500
    # The injected errors hit only these tenants' requests (the gateway's x-llmgw-tenant header):
    # a tenant whose requests the pod cannot serve, not a pod failing everyone. Empty: every one.
    error_tenants: tuple[str, ...] = ()
    latency_ms: float = Field(default=0.0, ge=0)  # wall milliseconds before the first byte
    hang: bool = False
    close_mid_stream: float = Field(default=0.0, ge=0, le=1)  # probability; true means 1
    # probability that a request fails during generation: a stream sends `data: {"error": ...}`
    # and `[DONE]` after its first chunks, a JSON reply is a 500 (vLLM's GenerationError)
    error_mid_stream: float = Field(default=0.0, ge=0, le=1)
    die: bool = False
    unhealthy: bool = False
    # KV-event batches are kept for replay but not sent, as ZMQ drops them past a subscriber's
    # high-water mark: the router sees a gap when they resume.
    kv_events_paused: bool = False


@dataclass(frozen=True, slots=True)
class Job:
    """A validated completion request, as the engine sees it."""

    prompt: str  # chat-templated text for chat requests
    prompt_tokens: int
    output_tokens: int  # decided up front, deterministically (see tokens.natural_length)
    finish_reason: FinishReason  # "stop": the last output token is the EOS (empty text)
    sample: int = 0  # which of the request's n samples: seeds its words and length
    priority: int = 0  # vLLM's: lower is served earlier (under --scheduling-policy priority)
    cache_salt: str = ""  # prefix-cache blocks are shared only between equal salts
    # The prompt's token IDs where the pod has a tokenizer: its blocks are hashed as vLLM hashes
    # them; else the rendered text's blocks are.
    prompt_ids: tuple[int, ...] = ()
