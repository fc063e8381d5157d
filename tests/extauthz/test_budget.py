"""What one caller can make extauthz hold (extauthz/budget.py): over HTTP a check is
authenticated at its head, and its body's declared bytes are held per tenant and per replica
from then until it is answered."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider

from extauthz.budget import BodyBudget
from extauthz.director import Director
from extauthz.store import tenants_store
from llmgw import wire
from tests.extauthz.conftest import Keys, make_decider
from tests.extauthz.test_httpserver import Response, exchange, read_response, request, served
from tests.extauthz.test_service import CHAT

TENANT_SHARE = 150_000
TOTAL = 180_000


@pytest.fixture
async def service(
    tenants_file: Path, tiers_file: Path, keys: Keys
) -> AsyncIterator[tuple[Director, int]]:
    store = tenants_store(tenants_file, tiers_file)
    decider = make_decider(
        max_body_bytes=100_000,
        tenant_body_bytes_in_flight=TENANT_SHARE,
        body_bytes_in_flight=TOTAL,
    )
    checks = Director(store, decider, TracerProvider().get_tracer("test"))
    async for _, port in served(checks, max_body=16 << 20):
        yield checks, port


def head(headers: Mapping[str, str], length: int) -> bytes:
    """A check's head that declares `length` bytes of body, none of them sent."""
    return request(headers).replace(b"content-length: 0", f"content-length: {length}".encode())


async def until(done: Callable[[], bool], what: str) -> None:
    for _ in range(500):  # a bound against a hang, not a speed
        if done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


def error(reply: Response) -> dict[str, object]:
    body = json.loads(reply.body)["error"]
    assert isinstance(body, dict)
    return body


async def test_a_strangers_check_is_answered_at_its_head(
    service: tuple[Director, int],
) -> None:
    checks, port = service
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head({"authorization": "Bearer sk-llmgw-nope"}, 8_000_000))
        reply = await asyncio.wait_for(read_response(reader), 10)  # its body never sent
        assert reply.status == 401
        assert error(reply)["code"] == "invalid_api_key"
        assert reply.get("connection") == "close"
        assert checks.budget.held == 0
        writer.write(b"x" * 8_000_000)  # dropped as it arrives, then the connection closed
        assert await asyncio.wait_for(reader.read(), 10) == b""
    finally:
        writer.close()


async def test_a_strangers_check_whose_body_is_here_leaves_the_connection_open(
    service: tuple[Director, int], keys: Keys
) -> None:
    _, port = service
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request({"authorization": "Bearer sk-llmgw-nope"}, CHAT))
        assert (await read_response(reader)).status == 401
        writer.write(request({"authorization": f"Bearer {keys.acme}"}, CHAT))
        assert (await read_response(reader)).status == 200  # the stranger's body dropped
    finally:
        writer.close()


async def test_a_tenant_past_its_share_is_refused_and_others_are_not(
    service: tuple[Director, int], keys: Keys
) -> None:
    checks, port = service
    acme = {"authorization": f"Bearer {keys.acme}"}
    globex = {"authorization": f"Bearer {keys.globex}"}
    held: list[asyncio.StreamWriter] = []
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        held.append(writer)
        writer.write(head(acme, 100_000))  # its body still to come: held meanwhile
        await until(lambda: checks.budget.by_tenant == {"acme": 100_000}, "acme's head held")

        over = await exchange(port, head(acme, 60_000))
        assert over.status == 429
        assert error(over) == {
            "message": error(over)["message"],
            "type": "requests",
            "param": None,
            "code": "too_many_bodies_in_flight",
        }
        assert over.get("retry-after") == "1"
        assert over.get(wire.META_STATUS) is None  # a 429 meant
        assert (await exchange(port, request(globex, CHAT))).status == 200

        _, writer = await asyncio.open_connection("127.0.0.1", port)
        held.append(writer)
        writer.write(head(globex, 70_000))
        await until(lambda: checks.budget.held == 170_000, "globex's head held")
        # Within globex's share, past the replica's total: a 503, sent as a 429 with its mark.
        full = await exchange(port, head(globex, 20_000))
        assert full.status == 429
        assert full.get(wire.META_STATUS) == "503"
        assert full.get("retry-after") == "1"
        assert error(full)["code"] == "overloaded"
        assert error(full)["type"] == "server_error"
    finally:
        for writer in held:
            writer.close()
    await until(lambda: checks.budget.held == 0, "held bytes given back when Envoy hangs up")
    assert checks.budget.by_tenant == {}


async def test_held_bytes_are_given_back_when_the_check_is_answered(
    service: tuple[Director, int], keys: Keys
) -> None:
    checks, port = service
    acme = {"authorization": f"Bearer {keys.acme}"}
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(3):  # three bodies of 100,000 bytes in turn: within the share each time
            body = CHAT[:-1] + b', "user": "' + b"u" * (100_000 - len(CHAT) - 12) + b'"}'
            writer.write(request(acme, body))
            assert (await read_response(reader)).status == 200
            assert checks.budget.held == 0
    finally:
        writer.close()


def test_the_budget_refuses_the_tenant_first_and_keeps_no_idle_tenant() -> None:
    budget = BodyBudget(total=10, per_tenant=6)
    a = budget.take("a", 6)
    assert not isinstance(a, str)
    assert budget.take("a", 1) == "tenant"
    b = budget.take("b", 4)
    assert not isinstance(b, str)
    assert budget.take("b", 1) == "total"
    assert budget.take("a", 1) == "tenant"  # its own share first, whatever the total
    a.release()
    a.release()  # once only
    assert (budget.held, budget.by_tenant) == (4, {"b": 4})
    b.release()
    assert (budget.held, budget.by_tenant) == (0, {})
