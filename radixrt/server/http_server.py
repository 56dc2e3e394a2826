"""The HTTP front door: SGLang's native API, /metrics, API keys, and errors.

Every handler reads its body under --max-request-bytes, decodes it into a
typed struct (radixrt/server/schemas.py), submits through the
TokenizerManager (tokenizing off the event loop) and awaits its requests on
the event loop (the manager's receiving thread wakes it). A client that goes
away aborts its requests, so their pages come back. OpenAI routes live in
openai_api.py and use the same pieces.

Errors: a RequestError (the client's mistake) is a 400 naming the field; a
request that failed in the backend is its status (500 our bug, 503 the backend
is gone or shutting down), as an error event once a stream has started; any
other exception is a 500 with its traceback logged, never a dead server.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Callable

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from radixrt.config import ServerArgs
from radixrt.errors import RequestError
from radixrt.frontend.generate_input import GenerateInput, GenerateRequest
from radixrt.frontend.req_state import ReqState
from radixrt.frontend.tokenizer_manager import BackendDied, TokenizerManager
from radixrt.server.metrics import ServerMetrics
from radixrt.server.schemas import AbortBody, decode_body, openapi_schemas

logger = logging.getLogger(__name__)
DISCONNECT_POLL_S = 1.0
OPEN_PREFIXES = ("/health", "/metrics")  # probes and scrapers need no key (as in SGLang)
ADMIN_PATHS = ("/abort_request", "/flush_cache")  # SGLang's ADMIN_OPTIONAL routes
SECRET_ARGS = ("api_key", "admin_api_key")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type


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
                    type="invalid_request_error" if f.status_code < 500 else "server_error")


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
    return ApiError(413, f"the request body is larger than {limit} bytes (--max-request-bytes)")


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
        for s in self.states:
            if not s.done:
                self.ctx.manager.abort(s.rid)

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


def bearer_matches(header: str | None, key: str) -> bool:
    """'Authorization: Bearer <key>', the scheme in any case, compared in constant time."""
    scheme, _, token = (header or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def required_key(path: str, args: ServerArgs) -> str | None:
    """SGLang's auth levels: health and metrics are open; admin routes take admin_api_key when
    set, else api_key; every other route takes api_key (when set)."""
    if path.startswith(OPEN_PREFIXES):
        return None
    if path in ADMIN_PATHS:
        return args.admin_api_key or args.api_key
    return args.api_key


def create_app(ctx: ServerContext) -> FastAPI:
    app = FastAPI(title="radixrt", version=ctx.version)
    app.state.ctx = ctx

    @app.middleware("http")
    async def guard(request: Request, call_next):
        key = required_key(request.url.path, ctx.args)
        if key and not bearer_matches(request.headers.get("authorization"), key):
            return error_response(ApiError(401, "invalid or missing API key", type="authentication_error"))
        try:
            return await call_next(request)
        except ApiError as e:
            return error_response(e)
        except RequestError as e:
            return error_response(ApiError(e.status, e.message, e.param))
        except BackendDied as e:
            return error_response(ApiError(503, f"the backend died: {e}", type="server_error"))
        except TimeoutError as e:
            return error_response(ApiError(503, str(e), type="server_error"))
        except Exception as e:  # noqa: BLE001 - a bug: logged with its traceback, answered, survived
            logger.exception("internal error on %s %s", request.method, request.url.path)
            return error_response(ApiError(500, f"internal server error ({type(e).__name__}); see the server log",
                                           type="server_error"))

    add_native_routes(app, ctx)
    from radixrt.server.openai_api import add_openai_routes

    add_openai_routes(app, ctx)
    install_openapi(app)
    return app


def body_schema(name: str) -> dict[str, Any]:
    """openapi_extra for a route whose JSON body is the named struct (see install_openapi)."""
    ref = {"$ref": f"#/components/schemas/{name}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def install_openapi(app: FastAPI) -> None:
    """Publish the typed request bodies in /openapi.json (routes read raw bodies, so FastAPI
    cannot infer them); generated once from the same structs the routes decode into."""
    default = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = default()
            _, components = openapi_schemas()
            spec.setdefault("components", {}).setdefault("schemas", {}).update(components)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def add_native_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/generate", openapi_extra=body_schema("GenerateRequest"))
    async def generate(request: Request) -> Response:
        req: GenerateRequest = await read_typed(ctx, request, GenerateRequest)
        gen = await generate_input(ctx, req)
        if req.stream and len(gen.items) != 1:
            raise ApiError(400, "stream takes a single prompt and n=1", param="stream")
        sub = await Submission.start(ctx, gen)
        if req.stream:
            return StreamingResponse(_native_stream(sub), media_type="text/event-stream")
        if not await sub.wait(request):
            return error_response(ApiError(499, "client closed the request"))
        sub.check()
        results = sub.results()
        return json_response(results if gen.is_batch or len(results) > 1 else results[0])

    @app.get("/health")
    async def health() -> Response:
        why = ctx.unavailable()
        if why:
            return error_response(ApiError(503, why, type="server_error"))
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        sub = await Submission.start(ctx, GenerateInput.build(input_ids=[0], sampling_params={"max_new_tokens": 1}))
        try:
            await asyncio.wait_for(sub.wait(request), 20)
        except asyncio.TimeoutError:
            sub.abort()
            return error_response(ApiError(503, "generation did not answer within 20 s", type="server_error"))
        sub.check()
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> Response:
        return json_response({
            "model_path": ctx.args.model_path,
            "tokenizer_path": ctx.args.tokenizer_path or ctx.args.model_path,
            "served_model_name": ctx.args.model_name,
            "is_generation": True,
        })

    @app.get("/get_server_info")
    @app.get("/server_info")
    def server_info() -> Response:
        info = {k: v for k, v in asdict(ctx.args).items() if k not in SECRET_ARGS}
        info.update(ctx.manager.control("stats").stats, version=ctx.version, context_length=ctx.manager.context_length)
        return json_response(info)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    def flush_cache() -> Response:
        reply = ctx.manager.control("flush_cache")
        if reply.error:
            return error_response(ApiError(400, reply.error))
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/abort_request", openapi_extra=body_schema("AbortBody"))
    async def abort_request(request: Request) -> Response:
        body: AbortBody = await read_typed(ctx, request, AbortBody)
        if body.abort_all:
            ctx.manager.abort_all()
        elif body.rid:
            ctx.manager.abort(body.rid)
        else:
            raise ApiError(400, "abort_request needs a rid (or abort_all: true)", param="rid")
        return Response(status_code=200)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")


async def _native_stream(sub: Submission) -> AsyncIterator[bytes]:
    tokenizer, state = sub.ctx.manager.tokenizer, sub.states[0]
    async for _ in sub.stream():
        if state.error is not None:
            yield sse(error_body(failure(state.error)))
            break
        yield sse(state.result(tokenizer))
    yield SSE_DONE
