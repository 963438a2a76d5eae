"""The body guard: every request body is bounded in size and JSON nesting before anything parses it.

The tritonserver of nvidia-pytriton 0.7.0 parses JSON recursively: a 200 KB body nested 100,000 deep
(`{"text_input": [[[[...`) overflows its stack and the server dies with SIGSEGV, and a 10 MB body takes about 20 s to
be refused. The HTTP front (front.py) wraps its whole application in `BodyGuard`, so neither Triton's generate API
(forwarded) nor the OpenAI API sees a body that

- declares a Content-Length over `max_body_bytes` (refused at once, before a byte of it is read), or sends more
  than that (refused as soon as it does), or
- nests arrays and objects deeper than `max_json_depth` (`json_depth`: no recursion, a few passes of C code over the
  bytes, about 20 ms for 4 MB).

Both are answered 413 / 400 with one line naming the value, the limit and the fix, in the OpenAI error shape on
/v1/ paths and Triton's (`{"error": ...}`) elsewhere.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["BodyGuard", "BodyLimits", "json_depth"]

_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


@dataclass(frozen=True)
class BodyLimits:
    max_body_bytes: int = 4 * 2**20  # a 128K-token prompt is about 0.5 MB of text, 0.8 MB as input_ids
    max_json_depth: int = 32  # an OpenAI chat request nests 4 deep (body, messages, message, content parts)

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes={self.max_body_bytes} must be >= 1024; raise it")
        if self.max_json_depth < 4:
            raise ValueError(f"max_json_depth={self.max_json_depth} must be >= 4 (an OpenAI chat request nests 4 "
                             "deep); raise it")


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in `body`, counting brackets outside strings, without recursion.

    Escapes go first (an escaped backslash, then an escaped quote), so every quote left opens or closes a string
    and the text between odd and even quotes is outside strings. Invalid JSON gets some number: its parser refuses
    it afterwards."""
    plain = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(plain.split(b'"')[0::2]).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps, dtype=np.int64).max())


class _Refused(Exception):
    def __init__(self, status: int, message: str, param: str | None, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class BodyGuard:
    """ASGI middleware: reads the whole body within the limits, checks its nesting, then hands it to the app."""

    def __init__(self, app: Any, limits: BodyLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive)
        except _Refused as e:
            await _refuse(scope, send, e)
            if e.code == "body_too_large":  # the rest of the body is still on its way
                await _discard(receive)
            return
        delivered = False

        async def replay() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect, for streaming responses

        await self.app(scope, replay, send)

    async def _read(self, scope: dict, receive: Any) -> bytes:
        limit = self.limits.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                raise _Refused(400, f"Content-Length {declared[:40].decode(errors='replace')!r} is not a number; "
                               "send the body's size in bytes", None, "invalid_content_length")
            if int(declared) > limit:
                raise _Refused(413, f"the body is {int(declared)} bytes, over this server's limit of {limit}; send a "
                               "smaller body (or start serve with a larger --max-body-bytes)", None, "body_too_large")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Refused(400, "the client disconnected before sending its body", None, "disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _Refused(413, f"the body is over this server's limit of {limit} bytes; send a smaller body (or "
                               "start serve with a larger --max-body-bytes)", None, "body_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        depth = json_depth(body)
        if depth > self.limits.max_json_depth:
            raise _Refused(400, f"the JSON body nests {depth} arrays or objects deep, over this server's limit of "
                           f"{self.limits.max_json_depth}; send a flatter body", None, "json_too_deep")
        return body


async def _discard(receive: Any, timeout_s: float = 5.0) -> None:
    """Read and drop what is left of a refused body (for at most `timeout_s`) after the answer went out: closing a
    socket with unread data resets it, and the reset can destroy the answer before the client reads it."""
    async def drain() -> None:
        while True:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return

    try:
        await asyncio.wait_for(drain(), timeout_s)
    except asyncio.TimeoutError:
        pass


async def _refuse(scope: dict, send: Any, error: _Refused) -> None:
    """The error in the shape of the API the path belongs to; the connection closes after it."""
    if scope["path"].startswith("/v1/"):
        payload = {"error": {"message": error.message, "type": "invalid_request_error", "param": error.param,
                             "code": error.code}}
    else:
        payload = {"error": error.message}
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})
