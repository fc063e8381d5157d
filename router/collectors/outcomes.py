"""The outcome feed: how each picked request ended, from Envoy's access log (no call on the
request path), into the pick's lifecycle (router/lifecycle.py `ended`). Served beside whichever
adapter picks: ext_proc (`python -m router`) or extauthz."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from llmgw import wire
from router import metrics
from router.lifecycle import Lifecycle
from router.types import PodId


def ended_at(entry: accesslog_pb2.HTTPAccessLogEntry, wall_to_clock: float) -> float | None:
    """When Envoy received the pod's last byte, on the clock `wall_to_clock` converts Envoy's
    wall clock to (added to it); None: the entry does not say (no upstream answer)."""
    common = entry.common_properties
    if not common.HasField("time_to_last_upstream_rx_byte") or not common.HasField("start_time"):
        return None
    start: float = common.start_time.ToNanoseconds() / 1e9
    took: float = common.time_to_last_upstream_rx_byte.ToNanoseconds() / 1e9
    return start + took + wall_to_clock


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
        fleet = self.lifecycle.fleet
        feed = None
        async for message in request_iterator:
            if feed is None:  # a stream's first message names its log
                soon = message.identifier.log_name == wire.ROUTER_LOG_SOON
                feed = metrics.OUTCOMES.labels("soon" if soon else "batched")
            entries = message.http_logs.log_entry
            feed.inc(len(entries))
            # Envoy's times are its host's wall clock: on the fleet's (monotonic) clock, as far
            # as the two hosts' clocks agree.
            wall_to_clock = fleet.clock() - time.time()
            for entry in entries:
                status = entry.response.response_code.value
                self.lifecycle.ended(
                    entry.request.request_id,
                    answered_by(entry),
                    status,
                    at=ended_at(entry, wall_to_clock),
                )
        return als_pb2.StreamAccessLogsResponse()
