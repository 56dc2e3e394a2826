"""What both HTTP APIs (native_api.py, openai_api.py) are built from: the server's context,
ApiError and its JSON body, reading a typed body under --max-request-bytes, a call through
the door (prepare) and its requests awaited on the event loop (Submission), and JSON / server-sent-event encoding
(event_stream: the one way every stream is answered)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from radixrt.config import ServerArgs
from radixrt.config_views import HttpConfig
from radixrt.frontend.generate_input import GenerateInput, GenerateRequest
from radixrt.frontend.intake import Intake, PreparedCall
from radixrt.frontend.req_state import ReqState
from radixrt.frontend.tokenizer_manager import TokenizerManager
from radixrt.server.access import TenantKeys
from radixrt.server.metrics import ServerMetrics
from radixrt.server.schemas import decode_body
from radixrt.settings.scheduling import TenantSpec

logger = logging.getLogger(__name__)


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
    http: HttpConfig = field(init=False)  # what the front door's checks read, from args
    keys: TenantKeys = field(init=False)  # --api-keys-file's tenant keys

    def __post_init__(self) -> None:
        self.http = HttpConfig.of(self.args)
        self.keys = TenantKeys(self.http.api_keys_file)

    def unavailable(self) -> str | None:
        """Why the server cannot take a request now, or None."""
        return self.dead or self.manager.dead or self.check_alive() or self.draining

    @property
    def intake(self) -> Intake:
        """The door every call goes through (checks, tokenizing, the prepared requests) and its thread pool."""
        return self.manager.intake


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


def internal_error(e: BaseException) -> ApiError:
    """A bug's answer (its traceback is logged, never sent): a 500 counted under cause "internal"."""
    return ApiError(500, f"internal server error ({type(e).__name__}); see the server log", type="server_error",
                    cause="internal")


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
    raw = await read_body(request, ctx.http.max_request_bytes)
    return await ctx.intake.run_off_loop(decode_body, raw, kind)


async def prepare(ctx: ServerContext, call: GenerateRequest | GenerateInput, request: Request | None,
                  share_prefix: bool = False) -> PreparedCall:
    """The call through the door in one pass (Intake.prepare), off the event loop (a list of
    thousands of prompts takes a while), under the tenant the caller's key names (the door put
    it in request.state; None: no caller, a health probe)."""
    tenant: TenantSpec | None = getattr(request.state, "tenant", None) if request is not None else None
    return await ctx.intake.prepare_async(call, tenant=tenant, max_requests=ctx.http.max_requests_per_call,
                                          share_prefix=share_prefix)


class Submission:
    """The requests of one HTTP call, awaited on the event loop."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx, self.updates = ctx, asyncio.Queue()
        self.states: list[ReqState] = []
        self._aborted = False

    @classmethod
    async def start(cls, ctx: ServerContext, call: PreparedCall) -> Submission:
        """Send a prepared call (http_common.prepare), unless the server cannot take requests now (a 503)."""
        why = ctx.unavailable()
        if why:
            raise ApiError(503, f"the server cannot take requests: {why}", type="server_error")
        sub, loop = cls(ctx), asyncio.get_running_loop()
        sub.states = await ctx.manager.submit_async(call, lambda: loop.call_soon_threadsafe(sub.updates.put_nowait, None))
        return sub

    async def wait(self, request: Request) -> bool:
        """Until every request is done (True), or the client went away (False, requests aborted).
        A task awaits the client's disconnect beside the requests, so a client that leaves is
        noticed at once, tokens flowing or not (request.is_disconnected() never sees it through
        the HTTP middleware, whose receive cannot answer within a cancelled scope)."""
        left = asyncio.Event()
        watcher = asyncio.create_task(self._watch(request, left))
        try:
            while not all(s.done for s in self.states):
                await self.updates.get()
                while not self.updates.empty():  # a burst of updates: one look at the states
                    self.updates.get_nowait()
                if left.is_set():
                    self.abort()
                    return False
            return True
        finally:
            watcher.cancel()

    async def _watch(self, request: Request, left: asyncio.Event) -> None:
        """Set `left` (and wake wait) once the client disconnects: after the body, the next ASGI
        message of a request is its disconnect."""
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - the server's receive failing: the call runs on unwatched
            logger.exception("cannot watch a client for its disconnect")
            return
        left.set()
        self.updates.put_nowait(None)

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

    def abort(self, cause: str | None = "client_disconnected") -> None:
        """Abort the requests not done, once. cause: the abort counter's (a client that left, counted as
        SGLang counts aborts); None for no client's doing (a failed stream, counted as an internal error)."""
        if self._aborted:
            return
        self._aborted = True
        aborted = sum(self.ctx.manager.abort(s.rid) and s.log_metrics for s in self.states if not s.done)
        if cause is not None:
            self.ctx.metrics.count_aborts(aborted, cause)

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


def event_stream(sub: Submission, events: AsyncIterator[bytes]) -> StreamingResponse:
    """The answer of every stream: events (ending with [DONE]) as server-sent events."""
    return StreamingResponse(guarded_events(sub, events), media_type="text/event-stream")


async def guarded_events(sub: Submission, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """events, or once the 200 is sent and something fails: the call's requests aborted, the bug
    logged and counted as an internal error, and the stream ended as a failed request ends it
    (an error event, then [DONE]), never cut off."""
    try:
        async for event in events:
            yield event
    except Exception as e:  # noqa: BLE001 - a bug after the 200: logged, answered in the stream, survived
        logger.exception("internal error in a stream")
        sub.abort(cause=None)
        yield sse(error_body(counted(sub.ctx, internal_error(e))))
        yield SSE_DONE


def body_schema(name: str) -> dict[str, Any]:
    """openapi_extra for a route whose JSON body is the named struct (see http_server.install_openapi)."""
    ref = {"$ref": f"#/components/schemas/{name}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}
