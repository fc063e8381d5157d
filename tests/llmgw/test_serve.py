"""llmgw/serve.py: gRPC health follows what the service says of itself."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from llmgw.serve import follow_health

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_grpc_health_follows_the_services_own() -> None:
    servicer = HealthServicer()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("svc", SERVING)
    healthy = True
    follower = asyncio.create_task(follow_health(servicer, ("svc",), lambda: healthy, 0.01))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def reaches(status: int) -> None:
                for _ in range(500):  # a bound against a hang, not a speed
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service="svc"))
                    if reply.status == status:
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError(f"health never reached {status}")

            healthy = False
            await reaches(NOT_SERVING)
            healthy = True
            await reaches(SERVING)
    finally:
        follower.cancel()
        await server.stop(0)
