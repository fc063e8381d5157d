"""A pod that records what it receives: the headers and body of every request, for tests that
check what the gateway lets through. Speaks just enough vLLM for Envoy's health checks and the
router's scrapes."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tools.procs import free_port

MODEL = "recorded-model"
METRICS = (
    f'vllm:num_requests_running{{model_name="{MODEL}"}} 0\n'
    f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0\n'
    f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0\n'
)


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class RecordingPod:
    port: int
    requests: list[Received] = field(default_factory=list)
    # Sent with every non-stream completion, as an upstream of the pod's own might.
    response_headers: dict[str, str] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


# A stream as vLLM sends it with forced usage, in chunks that cut events in two, ending with a
# partial event (no blank line after it): a filter that holds a tail must still deliver it.
STREAM_TAIL = b"data: [DONE]\n"


async def _stream(request: web.Request, usage: dict[str, int]) -> web.StreamResponse:
    chunk = {"id": "x", "object": "chat.completion.chunk", "model": MODEL}
    events = [
        {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {**chunk, "choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]},
        {**chunk, "choices": [], "usage": usage},
    ]
    raw = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + STREAM_TAIL
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for at in range(0, len(raw), 37):
        await response.write(raw[at : at + 37])
        await asyncio.sleep(0.005)  # separate chunks on the wire
    await response.write_eof()
    return response


async def _app(pod: RecordingPod) -> web.Application:
    async def completion(request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw) if raw else {}
        pod.requests.append(
            Received(request.path, {k.lower(): v for k, v in request.headers.items()}, body)
        )
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        if body.get("stream") is True:
            return await _stream(request, usage)
        return web.json_response(
            {"id": "x", "object": "chat.completion", "model": MODEL, "usage": usage,
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                          "finish_reason": "stop"}]},
            headers=pod.response_headers,
        )  # fmt: skip

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=METRICS, content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completion)
    app.router.add_post("/v1/completions", completion)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


@contextmanager
def recording_pod() -> Iterator[RecordingPod]:
    """A recording pod on a free port, served from a thread of its own."""
    pod = RecordingPod(free_port())
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    runner: list[web.AppRunner] = []

    async def start() -> None:
        r = web.AppRunner(await _app(pod))
        await r.setup()
        await web.TCPSite(r, "127.0.0.1", pod.port).start()
        runner.append(r)
        ready.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    assert ready.wait(10)
    try:
        yield pod
    finally:
        asyncio.run_coroutine_threadsafe(runner[0].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
