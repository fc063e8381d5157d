"""A Redis client for a background loop (the ledger's settlement, the router's publisher):
connected on first use, made again after it breaks.

A lost connection closes a Resp (its owner reconnects, llmgw/resp.py); a Cluster rides out lost
connections and failovers itself (llmgw/cluster.py). Either way the loop asks for the client on
each round, so a Redis that was down when the service started is used once it is up.
"""

from __future__ import annotations

from llmgw.cluster import connect
from llmgw.config import reveal
from llmgw.redisconf import RedisSettings
from llmgw.resp import Client


class RedisLink:
    def __init__(
        self,
        host: str,
        port: int,
        connect_timeout_s: float,
        password: str | None = None,
        *,
        cluster: bool = False,
    ) -> None:
        self.host, self.port, self.connect_timeout_s = host, port, connect_timeout_s
        self.cluster = cluster  # host:port is one node of a Redis Cluster
        self._password = password
        self._client: Client | None = None

    @classmethod
    def of(cls, settings: RedisSettings) -> RedisLink:
        return cls(
            settings.host,
            settings.port,
            settings.connect_timeout_s,
            reveal(settings.password),
            cluster=settings.cluster,
        )

    async def get(self) -> Client:
        if self._client is None or self._client.closed:
            if self._client is not None:  # its transport, still open after the connection broke
                await self._client.close()
            self._client = await connect(
                self.host, self.port, self.connect_timeout_s, self._password, cluster=self.cluster
            )
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
