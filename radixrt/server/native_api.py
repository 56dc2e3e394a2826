"""SGLang's native API: /generate, the health probes, model and server info, the admin
routes (/flush_cache, /abort_request), /separate_reasoning and /metrics, built from http_common.py."""

from __future__ import annotations

from dataclasses import asdict
from typing import AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from radixrt.frontend.cache_report import CACHE_REPORT_FIRST_N, adapters_section, memory_section, tenants_section
from radixrt.frontend.generate_input import GenerateRequest
from radixrt.frontend.weights import check_update_options, model_info
from radixrt.model_source import resolve_update_path
from radixrt.reasoning import get_format, separate
from radixrt.server.access import cache_report_scope
from radixrt.server.health_probe import HealthProbe
from radixrt.server.http_common import (
    SSE_DONE, ApiError, ServerContext, Submission, body_schema, counted, error_body, error_response, event_stream,
    failure, json_response, prepare, read_typed, sse
)
from radixrt.server.schemas import UPDATE_CALL_FIELDS, AbortBody, SeparateReasoningBody, UpdateWeightsBody

SECRET_ARGS = ("api_key", "admin_api_key")  # left out of /server_info


def add_native_routes(app: FastAPI, ctx: ServerContext) -> None:
    _add_generate(app, ctx)
    _add_health(app, ctx)
    _add_info(app, ctx)
    _add_admin(app, ctx)
    _add_cache_report(app, ctx)
    _add_separate_reasoning(app, ctx)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")


def _add_generate(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/generate", openapi_extra=body_schema("GenerateRequest"))
    async def generate(request: Request) -> Response:
        req: GenerateRequest = await read_typed(ctx, request, GenerateRequest)
        call = await prepare(ctx, req, request)
        if req.stream and len(call.reqs) != 1:
            raise ApiError(400, "stream takes a single prompt and n=1", param="stream")
        sub = await Submission.start(ctx, call)
        if req.stream:
            return event_stream(sub, _native_stream(sub))
        if not await sub.wait(request):
            return error_response(counted(ctx, ApiError(499, "client closed the request", cause="client_closed")))
        sub.check()
        results = sub.results()
        return json_response(results if call.is_batch or len(results) > 1 else results[0])


def _add_separate_reasoning(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/separate_reasoning", openapi_extra=body_schema("SeparateReasoningBody"))
    async def separate_reasoning(request: Request) -> Response:
        """SGLang's: a text split by the named parser (forced as its detector defaults, not per chat request)."""
        body: SeparateReasoningBody = await read_typed(ctx, request, SeparateReasoningBody)
        try:
            fmt = get_format(body.reasoning_parser)
        except ValueError as e:
            raise ApiError(400, str(e), param="reasoning_parser") from None
        parts = separate(body.text, fmt)
        return json_response({"reasoning_text": parts.reasoning, "text": parts.content})


def _add_health(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/health")
    async def health() -> Response:
        why = ctx.unavailable()
        if why:
            return error_response(ApiError(503, why, type="server_error"))
        return Response(status_code=200)

    probe = HealthProbe(ctx)  # single-flight, its answer reused for a second: an open route is no load source

    @app.get("/health_generate")
    async def health_generate() -> Response:
        why = await probe.check()
        if why is not None:
            raise ApiError(why.status, why.message, why.param, why.type, why.cause)  # each caller its own error
        return Response(status_code=200)


def _add_info(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info() -> Response:
        return json_response(model_info(ctx.args, ctx.manager.weights))

    @app.get("/get_server_info")
    @app.get("/server_info")
    def server_info() -> Response:
        info = {k: v for k, v in asdict(ctx.args).items() if k not in SECRET_ARGS}
        info.update(ctx.manager.stats().info(), **ctx.manager.worker_info, version=ctx.version,
                    context_length=ctx.intake.context_length,
                    model_path=ctx.manager.weights.model_path, weight_version=ctx.manager.weights.version)
        return json_response(info)


def _add_admin(app: FastAPI, ctx: ServerContext) -> None:
    @app.api_route("/flush_cache", methods=["GET", "POST"])
    def flush_cache() -> Response:
        reply = ctx.manager.flush_cache()
        if reply.error:
            return error_response(counted(ctx, ApiError(400, reply.error, cause="flush_cache")))
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/update_weights_from_disk", openapi_extra=body_schema("UpdateWeightsBody"))
    async def update_weights_from_disk(request: Request) -> Response:
        body: UpdateWeightsBody = await read_typed(ctx, request, UpdateWeightsBody)
        options = {f: getattr(body, f) for f in body.__struct_fields__ if f not in UPDATE_CALL_FIELDS}
        check_update_options(**options)
        local = await ctx.intake.run_off_loop(resolve_update_path, ctx.args, body.model_path)
        result = await ctx.intake.run_off_loop(
            ctx.manager.weight_updates.from_disk, local, body.model_path, body.abort_all_requests, body.weight_version
        )
        return json_response(result._asdict(), 200 if result.success else 400)

    @app.post("/abort_request", openapi_extra=body_schema("AbortBody"))
    async def abort_request(request: Request) -> Response:
        body: AbortBody = await read_typed(ctx, request, AbortBody)
        if body.abort_all:
            ctx.metrics.count_aborts(ctx.manager.abort_all(), "abort_request")
        elif body.rid:
            ctx.metrics.count_aborts(int(ctx.manager.abort(body.rid)), "abort_request")
        else:
            raise ApiError(400, "abort_request needs a rid (or abort_all: true)", param="rid")
        return Response(status_code=200)


def _add_cache_report(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/cache_report")
    def cache_report(request: Request, first_n: int = CACHE_REPORT_FIRST_N, cache_salt: str | None = None,
                     extra_key: str | None = None) -> Response:
        """The caller's namespace (cache_salt / extra_key in the query); every namespace for an admin who
        names none (access.cache_report_scope)."""
        if first_n < 1:
            raise ApiError(400, f"first_n must be >= 1, got {first_n}", param="first_n")
        only = cache_report_scope(ctx.http, request.headers.get("authorization"), cache_salt, extra_key)
        tenant = request.state.tenant  # a tenant's key: its own cache and its own row
        if tenant is not None and only is not None and not tenant.share_cache:
            only = msgspec.structs.replace(only, tenant=tenant.tenant)
        report = ctx.manager.cache_report.report(first_n, only)
        stats = ctx.manager.stats()
        if only is None or not (ctx.http.api_key or ctx.http.admin_api_key or ctx.keys):  # every namespace's figures:
            report["memory"] = memory_section(stats)  # an admin's, or anyone's where all is open
            report["tenants"] = tenants_section(stats)
            report["lora_adapters"] = adapters_section(stats)
        elif tenant is not None:
            report["tenants"] = tenants_section(stats, tenant.tenant)
        return json_response(report)


async def _native_stream(sub: Submission) -> AsyncIterator[bytes]:
    tokenizer, state = sub.ctx.manager.tokenizer, sub.states[0]
    async for _ in sub.stream():
        if state.error is not None:
            yield sse(error_body(counted(sub.ctx, failure(state.error))))
            break
        yield sse(state.result(tokenizer))
    yield SSE_DONE
