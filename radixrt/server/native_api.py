"""SGLang's native API: /generate, the health probes, model and server info, the admin
routes (/flush_cache, /abort_request) and /metrics, built from http_common.py."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from radixrt.frontend.generate_input import GenerateInput, GenerateRequest
from radixrt.server.http_common import (
    SSE_DONE, ApiError, ServerContext, Submission, body_schema, error_body, error_response, failure, generate_input,
    json_response, read_typed, sse
)
from radixrt.server.schemas import AbortBody

SECRET_ARGS = ("api_key", "admin_api_key")  # left out of /server_info


def add_native_routes(app: FastAPI, ctx: ServerContext) -> None:
    _add_generate(app, ctx)
    _add_health(app, ctx)
    _add_info(app, ctx)
    _add_admin(app, ctx)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")


def _add_generate(app: FastAPI, ctx: ServerContext) -> None:
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


def _add_health(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/health")
    async def health() -> Response:
        why = ctx.unavailable()
        if why:
            return error_response(ApiError(503, why, type="server_error"))
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        probe = GenerateInput.build(input_ids=[0], sampling_params={"max_new_tokens": 1}, log_metrics=False)
        sub = await Submission.start(ctx, probe)
        try:
            await asyncio.wait_for(sub.wait(request), 20)
        except asyncio.TimeoutError:
            sub.abort()
            return error_response(ApiError(503, "generation did not answer within 20 s", type="server_error"))
        sub.check()
        return Response(status_code=200)


def _add_info(app: FastAPI, ctx: ServerContext) -> None:
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
        info.update(ctx.manager.stats(), version=ctx.version, context_length=ctx.manager.context_length)
        return json_response(info)


def _add_admin(app: FastAPI, ctx: ServerContext) -> None:
    @app.api_route("/flush_cache", methods=["GET", "POST"])
    def flush_cache() -> Response:
        reply = ctx.manager.flush_cache()
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


async def _native_stream(sub: Submission) -> AsyncIterator[bytes]:
    tokenizer, state = sub.ctx.manager.tokenizer, sub.states[0]
    async for _ in sub.stream():
        if state.error is not None:
            yield sse(error_body(failure(state.error)))
            break
        yield sse(state.result(tokenizer))
    yield SSE_DONE
