"""OpenTelemetry tracing for the services (OTLP/gRPC export when an endpoint is configured), and
cheap access to labelled Prometheus counters on the request path."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Generic, TypeVar

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from prometheus_client.metrics import MetricWrapperBase

from llmgw.config import Strict


class TracingSettings(Strict):
    otlp_endpoint: str | None = None  # e.g. "http://127.0.0.1:4317"; None: spans are not exported
    sample_ratio: float = 1.0


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


M = TypeVar("M", bound=MetricWrapperBase)


class Children(Generic[M]):
    """`metric.labels(*values)` remembered per label tuple (values in the metric's label order):
    prometheus_client's own lookup (validation, a lock, a dict) costs more than the update on
    every decision. Holds the same child objects the metric does, so values read through either
    agree; a child is made when first used, as `labels()` would, so no series appears early."""

    def __init__(self, metric: M) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child
