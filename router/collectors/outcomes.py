"""The outcome feed: how each picked request ended, from Envoy's access log (no call on the
request path), into the pick's lifecycle (router/lifecycle.py `ended`). Served beside whichever
adapter picks: ext_proc (`python -m router`) or extauthz."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from router.lifecycle import Lifecycle
from router.types import PodId


def answered_by(entry: accesslog_pb2.HTTPAccessLogEntry) -> PodId | None:
    """The pod that answered, None when none did."""
    sock = entry.common_properties.upstream_remote_address.socket_address
    return f"{sock.address}:{sock.port_value}" if sock.address else None


class OutcomeService(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """Each entry ends its request's pick by request ID (Envoy's x-request-id). A pick Envoy
    never used (the client left during the pick) ends by its TTL."""

    def __init__(self, lifecycle: Lifecycle) -> None:
        self.lifecycle = lifecycle

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> als_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                status = entry.response.response_code.value
                self.lifecycle.ended(entry.request.request_id, answered_by(entry), status)
        return als_pb2.StreamAccessLogsResponse()
