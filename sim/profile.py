"""Step-time profiles: a roofline model of one engine step on a given GPU, in simulated seconds.

A step runs every scheduled token through the model once. On a GPU that is either memory
bound (the weights are read once per step, plus the KV cache each sequence attends over) or
compute bound (every token costs its linear-layer FLOPs, plus attention FLOPs that grow with
its context), whichever is slower; a fixed launch/sampling overhead and a per-sequence term
are added on top. Decodes are memory bound, so batching them is nearly free until the
per-sequence and KV terms dominate (throughput rises with batch to a plateau); a prefill
chunk is compute bound, so a long one stretches the step every running decode waits on.

Every constant is listed with its source in `sim/README.md`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from llmgw.config import Strict


class Profile(Strict):
    """One GPU serving one model, with vLLM's scheduler defaults for that GPU."""

    # The model.
    weight_bytes: float = Field(gt=0)  # read once per step
    kv_bytes_per_token: float = Field(gt=0)  # read for every attended context token
    flops_per_token: float = Field(gt=0)  # linear layers: 2 x parameters
    attention_flops_per_pair: float = Field(ge=0)  # per (query token, context token)
    # The GPU.
    hbm_bytes_per_s: float = Field(gt=0)
    peak_flops: float = Field(gt=0)  # dense BF16
    mfu: float = Field(gt=0, le=1)  # fraction of peak a prefill achieves
    # The engine.
    step_overhead_ms: float = Field(ge=0)  # kernel launches, sampling, scheduling
    per_seq_ms: float = Field(ge=0)  # per scheduled sequence
    request_overhead_ms: float = Field(ge=0)  # API server work before the engine sees it
    # vLLM's defaults for this GPU (engine/arg_utils.py, OPENAI_API_SERVER context).
    max_num_batched_tokens: int = Field(ge=1)
    max_num_seqs: int = Field(ge=1)


@dataclass(slots=True)
class StepLoad:
    """What one step computes, summed over its scheduled sequences."""

    seqs: int = 0
    tokens: int = 0  # tokens run through the model (decode tokens and prefill chunks)
    kv_tokens: int = 0  # context tokens whose KV is read (each sequence's whole context)
    pairs: int = 0  # (query, key) pairs attention computes

    def add(self, start: int, n: int) -> None:
        """A sequence computing tokens [start, start + n) over the context before them."""
        self.seqs += 1
        self.tokens += n
        self.kv_tokens += start + n
        self.pairs += n * start + n * (n + 1) // 2


# Llama-3.1-8B: 8.03e9 parameters in BF16; 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes
# of KV per token; attention is 2 matmuls x 2 FLOP x 32 layers x 4096 (32 heads x 128) per pair.
_LLAMA_8B = {
    "weight_bytes": 8.03e9 * 2,
    "kv_bytes_per_token": 32 * 8 * 128 * 2 * 2,
    "flops_per_token": 2 * 8.03e9,
    "attention_flops_per_pair": 2 * 2 * 32 * 4096,
}

PROFILES: dict[str, Profile] = {
    # H100 SXM 80 GB: 3.35 TB/s HBM3, 989 TFLOPS dense BF16 (NVIDIA datasheet).
    "h100-llama-8b": Profile(
        **_LLAMA_8B,
        hbm_bytes_per_s=3.35e12,
        peak_flops=989e12,
        mfu=0.45,
        step_overhead_ms=1.6,
        per_seq_ms=0.04,
        request_overhead_ms=22.0,
        max_num_batched_tokens=8192,
        max_num_seqs=1024,
    ),
    # A100 SXM 80 GB: 2.039 TB/s HBM2e, 312 TFLOPS dense BF16 (NVIDIA datasheet); vLLM keeps
    # an A100 on its small-GPU defaults (2048 tokens, 256 sequences) on purpose (PR #17885).
    "a100-llama-8b": Profile(
        **_LLAMA_8B,
        hbm_bytes_per_s=2.039e12,
        peak_flops=312e12,
        mfu=0.45,
        step_overhead_ms=1.6,
        per_seq_ms=0.04,
        request_overhead_ms=22.0,
        max_num_batched_tokens=2048,
        max_num_seqs=256,
    ),
}


def step_seconds(profile: Profile, load: StepLoad) -> float:
    """How long a step with this load takes."""
    p = profile
    memory = (p.weight_bytes + load.kv_tokens * p.kv_bytes_per_token) / p.hbm_bytes_per_s
    flops = load.tokens * p.flops_per_token + load.pairs * p.attention_flops_per_pair
    compute = flops / (p.peak_flops * p.mfu)
    overhead = (p.step_overhead_ms + load.seqs * p.per_seq_ms) / 1e3
    return overhead + max(memory, compute)


def decode_step_seconds(profile: Profile, batch: int, context: int) -> float:
    """A step of `batch` decodes, each with `context` tokens before its new one."""
    load = StepLoad()
    for _ in range(batch):
        load.add(context, 1)
    return step_seconds(profile, load)
