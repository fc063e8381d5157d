"""The ledger's per-tenant-per-model metrics stay bounded whatever models clients name."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import pytest
from prometheus_client import REGISTRY, generate_latest

from ledger import metrics
from ledger.recorder import Recorder
from llmgw import telemetry
from llmgw.link import RedisLink
from llmgw.outcome import Outcome
from llmgw.telemetry import OTHER
from tests.ledger.conftest import outcome

POD = "10.0.0.1:8000"
PER_MODEL = (metrics.REQUESTS, metrics.TOKENS, metrics.TTFT, metrics.DURATION)


async def record(outcomes: Sequence[Outcome]) -> None:
    """Through the recorder's counting, unsettled (no Redis listens: close stores them as is)."""
    recorder = Recorder(
        RedisLink("127.0.0.1", 1, 0.1), None, batch_max=10, pending_max=10_000,
        done_ttl_s=60, timeout_s=0.1, retry_max_s=0.1,
    )  # fmt: skip
    recorder.add(outcomes)
    await recorder.close(0.0)


def series() -> list[str]:
    """The lines of the metrics page (as the ledger serves it) of the per-model metrics."""
    names = tuple(m._name for m in PER_MODEL)
    return [line for line in generate_latest(REGISTRY).decode().splitlines()
            if line.startswith(names)]  # fmt: skip


def labels(label: str) -> set[str]:
    return {s.labels[label] for m in PER_MODEL for f in m.collect() for s in f.samples}


async def test_fresh_model_names_add_no_series() -> None:
    run = uuid.uuid4().hex[:8]
    served = f"served-{run}"
    before = len(series())
    fresh = [f"fresh-{run}-{i}" for i in range(400)]
    await record(
        [outcome(i, model=fresh[i], status=429, outcome="refused", flags="RL") for i in range(100)]
        + [outcome(i, model=fresh[i], tenant="", status=401, outcome="refused")
           for i in range(100, 200)]
        + [outcome(i, model=fresh[i], pod=POD, status=404, outcome="refused")  # pod: unknown
           for i in range(200, 300)]
        + [outcome(i, model=served, pod=POD, prompt_tokens=10, ttft_ms=5.0)
           for i in range(300, 400)]
    )  # fmt: skip
    # Two tenants ("acme", none) × two models (the served one, `other`): at most 4 pairs, each
    # with 4 outcome kinds, 4 token kinds and two histograms (17 lines each with _created).
    assert len(series()) - before <= 4 * (2 * 4 + 2 * 4 + 2 * 17)
    assert served in labels("model")
    assert not set(fresh) & labels("model")


async def test_models_past_the_limit_are_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet that answers any model (a misconfigured alias, a permissive proxy) still names
    at most `model_labels` of them."""
    monkeypatch.setattr(metrics.MODELS, "limit", len(metrics.MODELS) + 3)
    run = uuid.uuid4().hex[:8]
    fresh = [f"any-{run}-{i}" for i in range(100)]
    await record([outcome(i, model=m, pod=POD) for i, m in enumerate(fresh)])
    assert set(fresh) & labels("model") == set(fresh[:3])
    assert OTHER in labels("model")


async def test_tenants_past_the_limit_are_other(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(telemetry.TENANTS, "limit", len(telemetry.TENANTS) + 2)
    run = uuid.uuid4().hex[:8]
    tenants = [f"t-{run}-{i}" for i in range(10)]
    other = REGISTRY.get_sample_value(
        "llmgw_ledger_requests_total", {"tenant": OTHER, "model": OTHER, "outcome": "refused"}
    )
    await record(
        [outcome(i, tenant=t, model=run, status=403, outcome="refused")  # a model never served
         for i, t in enumerate(tenants)]
    )  # fmt: skip
    assert set(tenants) & labels("tenant") == set(tenants[:2])
    after = REGISTRY.get_sample_value(
        "llmgw_ledger_requests_total", {"tenant": OTHER, "model": OTHER, "outcome": "refused"}
    )
    assert (after or 0) - (other or 0) == 8
