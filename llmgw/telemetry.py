"""OpenTelemetry tracing for the services (OTLP/gRPC export when an endpoint is configured),
cheap access to labelled Prometheus counters on the request path, and the bound on the values of
a label that a client's traffic can name (tenants, models): every series costs memory in the
service and in Prometheus, so no client may add them without bound."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Generic, TypeVar

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from prometheus_client.metrics import MetricWrapperBase
from pydantic import Field

from llmgw.config import Strict


class TracingSettings(Strict):
    otlp_endpoint: str | None = None  # e.g. "http://127.0.0.1:4317"; None: spans are not exported
    sample_ratio: float = 1.0


class MetricsSettings(Strict):
    # Tenants with a label of their own in the per-tenant metrics (the first to be seen); the
    # rest are counted as `other`. Per-tenant detail beyond them: the ledger (`llmgw usage`).
    tenant_labels: int = Field(default=200, ge=0)


def setup(service: str, settings: TracingSettings) -> trace.Tracer:
    """The service's tracer; without a collector, a no-op one (unexported spans cost ~15 % of a
    decision's CPU)."""
    if not settings.otlp_endpoint:
        return trace.NoOpTracer()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

    provider = TracerProvider(
        resource=Resource.create({"service.name": service}),
        sampler=ParentBasedTraceIdRatio(settings.sample_ratio),
    )
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint, insecure=True))
    )
    trace.set_tracer_provider(provider)
    return trace.get_tracer(service)


def recording(tracer: trace.Tracer) -> bool:
    """False for the no-op tracer `setup` returns without a collector: a service may then skip
    the span altogether (parsing the parent context and entering a no-op span cost ~4 % of a
    callout's CPU). A proxy tracer (no provider yet) may start recording later: True."""
    return not isinstance(tracer, trace.NoOpTracer)


def parent_context(
    metadata: Iterable[tuple[str, str | bytes]] | None, headers: Mapping[str, str] | None = None
) -> Context:
    """The trace Envoy started for this callout. Envoy puts its egress span for the gRPC call in
    the call's metadata, which wins over a `traceparent` in the HTTP request's own headers."""
    found = {k: v for k, v in (metadata or ()) if k in _TRACE_KEYS and isinstance(v, str)}
    return propagate.extract({**(headers or {}), **found})


_TRACE_KEYS = ("traceparent", "tracestate")


OTHER = "other"  # the label of every value past a bound


class Bounded:
    """The values one label may take: the first `limit` distinct ones admitted keep a label of
    their own for the process's lifetime, later ones read as `other`. Sticky, so a counter never
    moves from one series to another and stays monotonic. Values in `fixed` (e.g. "": no tenant)
    always keep theirs and take no room."""

    def __init__(self, limit: int, fixed: Iterable[str] = ()) -> None:
        self.limit = limit
        self._fixed = frozenset(fixed)
        self._kept: set[str] = set()

    def admit(self, value: str) -> str:
        """`value`'s label, admitting it while there is room."""
        if value in self._kept or value in self._fixed:
            return value
        if len(self._kept) >= self.limit:
            return OTHER
        self._kept.add(value)
        return value

    def label(self, value: str) -> str:
        """`value`'s label, admitting nothing."""
        return value if value in self._kept or value in self._fixed else OTHER

    def __len__(self) -> int:
        return len(self._kept)


# The tenants of every per-tenant metric in this process (one set: a tenant is `other`
# everywhere or nowhere); the composition root sets its limit (MetricsSettings).
TENANTS = Bounded(MetricsSettings().tenant_labels, fixed=("",))

M = TypeVar("M", bound=MetricWrapperBase)


class Children(Generic[M]):
    """`metric.labels(*values)` remembered per label tuple (values in the metric's label order):
    prometheus_client's own lookup (validation, a lock, a dict) costs more than the update on
    every decision. Holds the same child objects the metric does, so values read through either
    agree; a child is made when first used, as `labels()` would, so no series appears early.
    `bounds` maps a label's name to what its value becomes (e.g. `tenant=TENANTS.admit`), applied
    before the lookup so this cache is bounded as the metric is."""

    def __init__(self, metric: M, **bounds: Callable[[str], str]) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], M] = {}
        names = list(metric._labelnames)
        self._bounds = [(names.index(name), bound) for name, bound in bounds.items()]

    def __call__(self, *values: str) -> M:
        if self._bounds:
            bounded = list(values)
            for i, bound in self._bounds:
                bounded[i] = bound(bounded[i])
            values = tuple(bounded)
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child
