"""The simulator's nouns: pod settings, fault switches and what the engine is asked to do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from llmgw.config import Strict

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"

FinishReason = Literal["stop", "length"]


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
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=8192, ge=1)  # chunked-prefill token budget per step
    num_gpu_blocks: int = Field(default=28000, ge=1)  # ~450k tokens: Llama-3.1-8B on one 80 GB H100
    block_size: int = Field(default=16, ge=1)
    max_model_len: int = Field(default=131072, ge=2)
    force_include_usage: bool = False


class Faults(Strict):
    """Runtime fault switches (`PUT /admin/faults` merges fields into the current value)."""

    error_rate: float = Field(default=0.0, ge=0, le=1)
    error_status: Literal[500, 503] = 500
    latency_ms: float = Field(default=0.0, ge=0)  # wall milliseconds before the first byte
    hang: bool = False
    close_mid_stream: float = Field(default=0.0, ge=0, le=1)  # probability; true means 1
    die: bool = False
    unhealthy: bool = False


@dataclass(frozen=True, slots=True)
class Job:
    """A validated completion request, as the engine sees it."""

    prompt: str  # chat-templated text for chat requests
    prompt_tokens: int
    output_tokens: int  # decided up front, deterministically (see tokens.output_length)
    finish_reason: FinishReason
