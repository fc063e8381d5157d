"""Envoy starts a trace; extauthz's span continues it and names the tenant and the session."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from tests.e2e.conftest import api_key, stack_settings
from tests.eventually import eventually
from tests.http import call
from tools.envoyconf import Address
from tools.stack import Stack


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC trace receiver: keeps every span with its service name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, trace_pb2.Span]] = []
        self.lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: object
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "service.name"
                )
                for scope in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def collector() -> Iterator[tuple[Collector, int]]:
    receiver = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, port
    server.stop(0)


def test_extauthz_span_continues_envoys_trace(
    collector: tuple[Collector, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver, port = collector
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the services export spans quickly
    base = stack_settings(pods=1)
    settings = base.model_copy(
        update={
            "services": ("extauthz",),
            "envoy": base.envoy.model_copy(update={"otlp": Address(port=port)}),
        }
    )
    with Stack(settings, tmp_path / "stack") as stack:
        auth = {"authorization": f"Bearer {api_key(stack)}"}
        models = call("GET", f"{stack.base_url}/models", headers=auth)
        model = models.json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        sessions = {models.headers["x-session-id"]}
        for _ in range(6):  # Envoy flushes spans in batches of 5
            reply = call("POST", f"{stack.base_url}/chat/completions", body, auth)
            sessions.add(reply.headers["x-session-id"])

        def chat_checks() -> list[tuple[trace_pb2.Span, trace_pb2.Span, dict[str, str]]]:
            """extauthz spans of chat requests, each with its Envoy parent span."""
            with receiver.lock:
                envoy = {s.span_id: s for name, s in receiver.spans if name == "llmgw-envoy"}
                checks = [s for name, s in receiver.spans if name == "extauthz"]
            return [
                (envoy[c.parent_span_id], c, attributes)
                for c in checks
                if c.parent_span_id in envoy
                and "llm.request.model"
                in (attributes := {a.key: a.value.string_value for a in c.attributes})
            ]

        eventually(chat_checks, 15, "an extauthz span with an Envoy parent", every_s=0.1)
        found = chat_checks()
    assert found, f"no extauthz span with an Envoy parent among {len(receiver.spans)} spans"
    parent, check, attributes = found[0]
    assert check.trace_id == parent.trace_id
    assert attributes["tenant.id"] == "demo-platinum"
    assert attributes["session.id"] in sessions
    assert attributes["llm.request.model"] == model
