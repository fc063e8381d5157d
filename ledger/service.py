"""The gRPC adapter: Envoy's access-log stream in, outcomes out to the recorder.

Envoy keeps one stream per worker open and sends a message per flush (at least every
`buffer_flush_interval`) with a batch of entries; it expects no answer until the stream ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from opentelemetry import trace

from ledger import metrics
from ledger.entry import to_outcome
from llmgw.outcome import Outcome
from llmgw.telemetry import recording


class AccessLogService(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    def __init__(self, sink: Callable[[Sequence[Outcome]], None], tracer: trace.Tracer) -> None:
        self.sink = sink
        self.tracer = tracer
        self.recording = recording(tracer)

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> als_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            entries = message.http_logs.log_entry
            if not entries:
                continue
            metrics.ENTRIES.inc(len(entries))
            metrics.LOG_BATCH.observe(len(entries))
            if not self.recording:  # no span to fill: skip the no-op one and the tenant set
                self.sink([o for o in map(to_outcome, entries) if o is not None])
                continue
            with self.tracer.start_as_current_span("ledger.batch") as span:
                outcomes = [o for o in map(to_outcome, entries) if o is not None]
                span.set_attribute("llmgw.ledger.entries", len(entries))
                tenants = {o.tenant for o in outcomes}
                if len(tenants) == 1:
                    span.set_attribute("tenant.id", tenants.pop())
                self.sink(outcomes)
        return als_pb2.StreamAccessLogsResponse()


def register(service: AccessLogService) -> Callable[[grpc.aio.Server], None]:
    def add(server: grpc.aio.Server) -> None:
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(service, server)

    return add
