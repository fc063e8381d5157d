"""A trivially fast OpenAI-compatible pod for benchmarks: raw asyncio HTTP/1.1 on uvloop.

It answers at once, so what a benchmark measures is the gateway, not the pod:
`POST /v1/chat/completions` with a fixed completion and usage (non-stream), or an SSE stream of
`max_tokens` content events `--token-interval-ms` apart, then finish, usage and `[DONE]`
(like vLLM with --enable-force-include-usage in its "final" mode); `GET /v1/models`, `/health`
and a `/metrics` page with the vLLM gauges the router scrapes.

    python -m bench.fakepod --port 9000 [--token-interval-ms 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import uvloop

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROMPT_TOKENS = 12
CHUNK = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": MODEL}


def response(status: str, ctype: str, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


def completion(max_tokens: int) -> bytes:
    body = {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok " * max_tokens},
                "finish_reason": "length",
            }
        ],
        "usage": {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": max_tokens,
            "total_tokens": PROMPT_TOKENS + max_tokens,
        },
    }
    return response("200 OK", "application/json", json.dumps(body).encode())


def event(obj: object) -> bytes:
    data = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


DONE = b"data: [DONE]\n\n"
DONE_CHUNK = b"%x\r\n%s\r\n" % (len(DONE), DONE)


def chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return event({**CHUNK, "choices": [choice]})


class Pod:
    def __init__(self, token_interval: float) -> None:
        self.token_interval = token_interval
        self.running = 0
        self.models = json.dumps(
            {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}
        ).encode()

    def metrics(self) -> bytes:
        text = (
            f'vllm:num_requests_running{{model_name="{MODEL}"}} {self.running}\n'
            f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0\n'
            f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.0\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="28000"} 1.0\n'
        )
        return response("200 OK", "text/plain; version=0.0.4", text.encode())

    async def stream(self, writer: asyncio.StreamWriter, max_tokens: int) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
            + chunk({"role": "assistant", "content": "ok"})
        )
        for _ in range(max_tokens - 1):
            await asyncio.sleep(self.token_interval)
            writer.write(chunk({"content": " ok"}))
        usage = {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": max_tokens,
            "total_tokens": PROMPT_TOKENS + max_tokens,
        }
        writer.write(
            chunk({}, "length")
            + event({**CHUNK, "choices": [], "usage": usage})
            + DONE_CHUNK
            + b"0\r\n\r\n"
        )

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, _, rest = head.partition(b"\r\n")
                method, path, _ = line.split(b" ", 2)
                length = 0
                for header in rest.split(b"\r\n"):
                    name, _, value = header.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                await self.answer(method, path, body, writer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def answer(
        self, method: bytes, path: bytes, body: bytes, writer: asyncio.StreamWriter
    ) -> None:
        if method == b"POST" and path == b"/v1/chat/completions":
            request = json.loads(body)
            max_tokens = max(1, int(request.get("max_tokens") or 16))
            self.running += 1
            try:
                if request.get("stream"):
                    await self.stream(writer, max_tokens)
                else:
                    writer.write(completion(max_tokens))
            finally:
                self.running -= 1
        elif path == b"/health":
            writer.write(response("200 OK", "text/plain", b"ok"))
        elif path == b"/metrics":
            writer.write(self.metrics())
        elif path == b"/v1/models":
            writer.write(response("200 OK", "application/json", self.models))
        else:
            writer.write(response("404 Not Found", "application/json", b'{"error": "not found"}'))


async def main(host: str, port: int, token_interval: float) -> None:
    pod = Pod(token_interval)
    server = await asyncio.start_server(pod.handle, host, port, backlog=1024)
    async with server:
        await server.serve_forever()


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-interval-ms", type=float, default=10.0)
    args = parser.parse_args()
    uvloop.run(main(args.host, args.port, args.token_interval_ms / 1e3))


if __name__ == "__main__":
    cli()
