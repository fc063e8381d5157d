"""Bounded labels (llmgw/telemetry.py): no client grows a metric without bound, and every
per-tenant metric of the services is bounded."""

from __future__ import annotations

from types import ModuleType

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics import MetricWrapperBase

from extauthz import metrics as extauthz_metrics
from ledger import metrics as ledger_metrics
from llmgw import telemetry
from llmgw.telemetry import OTHER, Bounded, Children
from ratelimit import metrics as ratelimit_metrics
from router import metrics as router_metrics


def test_the_first_values_admitted_keep_their_label_for_good() -> None:
    bound = Bounded(2, fixed=("",))
    assert [bound.admit(v) for v in ("a", "b", "c", "a", "", "d")] == [
        "a",
        "b",
        OTHER,
        "a",
        "",
        OTHER,
    ]
    assert len(bound) == 2  # "" took no room
    bound.limit = 1  # lowered: what was admitted stays admitted
    assert (bound.admit("b"), bound.admit("e")) == ("b", OTHER)


def test_label_reads_without_admitting() -> None:
    bound = Bounded(5)
    assert bound.label("a") == OTHER
    assert len(bound) == 0
    bound.admit("a")
    assert bound.label("a") == "a"


def test_children_bound_a_label_before_the_lookup() -> None:
    registry = CollectorRegistry()
    counter = Counter("t", "test", ["result", "tenant"], registry=registry)
    children = Children(counter, tenant=Bounded(2).admit)
    for i in range(100):
        children("allow", f"tenant-{i}").inc()
    tenants = {s.labels["tenant"]: s.value for s in registry.collect() for s in s.samples
               if s.name == "t_total"}  # fmt: skip
    assert tenants == {"tenant-0": 1, "tenant-1": 1, OTHER: 98}
    assert len(children._children) == 3  # the cache is bounded too


# Every per-tenant metric of the services, with a tuple of label values to update it with.
PER_TENANT: list[tuple[Children[MetricWrapperBase], tuple[str, ...]]] = [
    (ledger_metrics.requests, ("{}", "m", "ok")),
    (ledger_metrics.tokens, ("{}", "m", "prompt")),
    (ledger_metrics.cost, ("{}", "m", "USD")),
    (ledger_metrics.ttft, ("{}", "m")),
    (ledger_metrics.duration, ("{}", "m")),
    (ledger_metrics.unchecked, ("{}",)),
    (ledger_metrics.breaker_trips, ("{}", "free", "500", "false")),
    (extauthz_metrics.decisions, ("allow", "{}")),
    (extauthz_metrics.dispatches, ("{}", "true")),
    (extauthz_metrics.refusals, ("{}", "queue_full")),
    (extauthz_metrics.service_tokens, ("{}",)),
    (ratelimit_metrics.decisions, ("{}", "free", "ok", "false")),
    (ratelimit_metrics.over_limit, ("{}", "free", "tokens")),
    (ratelimit_metrics.near_limit, ("{}", "free", "tokens")),
    (ratelimit_metrics.borrowed, ("{}", "free", "tokens")),
    (ratelimit_metrics.capped, ("{}", "free")),
    (ratelimit_metrics.degraded_decisions, ("{}", "free")),
]


def _update(metric: MetricWrapperBase) -> None:
    if isinstance(metric, Histogram):
        metric.observe(1.0)
    elif isinstance(metric, Counter):
        metric.inc()


def test_every_per_tenant_metric_is_covered_here() -> None:
    modules: list[ModuleType] = [
        ledger_metrics,
        extauthz_metrics,
        ratelimit_metrics,
        router_metrics,
    ]
    per_tenant = {
        id(m)
        for module in modules
        for m in vars(module).values()
        if isinstance(m, MetricWrapperBase) and "tenant" in m._labelnames
    }
    assert per_tenant == {id(children._metric) for children, _ in PER_TENANT}


@pytest.mark.parametrize("children,values", PER_TENANT)
def test_tenants_past_the_limit_are_other(
    children: Children[MetricWrapperBase], values: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(telemetry.TENANTS, "limit", len(telemetry.TENANTS) + 1)
    for i in range(3):
        _update(children(*(v.format(f"fresh-{id(children)}-{i}") for v in values)))
    seen = {s.labels["tenant"] for f in children._metric.collect() for s in f.samples}
    assert f"fresh-{id(children)}-0" in seen  # the first had room
    assert not {f"fresh-{id(children)}-{i}" for i in (1, 2)} & seen
    assert OTHER in seen
