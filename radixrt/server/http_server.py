"""The HTTP front door: SGLang's native API, /metrics, the API key, and errors.

Every handler validates, submits through the TokenizerManager, and awaits its
requests on the event loop (the manager's receiving thread wakes it). A client
that goes away aborts its requests, so their pages come back. OpenAI routes
live in openai_api.py and use the same pieces.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import asdict, dataclass
from typing import Any, AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from radixrt.config import ServerArgs
from radixrt.frontend.generate_input import GenerateInput
from radixrt.frontend.tokenizer_manager import BackendDied, TokenizerManager
from radixrt.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)
DISCONNECT_POLL_S = 1.0
# /generate fields we honour, and SGLang fields we cannot honour yet (an error, never ignored)
GENERATE_FIELDS = {
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "return_text_in_logprobs", "stream", "cache_salt", "extra_key", "log_metrics",
}
UNSUPPORTED_FIELDS = {"image_data", "video_data", "audio_data", "input_embeds", "lora_path", "session_params",
                      "custom_logit_processor", "return_hidden_states", "token_ids_logprob"}


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
    dead: str | None = None  # why the backend is gone, once it is


def json_response(data: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(data), status_code=status, media_type="application/json")


def error_response(err: ApiError) -> Response:
    body = {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.status}}
    return json_response(body, err.status)


async def read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else {}
    except ValueError as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the JSON body must be an object, got {type(body).__name__}")
    return body


class Submission:
    """The requests of one HTTP call, awaited on the event loop."""

    def __init__(self, ctx: ServerContext, gen: GenerateInput) -> None:
        if ctx.dead:
            raise ApiError(503, f"the server is shutting down: {ctx.dead}", type="server_error")
        loop = asyncio.get_running_loop()
        self.ctx, self.updates = ctx, asyncio.Queue()
        self.states = ctx.manager.submit_all(gen, lambda: loop.call_soon_threadsafe(self.updates.put_nowait, None))

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

    def results(self) -> list[dict[str, Any]]:
        return [s.result(self.ctx.manager.tokenizer) for s in self.states]


def sse(data: Any) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def create_app(ctx: ServerContext) -> FastAPI:
    app = FastAPI(title="radixrt", version=ctx.version)
    app.state.ctx = ctx

    @app.middleware("http")
    async def guard(request: Request, call_next):
        key = ctx.args.api_key
        if key and request.url.path != "/health" and request.headers.get("authorization") != f"Bearer {key}":
            return error_response(ApiError(401, "invalid or missing API key", type="authentication_error"))
        try:
            return await call_next(request)
        except ApiError as e:
            return error_response(e)
        except ValueError as e:
            return error_response(ApiError(400, str(e), param=_field_of(str(e))))
        except BackendDied as e:
            return error_response(ApiError(503, f"the backend died: {e}", type="server_error"))

    add_native_routes(app, ctx)
    from radixrt.server.openai_api import add_openai_routes

    add_openai_routes(app, ctx)
    return app


def add_native_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await read_json(request)
        gen, stream = parse_generate(body)
        sub = Submission(ctx, gen)
        if stream:
            return StreamingResponse(_native_stream(sub), media_type="text/event-stream")
        if not await sub.wait(request):
            return error_response(ApiError(499, "client closed the request"))
        results = sub.results()
        return json_response(results if gen.is_batch or len(results) > 1 else results[0])

    @app.get("/health")
    async def health() -> Response:
        if ctx.dead:
            return error_response(ApiError(503, ctx.dead, type="server_error"))
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        sub = Submission(ctx, GenerateInput.build(input_ids=[0], sampling_params={"max_new_tokens": 1}))
        try:
            await asyncio.wait_for(sub.wait(request), 20)
        except asyncio.TimeoutError:
            sub.abort()
            return error_response(ApiError(503, "generation did not answer within 20 s", type="server_error"))
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
        info = asdict(ctx.args)
        info.pop("api_key", None)
        info.update(ctx.manager.control("stats").stats, version=ctx.version, context_length=ctx.manager.context_length)
        return json_response(info)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    def flush_cache() -> Response:
        reply = ctx.manager.control("flush_cache")
        if reply.error:
            return error_response(ApiError(400, reply.error))
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        rid = (await read_json(request)).get("rid")
        if not isinstance(rid, str):
            raise ApiError(400, "abort_request needs a string rid", param="rid")
        ctx.manager.abort(rid)
        return Response(status_code=200)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")


def _field_of(message: str) -> str | None:
    """The field a validation message names ("sampling_params.top_p must be ...")."""
    m = re.match(r"sampling_params[.:] ?(\w+)", message)
    return m.group(1) if m else None


def parse_generate(body: dict[str, Any]) -> tuple[GenerateInput, bool]:
    for key, value in body.items():
        if value is None:
            continue
        if key in UNSUPPORTED_FIELDS:
            raise ApiError(400, f"{key} is not supported by this server", param=key)
        if key not in GENERATE_FIELDS:
            raise ApiError(400, f"unknown field {key!r}", param=key)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", param="stream")
    for key, kinds in (("return_logprob", (bool, list)), ("logprob_start_len", (int, list)), ("top_logprobs_num", (int, list))):
        value = body.get(key)
        if value is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
            raise ApiError(400, f"{key} has the wrong type ({type(value).__name__})", param=key)
    gen = GenerateInput.build(
        body.get("text"), body.get("input_ids"), body.get("sampling_params"), body.get("rid"),
        body.get("return_logprob") or False, body.get("logprob_start_len"), body.get("top_logprobs_num"),
        bool(body.get("return_text_in_logprobs")), body.get("cache_salt") or body.get("extra_key"),
    )
    if stream and len(gen.items) != 1:
        raise ApiError(400, "stream takes a single prompt and n=1", param="stream")
    return gen, stream


async def _native_stream(sub: Submission) -> AsyncIterator[bytes]:
    tokenizer, state = sub.ctx.manager.tokenizer, sub.states[0]
    async for _ in sub.stream():
        if state.finish is not None and state.finish.type == "abort" and sub.ctx.manager.dead:
            yield sse({"error": {"message": state.finish.message}})
            break
        yield sse(state.result(tokenizer))
    yield SSE_DONE
