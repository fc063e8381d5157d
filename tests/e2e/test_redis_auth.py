"""The stack's Redis asks for its generated password, and every service has it.

A client without the password gets NOAUTH; ratelimit decides from Redis (not degraded), the ledger
settles the request's reservation there and the router publishes the fleet load there: each of
them would fail at that step with a missing or wrong password.
"""

from __future__ import annotations

import socket
import urllib.request

import pytest
import redis

from llmgw import wire
from tests.eventually import eventually
from tests.http import call
from tools.procs import redis_ping
from tools.stack import Stack


def test_a_client_without_the_password_is_refused(stack: Stack) -> None:
    with socket.create_connection(("127.0.0.1", stack.redis_port), timeout=5) as raw:
        raw.sendall(b"PING\r\n")
        assert raw.recv(64).startswith(b"-NOAUTH")
    for password in (None, "not-the-password"):  # redis-py opens with HELLO: refused
        with (
            redis.Redis(port=stack.redis_port, password=password) as client,
            pytest.raises(redis.AuthenticationError),
        ):
            client.ping()
    assert not redis_ping("127.0.0.1", stack.redis_port)()
    with stack.redis_client() as client:
        assert client.ping()
    with redis.Redis.from_url(stack.redis_url) as client:  # the ready file's URL carries it
        assert client.ping()


def test_a_request_is_admitted_from_redis_and_settled_there(stack: Stack) -> None:
    tenant = next(t for t in stack.tenants if t["tier"] == "platinum")
    auth = {"authorization": f"Bearer {tenant['api_key']}"}
    model = call("GET", f"{stack.base_url}/models", headers=auth).json()["data"][0]["id"]
    reply = call("POST", f"{stack.base_url}/completions", {"model": model, "prompt": "a"}, auth)
    assert reply.status == 200
    assert "x-ratelimit-remaining-tokens" in reply.headers
    with urllib.request.urlopen(stack.metrics["ratelimit"], timeout=5) as r:
        assert "llmgw_ratelimit_degraded 0.0" in r.read().decode()  # decided from Redis
    prefix = wire.tenant_prefix(tenant["id"])
    rid = reply.headers["x-request-id"]
    with stack.redis_client() as client:
        eventually(
            lambda: bool(client.exists(f"{prefix}:done:{rid}")),
            20.0,
            "the ledger's settlement",
            every_s=0.1,
        )
        assert not client.exists(f"{prefix}:res:{rid}")  # the reservation is settled
        eventually(
            lambda: bool(client.exists(wire.FLEET_LOAD_KEY)),
            20.0,
            "the router's fleet load",
            every_s=0.1,
        )
