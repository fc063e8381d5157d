"""The router's access log: how each picked request ended, back to the fleet (no call on the
request path). Served beside whichever adapter picks: ext_proc (`python -m router`) or extauthz."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from router.types import PodId

if TYPE_CHECKING:  # router.runtime serves this
    from router.runtime import Router


def answered_by(entry: accesslog_pb2.HTTPAccessLogEntry) -> PodId | None:
    """The pod that answered, None when none did."""
    sock = entry.common_properties.upstream_remote_address.socket_address
    return f"{sock.address}:{sock.port_value}" if sock.address else None


class OutcomeService(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """The router's access log: each picked request's end (by request ID, Envoy's x-request-id)
    releases its pod, reports how the pod did (a retry elsewhere counts as a 503 of the picked
    pod) and, if a pod answered it with a 2xx, teaches the router what that pod now caches. A
    pick Envoy never used (the client left during the pick) ends by its TTL."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.fleet = router.fleet

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> als_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                request_id = entry.request.request_id
                answered = answered_by(entry)
                status = entry.response.response_code.value
                served = answered is not None and 200 <= status < 300
                self.router.ended(request_id, answered if served else None)
                picked = self.fleet.finish(request_id)
                if picked is None:  # not picked by this replica (or long ago)
                    continue
                if answered is not None and answered != picked:
                    self.fleet.report(picked, 503)
                elif answered is not None and status:
                    self.fleet.report(picked, status)
        return als_pb2.StreamAccessLogsResponse()
