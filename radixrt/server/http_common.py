"""What both HTTP APIs (native_api.py, openai_api.py) are built from: the server's context,
ApiError and its JSON body, reading a typed body under --max-request-bytes, a call's
requests awaited on the event loop (Submission), and JSON / server-sent-event encoding."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import msgspec
from fastapi import Request
from fastapi.responses import Response

from radixrt.config import ServerArgs
from radixrt.frontend.generate_input import GenerateInput, GenerateRequest
from radixrt.frontend.req_state import ReqState
from radixrt.frontend.tokenizer_manager import TokenizerManager
from radixrt.server.metrics import ServerMetrics
from radixrt.server.schemas import decode_body

DISCONNECT_POLL_S = 1.0


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 cause: str | None = None):
        """cause: what /metrics counts the error under (radixrt:refused_requests_total and
        radixrt:internal_errors_total): default the field it names, else its kind."""
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type
        self.cause = cause or param or type.removesuffix("_error")


@dataclass
class ServerContext:
    args: ServerArgs
    manager: TokenizerManager
    metrics: ServerMetrics
    version: str = "0.1.0"
    check_alive: Callable[[], str | None] = field(default=lambda: None)  # None, or which child died
    dead: str | None = None  # why the backend is gone, once it is
    draining: str | None = None  # set at SIGTERM: no new requests

    def unavailable(self) -> str | None:
        """Why the server cannot take a request now, or None."""
        return self.dead or self.manager.dead or self.check_alive() or self.draining


def json_response(data: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(data), status_code=status, media_type="application/json")


def error_body(err: ApiError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.status}}


def error_response(err: ApiError) -> Response:
    return json_response(error_body(err), err.status)


def failure(f: Any) -> ApiError:
    """A failed request's finish reason (an abort with a status) as an ApiError."""
    return ApiError(f.status_code, f.message or "the request failed",
                    type="invalid_request_error" if f.status_code < 500 else "server_error",
                    cause="request_failed" if f.status_code >= 500 else None)


def counted(ctx: ServerContext, err: ApiError) -> ApiError:
    """err, counted in /metrics (for an error answered without raising it: a stream's error event)."""
    ctx.metrics.count_error(err.status, err.cause)
    return err


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 once it passes `limit` bytes (before any parsing)."""
    if int(request.headers.get("content-length") or 0) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes (--max-request-bytes)", cause="body_too_large")


async def read_typed(ctx: ServerContext, request: Request, kind: type) -> Any:
    raw = await read_body(request, ctx.args.max_request_bytes)
    return await ctx.manager.run_off_loop(decode_body, raw, kind)


async def generate_input(ctx: ServerContext, req: GenerateRequest) -> GenerateInput:
    """The call's items, built off the event loop (a list of thousands of prompts takes a while)."""
    return await ctx.manager.run_off_loop(GenerateInput.from_request, req, ctx.args.max_n)


class Submission:
    """The requests of one HTTP call, awaited on the event loop."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx, self.updates = ctx, asyncio.Queue()
        self.states: list[ReqState] = []

    @classmethod
    async def start(cls, ctx: ServerContext, gen: GenerateInput) -> Submission:
        why = ctx.unavailable()
        if why:
            raise ApiError(503, f"the server cannot take requests: {why}", type="server_error")
        sub, loop = cls(ctx), asyncio.get_running_loop()
        sub.states = await ctx.manager.submit_all_async(gen, lambda: loop.call_soon_threadsafe(sub.updates.put_nowait, None))
        return sub

    async def wait(self, request: Request) -> bool:
        """Until every request is done (True), or the client went away (False, requests aborted)."""
        while not all(s.done for s in self.states):
            try:
                await asyncio.wait_for(self.updates.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.abort()
                    return False
        return True

    async def stream(self) -> AsyncIterator[None]:
        """Yields after each update until every request is done; aborts the rest if the stream is dropped."""
        try:
            done = False
            while not done:
                await self.updates.get()
                # NOTE: read `done` before the consumer reads the states: if it flipped in between,
                # its notification is still queued, so the final state is always yielded.
                done = all(s.done for s in self.states)
                yield None
        finally:
            self.abort()

    def abort(self) -> None:
        """Abort the requests not done (a client that left: counted as SGLang counts aborts)."""
        aborted = sum(self.ctx.manager.abort(s.rid) and s.log_metrics for s in self.states if not s.done)
        self.ctx.metrics.count_aborts(aborted, "client_disconnected")

    def check(self) -> None:
        """Raise the first failure among the finished requests as an ApiError."""
        for s in self.states:
            if s.error is not None:
                raise failure(s.error)

    def results(self) -> list[dict[str, Any]]:
        return [s.result(self.ctx.manager.tokenizer) for s in self.states]


def sse(data: Any) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def body_schema(name: str) -> dict[str, Any]:
    """openapi_extra for a route whose JSON body is the named struct (see http_server.install_openapi)."""
    ref = {"$ref": f"#/components/schemas/{name}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}
