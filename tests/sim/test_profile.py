"""The clock's shape, computed from the step model (no wall clock): an 8B model on an H100."""

from __future__ import annotations

import pytest

from sim.profile import PROFILES, StepLoad, decode_step_seconds, step_seconds

H100 = PROFILES["h100-llama-8b"]
A100 = PROFILES["a100-llama-8b"]


def throughput(batch: int, context: int = 1024) -> float:
    """Output tokens per second of a steady batch of decodes."""
    return batch / decode_step_seconds(H100, batch, context)


def prefill(tokens: int, decodes: int = 0, context: int = 1024) -> float:
    """One step: a chunk of `tokens` fresh prompt tokens beside `decodes` running decodes."""
    load = StepLoad()
    load.add(0, tokens)
    for _ in range(decodes):
        load.add(context, 1)
    return step_seconds(H100, load)


def test_itl_at_batch_1_and_64() -> None:
    assert 6.0e-3 <= decode_step_seconds(H100, 1, 128) <= 7.0e-3
    # KV reads at batch 64 with ~1k context add ~2.6 ms to the ~5 ms weight read: not 47 ms.
    assert 8e-3 <= decode_step_seconds(H100, 64, 1024) <= 12e-3


def test_throughput_rises_with_batch_to_a_plateau() -> None:
    batches = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    rates = [throughput(b) for b in batches]
    assert rates == sorted(rates)
    assert rates[batches.index(64)] > 30 * rates[0]  # batching decodes is nearly free...
    assert rates[-1] < 1.1 * rates[-2]  # ...until the per-sequence and KV terms dominate
    assert rates[batches.index(256)] >= 5_000 and rates[-1] <= 12_500  # published aggregates


def test_decode_cost_grows_with_context() -> None:
    assert decode_step_seconds(H100, 64, 8192) > decode_step_seconds(H100, 64, 1024) + 10e-3


@pytest.mark.parametrize("tokens", [2048, 8192])
def test_prefill_runs_at_003_to_005_ms_a_token(tokens: int) -> None:
    assert 0.03e-3 <= prefill(tokens) / tokens <= 0.05e-3


def test_a_short_chunk_rides_on_a_decode_step_for_free() -> None:
    # Memory bound: 64 prompt tokens beside one decode cost no more than the weight read.
    assert prefill(64, decodes=1) == pytest.approx(decode_step_seconds(H100, 2, 512), rel=0.02)


def test_a_long_prefill_stretches_the_step_running_decodes_wait_on() -> None:
    alone = decode_step_seconds(H100, 63, 1024)
    stretched = [prefill(n, decodes=63) for n in (512, 2048, 8192 - 63)]
    assert stretched == sorted(stretched)
    assert stretched[-1] > 25 * alone  # every running stream sees a ~0.3 s gap


def test_a100_is_slower_and_keeps_vllm_small_gpu_defaults() -> None:
    assert (A100.max_num_batched_tokens, A100.max_num_seqs) == (2048, 256)
    assert (H100.max_num_batched_tokens, H100.max_num_seqs) == (8192, 1024)
    ratio = decode_step_seconds(A100, 1, 128) / decode_step_seconds(H100, 1, 128)
    assert 1.3 <= ratio <= 1.7  # weight read: 3.35 / 2.039 TB/s, diluted by fixed overheads
    load = StepLoad()
    load.add(0, 2048)
    assert step_seconds(A100, load) > 2.5 * prefill(2048)  # 989 vs 312 TFLOPS
