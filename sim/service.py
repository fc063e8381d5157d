"""The HTTP adapter: vLLM's OpenAI-compatible endpoints, /metrics and the fault admin API."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from llmgw import wire
from sim.chunks import DONE, STREAM_ERROR, Reply, fingerprint, random_id
from sim.engine import Engine, Sequence
from sim.errors import ApiError, not_found_route, request_invalid
from sim.faults import CLOSE_AFTER_CHUNKS, FaultState
from sim.protocol import PRIORITY_HEADER, REQUEST_ID_HEADER, Kind, Request, dumps, parse
from sim.responses import ResponseReply, ResponsesRequest, cannot_cancel, retrieve_query
from sim.responses import parse as parse_responses
from sim.store import ResponseStore, Stored
from sim.types import SimSettings

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_ERROR_TYPES = {500: "InternalServerError", 503: "ServiceUnavailableError"}


# What vLLM's prometheus_client (current releases) sends to a scraper without an Accept header.
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST


def json_response(body: Any, status: int = 200) -> web.Response:
    """A JSON reply with vLLM's bare `application/json` content type (no charset)."""
    return web.Response(body=dumps(body).encode(), status=status, content_type="application/json")


def error_response(error: ApiError) -> web.Response:
    return json_response(error.body(), error.status)


class Service:
    def __init__(
        self,
        settings: SimSettings,
        engine: Engine,
        registry: CollectorRegistry,
        faults: FaultState,
        die: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.registry = registry
        self.faults = faults
        self.die = die
        self.closing = asyncio.Event()  # set at shutdown: releases hung requests
        self.started = int(time.time())
        self.fingerprint = fingerprint(settings)
        # vLLM makes a new one (and a new `created`) for every /v1/models call; fixed per pod
        # here, so that two reads of the card agree.
        self.permission_id = "modelperm-" + random_id()
        self.store = ResponseStore.of(settings)

    def app(self) -> web.Application:
        # vLLM (uvicorn) sets no body size limit; aiohttp's default 1 MiB would answer a plain
        # text 413 that no vLLM sends.
        app = web.Application(
            middlewares=[self._starlette_errors, self._authenticate, self._inject_faults],
            client_max_size=1 << 30,
        )
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/chat/completions", self.completion_handler("chat"))
        app.router.add_post("/v1/completions", self.completion_handler("completion"))
        app.router.add_post("/v1/responses", self.responses)
        # vLLM serves these with the store off too: nothing is found.
        app.router.add_get("/v1/responses/{response_id}", self.retrieve_response)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.cancel_response)
        app.router.add_get("/admin/gpu_seconds", self.gpu_seconds)
        app.router.add_get("/admin/faults", self.get_faults)
        app.router.add_put("/admin/faults", self.put_faults)
        app.router.add_delete("/admin/faults", self.delete_faults)
        return app

    @web.middleware
    async def _starlette_errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Unknown paths and methods answer like Starlette: `{"detail": ...}`."""
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return json_response(not_found_route(), 404)
        except web.HTTPMethodNotAllowed:
            return json_response({"detail": "Method Not Allowed"}, 405)

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """vLLM's AuthenticationMiddleware: with an API key, every /v1 path but OPTIONS needs
        `Authorization: Bearer KEY`, else a 401 before routing; /health and /metrics stay open."""
        key = self.settings.api_key
        if key is None or not request.path.startswith("/v1") or request.method == "OPTIONS":
            return await handler(request)
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        expected = key.get_secret_value().encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), expected):
            return json_response({"error": "Unauthorized"}, 401)
        return await handler(request)

    @web.middleware
    async def _inject_faults(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.startswith("/v1/"):
            return await handler(request)
        faults = self.faults.current
        if faults.hang:
            await self.closing.wait()
            return error_response(ApiError(503, "shutting down", _ERROR_TYPES[503]))
        if faults.latency_ms:
            await asyncio.sleep(faults.latency_ms / 1e3)
        if self.faults.error(request.headers.get(wire.HEADER_TENANT, "")):
            status = faults.error_status
            return error_response(ApiError(status, "injected fault", _ERROR_TYPES[status]))
        return await handler(request)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.faults.current.unhealthy else 200)

    async def models(self, request: web.Request) -> web.Response:
        model = self.settings.model
        permission = {
            "id": self.permission_id,
            "object": "model_permission",
            "created": self.started,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        card = {"id": model, "object": "model", "created": self.started, "owned_by": "vllm"}
        card |= {"root": model, "parent": None, "max_model_len": self.settings.max_model_len}
        return json_response({"object": "list", "data": [card | {"permission": [permission]}]})

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

    # Completions.

    def completion_handler(self, kind: Kind) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                body = await _json_body(request)
                parsed = parse(kind, body, self.settings, request.headers.get(PRIORITY_HEADER))
            except ApiError as exc:
                return error_response(exc)
            return await self._complete(request, parsed)

        return handle

    async def _complete(self, request: web.Request, parsed: Request) -> web.StreamResponse:
        request_id = request.headers.get(REQUEST_ID_HEADER) or parsed.request_id
        reply = Reply(parsed, self.settings.model, self.fingerprint, request_id)
        fail = self.faults.fail_mid_stream()
        seqs = await self.engine.submit(parsed.jobs, request_id or "")
        try:
            if parsed.stream:
                return await self._stream(request, reply, seqs, fail)
            outputs, finishes = [s.output for s in seqs], [s.job.finish_reason for s in seqs]
            return await self._whole(request, seqs, fail, lambda: reply.whole(outputs, finishes))
        finally:
            for seq in seqs:
                self.engine.abort(seq)  # a no-op unless the client left early

    async def _whole(
        self,
        request: web.Request,
        seqs: list[Sequence],
        fail: bool,
        body: Callable[[], dict[str, Any]],
    ) -> web.StreamResponse:
        """A JSON reply once every sequence has ended (`body` makes it)."""
        await asyncio.gather(*(seq.ended.wait() for seq in seqs))
        if not all(seq.done for seq in seqs):
            return error_response(ApiError(503, "shutting down", _ERROR_TYPES[503]))
        if fail:
            return error_response(ApiError(500, "Internal server error", _ERROR_TYPES[500]))
        whole = body()
        if self.faults.close():
            return await _send_half(request, dumps(whole).encode())
        return json_response(whole)

    async def _stream(
        self, request: web.Request, reply: Reply, seqs: list[Sequence], fail: bool
    ) -> web.StreamResponse:
        response = await _event_stream(request)
        close_after = CLOSE_AFTER_CHUNKS if self.faults.close() else None
        fail_after = CLOSE_AFTER_CHUNKS if fail else None
        progress = seqs[0].progress  # shared by the request's sequences
        sent = [0] * len(seqs)
        chunks_sent = 0
        started = False
        try:
            while True:
                await progress.wait()
                progress.clear()
                chunks: list[bytes] = []
                if not started and any(seq.output for seq in seqs):
                    started = True  # vLLM sends every choice's role chunk with the first output
                    if reply.chat:
                        chunks += [reply.role(i) for i in range(len(seqs))]
                for i, seq in enumerate(seqs):
                    last = len(seq.output)
                    for t in range(sent[i], last):
                        finish = seq.job.finish_reason if seq.done and t == last - 1 else None
                        chunks.append(reply.token(i, seq.output[t], finish, t + 1))
                    sent[i] = last
                chunks_sent += len(chunks)
                if close_after is not None and chunks_sent >= close_after:
                    await response.write(b"".join(chunks))
                    _drop(request)
                    return response
                if fail_after is not None and chunks_sent >= fail_after:
                    # A GenerationError mid-stream: vLLM reports it in the stream and ends it.
                    await response.write(b"".join(chunks) + STREAM_ERROR + DONE)
                    await response.write_eof()
                    return response
                if chunks:
                    await response.write(b"".join(chunks))
                if all(seq.finished for seq in seqs):
                    break
            if not all(seq.done for seq in seqs):
                _drop(request)  # shutting down: end the stream without [DONE]
                return response
            tail = reply.usage_chunk(sum(sent)) if reply.request.include_usage else b""
            await response.write(tail + DONE)
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client left; the finally of _complete aborts the sequences
        return response

    # The Responses API.

    async def responses(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await _json_body(request)
            header_priority = request.headers.get(PRIORITY_HEADER)
            parsed = parse_responses(body, self.settings, header_priority, self.store)
        except ApiError as exc:
            return error_response(exc)
        reply = ResponseReply(parsed, self.settings.model)
        fail = self.faults.fail_mid_stream()
        if parsed.stream:
            return await self._stream_events(request, reply, parsed, fail)
        (seq,) = await self.engine.submit([parsed.job], reply.id)
        try:
            return await self._whole(
                request, [seq], fail, lambda: self._kept(parsed, reply.whole(seq))
            )
        finally:
            self.engine.abort(seq)  # a no-op unless the client left early

    def _kept(self, parsed: ResponsesRequest, response: dict[str, Any]) -> dict[str, Any]:
        """A finished response, kept if its request asks (`store`, true by default): a no-op
        with the store off. One that failed or was cut short never gets here, as in vLLM."""
        if parsed.body.store:
            self.store.put(Stored(response, parsed.messages))
        return response

    async def _stream_events(
        self, request: web.Request, reply: ResponseReply, parsed: ResponsesRequest, fail: bool
    ) -> web.StreamResponse:
        response = await _event_stream(request)
        # A failure during generation cuts the stream as a dropped connection does: vLLM
        # validates its error body as a stream event, which fails, and the server hangs up.
        cut_after = CLOSE_AFTER_CHUNKS if self.faults.close() or fail else None
        try:
            await response.write(reply.opening())  # before the engine has the request
        except ConnectionResetError:
            return response
        (seq,) = await self.engine.submit([parsed.job], reply.id)
        sent = 0
        try:
            while True:
                await seq.progress.wait()
                seq.progress.clear()
                events = b"".join(reply.token(t) for t in seq.output[sent:])
                sent = len(seq.output)
                if cut_after is not None and sent >= cut_after:
                    await response.write(events)
                    _drop(request)
                    return response
                if events:
                    await response.write(events)
                if seq.finished:
                    break
            if not seq.done:
                _drop(request)  # shutting down: end the stream unfinished
                return response
            events, final = reply.closing(seq)
            self._kept(parsed, final)  # before response.completed goes out, as vLLM keeps it
            await response.write(events)
            await response.write_eof()
        except ConnectionResetError:
            pass
        finally:
            self.engine.abort(seq)  # a no-op unless the client left early
        return response

    async def retrieve_response(self, request: web.Request) -> web.StreamResponse:
        """GET /v1/responses/{id}: the stored Response object, or vLLM's 404."""
        try:
            query = retrieve_query(request.query.items())
            stored = self.store.find(request.match_info["response_id"])
        except ApiError as exc:
            return error_response(exc)
        if not query.stream:
            return json_response(stored.response)
        # vLLM replays the events of a background response only; for one that ran in the
        # foreground its generator raises ("Unknown response_id") once the 200 and the
        # event-stream headers are out, and uvicorn closes the connection: the same here.
        response = await _event_stream(request)
        _drop(request)
        return response

    async def cancel_response(self, request: web.Request) -> web.Response:
        """POST /v1/responses/{id}/cancel: vLLM's 404, else its 400 (nothing here runs in the
        background, so no stored response is queued or in progress)."""
        try:
            self.store.find(request.match_info["response_id"])
        except ApiError as exc:
            return error_response(exc)
        return error_response(cannot_cancel())

    async def gpu_seconds(self, request: web.Request) -> web.Response:
        """Each recent request's exact GPU time by its ID (the simulator's own: no vLLM route)."""
        return json_response(self.engine.gpu_seconds)

    # Fault admin.

    async def get_faults(self, request: web.Request) -> web.Response:
        return json_response(self.faults.current.model_dump())

    async def put_faults(self, request: web.Request) -> web.StreamResponse:
        try:
            faults = self.faults.update(json.loads(await request.read()))
        except ValueError as exc:
            return error_response(ApiError(400, str(exc)))
        response = json_response(faults.model_dump())
        if faults.die:
            await response.prepare(request)
            await response.write_eof()
            self.die()
        return response

    async def delete_faults(self, request: web.Request) -> web.Response:
        return json_response(self.faults.clear().model_dump())


async def _json_body(request: web.Request) -> Any:
    """The request's JSON body; ApiError as vLLM's validate_json_request and FastAPI refuse."""
    if request.content_type != "application/json":
        reason = "Unsupported Media Type: Only 'application/json' is allowed"
        raise request_invalid([reason])
    raw = await request.read()
    try:
        return json.loads(raw)
    except ValueError as exc:
        err = {
            "type": "json_invalid",
            "loc": ("body", getattr(exc, "pos", 0)),
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": getattr(exc, "msg", str(exc))},
        }
        raise request_invalid([err]) from None


async def _event_stream(request: web.Request) -> web.StreamResponse:
    """A server-sent-events reply, its headers sent."""
    response = web.StreamResponse()
    response.content_type = "text/event-stream"
    response.charset = "utf-8"
    await response.prepare(request)
    return response


def _drop(request: web.Request) -> None:
    """Close the TCP connection under a response (after flushing what was written)."""
    if request.transport is not None:
        request.transport.close()


async def _send_half(request: web.Request, body: bytes) -> web.StreamResponse:
    """Send the headers and half the body of a JSON reply, then drop the connection."""
    response = web.StreamResponse()
    response.content_type = "application/json"
    response.content_length = len(body)
    await response.prepare(request)
    await response.write(body[: len(body) // 2])
    _drop(request)
    return response
