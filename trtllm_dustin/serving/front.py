"""The HTTP front of `trtllm-dustin serve`: the one public HTTP port, in front of tritonserver's own.

    client --HTTP--> front (Starlette on uvicorn, in the serve process) --HTTP, 127.0.0.1--> tritonserver --> engine
                     BodyGuard: size and JSON nesting bounded first (guard.py)
                     /v1/completions, /v1/chat/completions   OpenAI -> the Triton model's generate / generate_stream
                     /v1/models                              the repository's models, `<model>:<method>` for a method
                     /metrics                                Prometheus text (metrics.py)
                     /v2/...                                 forwarded to tritonserver as sent (Triton's HTTP API)

The OpenAI endpoints are requests to the Triton model itself (openai_api.py translates both ways), so one engine and
one scheduler serve both APIs. The front holds no keep-alive connection to Triton: at shutdown Triton waits for open
HTTP connections, and only the running requests' ones must hold it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from trtllm_dustin.serving.guard import BodyGuard, BodyLimits
from trtllm_dustin.serving.metrics import CONTENT_TYPE, FrontMetrics
from trtllm_dustin.serving.openai_api import (
    ApiError,
    GenerateCall,
    ServedModel,
    chunk,
    completion,
    error_body,
    from_triton_error,
    parse_request,
)

__all__ = ["Front", "FrontConfig", "FrontServer"]

# Hop-by-hop headers (RFC 9110 7.6.1) and the framing the forwarding side sets itself
_HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
        b"transfer-encoding", b"upgrade", b"host", b"content-length"}
_UNAVAILABLE = "tritonserver is not answering (it may be restarting; serve restarts it within 30 s); retry shortly"


@dataclass(frozen=True)
class FrontConfig:
    triton_http: str  # host:port of tritonserver's HTTP endpoint (127.0.0.1 only)
    models: dict[str, ServedModel] = field(default_factory=dict)  # openai_api.served_models(repository)
    limits: BodyLimits = field(default_factory=BodyLimits)
    request_timeout_s: float = 600.0  # longest wait for the next piece of an answer from Triton


class Front:
    """The ASGI application (`app`) and what it counts (`metrics`)."""

    def __init__(self, config: FrontConfig, metrics: FrontMetrics) -> None:
        self.config, self.metrics = config, metrics
        self.client: httpx.AsyncClient | None = None
        routes = [Route("/v1/models", self.list_models, methods=["GET"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/metrics", self.render_metrics, methods=["GET"]),
                  Route("/v2{path:path}", self.forward, methods=["GET", "POST", "PUT", "DELETE", "HEAD"])]
        starlette = Starlette(routes=routes, lifespan=self._lifespan,
                              exception_handlers={404: self._not_found, 405: self._not_allowed})
        self.app = _Counted(BodyGuard(starlette, config.limits), metrics)

    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        timeout = httpx.Timeout(connect=5.0, read=self.config.request_timeout_s, write=60.0, pool=None)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=f"http://{self.config.triton_http}", timeout=timeout,
                                     limits=limits) as client:
            self.client = client
            yield

    # ---- OpenAI ------------------------------------------------------------------------------------------------
    async def list_models(self, request: Request) -> Response:
        data = [{"id": i, "object": "model", "created": 0, "owned_by": "trtllm-dustin"}
                for model in self.config.models.values() for i in model.ids()]
        return JSONResponse({"object": "list", "data": data})

    async def completions(self, request: Request) -> Response:
        return await self._openai(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._openai(request, chat=True)

    async def _openai(self, request: Request, chat: bool) -> Response:
        try:
            call = parse_request(await request.body(), chat, self.config.models)
            return await (self._stream(call) if call.stream else self._complete(call))
        except ApiError as e:
            return JSONResponse(error_body(e), e.status)

    async def _complete(self, call: GenerateCall) -> Response:
        try:
            upstream = await self.client.post(f"/v2/models/{call.triton_model}/generate", json=call.payload)
        except httpx.TransportError:
            raise ApiError(503, _UNAVAILABLE, kind="server_error", code="backend_unavailable") from None
        answer = _json(upstream.content)
        if upstream.status_code != 200 or "error" in answer:
            raise from_triton_error(call, upstream.status_code, str(answer.get("error", upstream.text)))
        return JSONResponse(completion(call, answer))

    async def _stream(self, call: GenerateCall) -> Response:
        request = self.client.build_request("POST", f"/v2/models/{call.triton_model}/generate_stream",
                                            json=call.payload)
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.TransportError:
            raise ApiError(503, _UNAVAILABLE, kind="server_error", code="backend_unavailable") from None
        events = _events(upstream)
        try:  # the first answer decides the status: a refused request gets its error with its status, not a stream
            first = await anext(events, None)
        except httpx.TransportError:
            first = None
        if upstream.status_code != 200 or first is None or "error" in first:
            await upstream.aclose()
            message = (first or {}).get("error") or _UNAVAILABLE
            raise from_triton_error(call, upstream.status_code if first else 503, str(message))
        return StreamingResponse(self._chunks(call, first, events, upstream), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _chunks(self, call: GenerateCall, first: dict, events: AsyncIterator[dict],
                      upstream: httpx.Response) -> AsyncIterator[bytes]:
        """Triton's events as OpenAI chunks, then the usage chunk (stream_options.include_usage) and [DONE]. A client
        that leaves closes `upstream` (the finally), and the engine frees its slot before the next round."""
        try:
            answer: dict | None = first
            opened = False
            while answer is not None:
                if "error" in answer:
                    yield _sse(error_body(from_triton_error(call, 500, str(answer["error"]))))
                    return
                text, reason = answer.get("text_output", ""), answer.get("finish_reason") or None
                if text or not opened:
                    yield _sse(chunk(call, text, first=not opened))
                    opened = True
                if reason:
                    yield _sse(chunk(call, None, reason))
                    if call.include_usage:
                        yield _sse(chunk(call, None, response=answer))
                    yield b"data: [DONE]\n\n"
                    return
                try:
                    answer = await anext(events, None)
                except httpx.TransportError:
                    answer = None
            yield _sse(error_body(ApiError(503, "tritonserver closed the stream before the answer ended; "
                                           + _UNAVAILABLE, kind="server_error", code="backend_unavailable")))
        finally:
            await upstream.aclose()

    # ---- metrics, Triton's API -------------------------------------------------------------------------------
    async def render_metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def forward(self, request: Request) -> Response:
        """Triton's own HTTP API, as sent (the body already passed the guard); the answer streams back as it
        comes."""
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in _HOP]
        upstream_request = self.client.build_request(request.method, request.url.path, params=request.url.query,
                                                     headers=headers, content=await request.body())
        try:
            upstream = await self.client.send(upstream_request, stream=True)
        except httpx.TransportError:
            return JSONResponse({"error": _UNAVAILABLE}, 503)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for piece in upstream.aiter_raw():
                    yield piece
            finally:
                await upstream.aclose()

        answer_headers = {k: v for k, v in upstream.headers.items() if k.lower().encode() not in _HOP}
        return StreamingResponse(body(), status_code=upstream.status_code, headers=answer_headers)

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        message = f"{request.url.path} is not an endpoint of this server; see /v1/models, /v1/completions, " \
                  "/v1/chat/completions, /metrics and Triton's /v2/ API"
        return JSONResponse(error_body(ApiError(404, message, code="not_found")), 404)

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        message = f"{request.method} is not allowed on {request.url.path}"
        return JSONResponse(error_body(ApiError(405, message, code="method_not_allowed")), 405)


async def _events(upstream: httpx.Response) -> AsyncIterator[dict]:
    """The JSON of each server-sent event of a Triton generate_stream answer (or its JSON error body)."""
    if upstream.status_code != 200:
        yield _json(await upstream.aread())
        return
    async for line in upstream.aiter_lines():
        if line.startswith("data: "):
            yield _json(line[len("data: "):].encode())


def _json(data: bytes) -> dict:
    try:
        value = json.loads(data)
    except ValueError:
        return {"error": data.decode(errors="replace")[:500] or "an empty answer"}
    return value if isinstance(value, dict) else {"error": f"an unexpected answer: {str(value)[:200]}"}


def _sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _route(path: str) -> str:
    """The `route` label: the endpoint, not the path (a client-chosen path must not make new series)."""
    if path in ("/v1/models", "/v1/completions", "/v1/chat/completions", "/metrics"):
        return path
    if path.startswith("/v2/") and path.endswith(("/generate", "/generate_stream")):
        return "/v2/generate_stream" if path.endswith("_stream") else "/v2/generate"
    return "/v2/other" if path.startswith("/v2") else "other"


class _Counted:
    """Counts every answer by route and status (outermost: the guard's refusals are counted too)."""

    def __init__(self, app: Any, metrics: FrontMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(_route(scope["path"]), str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


class FrontServer:
    """uvicorn serving a Front on (address, port) from a thread of this process (port 0: a free one)."""

    def __init__(self, front: Front, address: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((address, port))
        self.port = self.socket.getsockname()[1]
        config = uvicorn.Config(front.app, log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=5, backlog=2048)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="dustin-front", daemon=True)

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.socket]))

    def start(self, timeout_s: float = 30.0) -> FrontServer:
        self._thread.start()
        for _ in range(int(timeout_s / 0.05)):
            if self.server.started or not self._thread.is_alive():
                break
            threading.Event().wait(0.05)
        if not self.server.started:
            raise RuntimeError(f"the HTTP front did not start on port {self.port} within {timeout_s:.0f} s")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(15)
        self.socket.close()
