"""The router's access log: how each picked request ended, back to the fleet (no call on the
request path). Served beside whichever adapter picks: ext_proc (`python -m router`) or extauthz."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from router.fleet import Fleet
from router.types import PodId


def answered_by(entry: accesslog_pb2.HTTPAccessLogEntry) -> PodId | None:
    """The pod that answered, None when none did."""
    sock = entry.common_properties.upstream_remote_address.socket_address
    return f"{sock.address}:{sock.port_value}" if sock.address else None


class OutcomeService(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """The router's access log: each picked request's end (by request ID, Envoy's x-request-id)
    releases its pod and reports how the pod did (a retry elsewhere counts as a 503 of the picked
    pod). A pick Envoy never used (the client left during the pick) ends by its TTL."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> als_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                picked = self.fleet.finish(entry.request.request_id)
                if picked is None:  # not picked by this replica (or long ago)
                    continue
                answered = answered_by(entry)
                status = entry.response.response_code.value
                if answered is not None and answered != picked:
                    self.fleet.report(picked, 503)
                elif answered is not None and status:
                    self.fleet.report(picked, status)
        return als_pb2.StreamAccessLogsResponse()
