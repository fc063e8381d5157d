"""Faults switched at runtime through /admin/faults break the /v1 endpoints, nothing else."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from sim import SimPod
from tests.sim.conftest import chat, drained

pytestmark = pytest.mark.timeout(30)


async def set_faults(http: aiohttp.ClientSession, pod: SimPod, **fields: Any) -> Any:
    async with http.put(pod.url + "/admin/faults", json=fields) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def status_of(http: aiohttp.ClientSession, pod: SimPod, method: str, path: str) -> int:
    body = chat("hi", max_tokens=2) if method == "POST" else None
    async with http.request(method, pod.url + path, json=body) as resp:
        await resp.read()
        return resp.status


async def test_admin_merges_shows_and_clears(pod: SimPod, http: aiohttp.ClientSession) -> None:
    await set_faults(http, pod, error_rate=0.5)
    current = await set_faults(http, pod, latency_ms=5, close_mid_stream=True)
    assert current["error_rate"] == 0.5 and current["latency_ms"] == 5
    assert current["close_mid_stream"] == 1.0
    async with http.get(pod.url + "/admin/faults") as resp:
        assert await resp.json() == current
    async with http.delete(pod.url + "/admin/faults") as resp:
        assert (await resp.json())["error_rate"] == 0


@pytest.mark.parametrize("fields", [{"error_status": 502}, {"bogus": 1}, {"error_rate": 2}])
async def test_admin_rejects_bad_faults(
    pod: SimPod, http: aiohttp.ClientSession, fields: dict[str, Any]
) -> None:
    async with http.put(pod.url + "/admin/faults", json=fields) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize("status", [500, 503])
async def test_error_rate_fails_v1_only(
    pod: SimPod, http: aiohttp.ClientSession, status: int
) -> None:
    await set_faults(http, pod, error_rate=1, error_status=status)
    async with http.post(pod.url + "/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == status and resp.content_type == "application/json"
        error = (await resp.json())["error"]
        assert (
            error["code"] == status
            and error["type"]
            == {500: "InternalServerError", 503: "ServiceUnavailableError"}[status]
        )
    assert await status_of(http, pod, "GET", "/v1/models") == status
    assert await status_of(http, pod, "GET", "/metrics") == 200
    assert await status_of(http, pod, "GET", "/health") == 200
    await http.delete(pod.url + "/admin/faults")
    assert await status_of(http, pod, "POST", "/v1/chat/completions") == 200


async def test_errors_can_hit_only_some_tenants(pod: SimPod, http: aiohttp.ClientSession) -> None:
    await set_faults(http, pod, error_rate=1, error_tenants=["bad"])

    async def status(tenant: str) -> int:
        headers = {"x-llmgw-tenant": tenant} if tenant else {}
        async with http.post(pod.url + "/v1/chat/completions", json=chat("hi", max_tokens=2),
                             headers=headers) as resp:  # fmt: skip
            await resp.read()
            return resp.status

    assert [await status(t) for t in ("bad", "good", "")] == [500, 200, 200]


async def test_partial_error_rate_fails_some(pod: SimPod, http: aiohttp.ClientSession) -> None:
    await set_faults(http, pod, error_rate=0.5)
    statuses = [await status_of(http, pod, "GET", "/v1/models") for _ in range(40)]
    assert 5 <= statuses.count(500) <= 35 and statuses.count(200) >= 5


async def test_latency_delays_the_first_byte(pod: SimPod, http: aiohttp.ClientSession) -> None:
    await set_faults(http, pod, latency_ms=300)
    start = time.monotonic()
    assert await status_of(http, pod, "GET", "/v1/models") == 200
    assert time.monotonic() - start >= 0.29
    start = time.monotonic()
    assert await status_of(http, pod, "GET", "/metrics") == 200
    assert time.monotonic() - start < 0.29


async def test_hang_accepts_and_never_answers(pod: SimPod, http: aiohttp.ClientSession) -> None:
    await set_faults(http, pod, hang=True)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(status_of(http, pod, "POST", "/v1/chat/completions"), 0.5)
    assert await status_of(http, pod, "GET", "/health") == 200


async def test_unhealthy_fails_health_only(pod: SimPod, http: aiohttp.ClientSession) -> None:
    await set_faults(http, pod, unhealthy=True)
    assert await status_of(http, pod, "GET", "/health") == 503
    assert await status_of(http, pod, "POST", "/v1/chat/completions") == 200


async def test_close_mid_stream_drops_a_stream_after_a_few_chunks(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    await set_faults(http, pod, close_mid_stream=True)
    body = chat("hi", max_tokens=50, ignore_eos=True, stream=True)
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(pod.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            async for data in resp.content.iter_any():
                received += data
    assert received.count(b"data: {") >= 3 and b"[DONE]" not in received
    assert await drained(pod)


async def test_close_mid_stream_cuts_a_json_reply(pod: SimPod, http: aiohttp.ClientSession) -> None:
    await set_faults(http, pod, close_mid_stream=1.0)
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(pod.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 200
            await resp.read()


async def test_error_mid_stream_reports_the_error_in_the_stream(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    await set_faults(http, pod, error_mid_stream=1)
    body = chat("hi", max_tokens=50, ignore_eos=True, stream=True)
    async with http.post(pod.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        events = (await resp.text()).split("\n\n")  # the stream ends cleanly
    assert events[-3:] == [
        'data: {"error": {"message": "Internal server error", "type": "InternalServerError", '
        '"param": null, "code": 500}}',
        "data: [DONE]",
        "",
    ]
    assert len(events) - 3 >= 3 and 'finish_reason":"length' not in "".join(events)
    assert await drained(pod)
    async with http.post(pod.url + "/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 500
        assert (await resp.json())["error"]["message"] == "Internal server error"
