"""SGLang's LoRA admin routes: POST /load_lora_adapter and /unload_lora_adapter.

Each answers SGLang's LoRAUpdateOutput ({success, error_message, loaded_adapters}), with
status 200 on success and 400 otherwise; the frontend's LoraDoor does the work off the
event loop.
"""

from __future__ import annotations

import msgspec
from fastapi import FastAPI, Request, Response

from radixrt.messages import LoraUpdateReply
from radixrt.server.http_common import (
    ServerContext,
    body_schema,
    json_response,
    read_typed,
)
from radixrt.server.schemas import LoadLoraAdapterBody, UnloadLoraAdapterBody


def add_lora_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/load_lora_adapter", openapi_extra=body_schema("LoadLoraAdapterBody"))
    async def load_lora_adapter(request: Request) -> Response:
        body: LoadLoraAdapterBody = await read_typed(ctx, request, LoadLoraAdapterBody)
        reply = await ctx.intake.run_off_loop(ctx.manager.lora.load, body.lora_name, body.lora_path, body.pinned)
        return _answer(reply)

    @app.post("/unload_lora_adapter", openapi_extra=body_schema("UnloadLoraAdapterBody"))
    async def unload_lora_adapter(request: Request) -> Response:
        body: UnloadLoraAdapterBody = await read_typed(ctx, request, UnloadLoraAdapterBody)
        return _answer(await ctx.intake.run_off_loop(ctx.manager.lora.unload, body.lora_name))


def _answer(reply: LoraUpdateReply) -> Response:
    body = {f: v for f, v in msgspec.structs.asdict(reply).items() if f != "query_id"}
    return json_response(body, 200 if reply.success else 400)
