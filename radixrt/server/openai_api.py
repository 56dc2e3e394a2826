"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions.

Requests are translated into the native GenerateInput (OpenAI names mapped to
SGLang's; SGLang's extra sampling fields accepted as SGLang does), and results
into OpenAI's response and stream-chunk shapes. Errors use OpenAI's body.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from radixrt.frontend.generate_input import GenerateInput
from radixrt.frontend.req_state import ReqState
from radixrt.server.http_server import SSE_DONE, ApiError, ServerContext, Submission, json_response, read_json, sse

# OpenAI request field -> sampling_params field
SAMPLING_FIELDS = {
    "max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "temperature": "temperature",
    "top_p": "top_p", "n": "n", "stop": "stop", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "seed": "seed", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "stop_token_ids": "stop_token_ids", "min_tokens": "min_new_tokens",
    "ignore_eos": "ignore_eos", "no_stop_trim": "no_stop_trim", "skip_special_tokens": "skip_special_tokens",
    "regex": "regex", "json_schema": "json_schema", "ebnf": "ebnf",
}
COMMON_FIELDS = {"model", "stream", "stream_options", "user", "logprobs", "cache_salt"} | set(SAMPLING_FIELDS)
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of", "logit_bias"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "top_logprobs", "response_format", "tools", "tool_choice", "logit_bias"}


def add_openai_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/v1/models")
    async def models() -> Response:
        card = {"id": ctx.args.model_name, "object": "model", "created": 0, "owned_by": "radixrt",
                "root": ctx.args.model_path, "max_model_len": ctx.manager.context_length}
        return json_response({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_json(request)
        _check(body, COMPLETION_FIELDS, ctx)
        if body.get("echo") or body.get("suffix") or (body.get("best_of") or 1) > 1 or body.get("logit_bias"):
            raise ApiError(400, "echo, suffix, best_of and logit_bias are not supported", param="echo")
        prompt = body.get("prompt")
        if prompt is None:
            raise ApiError(400, "prompt is required", param="prompt")
        top = body.get("logprobs")
        text, ids = _split_prompt(prompt)
        gen = _build(body, text, ids, return_logprob=top is not None, top_logprobs=top or 0)
        return await _respond(ctx, request, body, gen, _completion_view)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await read_json(request)
        _check(body, CHAT_FIELDS, ctx)
        if body.get("tools") or body.get("logit_bias") or (body.get("response_format") or {}).get("type", "text") != "text":
            raise ApiError(400, "tools, logit_bias and response_format are not supported", param="tools")
        ids = _chat_ids(ctx, body.get("messages"))
        gen = _build(body, None, ids, return_logprob=bool(body.get("logprobs")), top_logprobs=body.get("top_logprobs") or 0)
        return await _respond(ctx, request, body, gen, _chat_view)


def _check(body: dict[str, Any], allowed: set[str], ctx: ServerContext) -> None:
    unknown = [k for k, v in body.items() if k not in allowed and v is not None]
    if unknown:
        raise ApiError(400, f"unknown or unsupported field {unknown[0]!r}", param=unknown[0])
    model = body.get("model")
    if model is not None and model not in (ctx.args.model_name, ctx.args.model_path):
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {ctx.args.model_name!r}",
                       param="model", type="model_not_found")
    if not isinstance(body.get("stream", False), bool):
        raise ApiError(400, "stream must be a boolean", param="stream")


def _split_prompt(prompt: Any) -> tuple[Any, Any]:
    """OpenAI prompts: a string, a list of strings, a token list, or a list of token lists."""
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return None, prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, list) for t in prompt):
        return None, prompt
    return prompt, None


def _chat_ids(ctx: ServerContext, messages: Any) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    flat = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise ApiError(400, "each message needs a role of system, user or assistant", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise ApiError(400, "only text content parts are supported", param="messages")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise ApiError(400, "message content must be a string or text parts", param="messages")
        flat.append({"role": m["role"], "content": content})
    tokenizer = ctx.manager.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
    return list(tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=True, return_dict=False))


def _build(body: dict[str, Any], text: Any, ids: Any, return_logprob: bool, top_logprobs: int) -> GenerateInput:
    sampling = {SAMPLING_FIELDS[k]: v for k, v in body.items() if k in SAMPLING_FIELDS and v is not None}
    sampling.setdefault("max_new_tokens", 16 if "prompt" in body else 128)
    if not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= 20:
        raise ApiError(400, "logprobs / top_logprobs must be an integer in [0, 20]", param="logprobs")
    return GenerateInput.build(text, ids, sampling, None, return_logprob, None, top_logprobs, True, body.get("cache_salt"))


def _finish_reason(state: ReqState) -> str | None:
    f = state.finish
    if f is None:
        return None
    return {"stop": "stop", "length": "length"}.get(f.type, "abort")


def _usage(states: list[ReqState]) -> dict[str, Any]:
    # Parallel samples share one prompt: count it once per distinct prompt, as OpenAI does.
    prompts = {id(s.prompt_ids): s for s in states}
    prompt = sum(len(s.prompt_ids) for s in prompts.values())
    completion = sum(len(s.output_ids) for s in states)
    cached = sum(s.cached_tokens for s in prompts.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _completion_view(tokenizer: Any, state: ReqState, index: int, text: str, logprobs: bool) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": _finish_reason(state)}
    if logprobs:
        lp = state.result(tokenizer)["meta_info"]
        tokens = [t[2] for t in lp["output_token_logprobs"]]
        choice["logprobs"] = {
            "tokens": tokens,
            "token_logprobs": [t[0] for t in lp["output_token_logprobs"]],
            "top_logprobs": [{t[2]: t[0] for t in row} for row in lp["output_top_logprobs"]],
            "text_offset": [sum(len(x) for x in tokens[:i]) for i in range(len(tokens))],
        }
    return choice


def _chat_view(tokenizer: Any, state: ReqState, index: int, text: str, logprobs: bool) -> dict[str, Any]:
    choice = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
              "finish_reason": _finish_reason(state)}
    if logprobs:
        lp = state.result(tokenizer)["meta_info"]
        tops = lp["output_top_logprobs"] or [[] for _ in lp["output_token_logprobs"]]
        choice["logprobs"] = {"content": [
            {"token": t[2], "logprob": t[0], "bytes": list(t[2].encode()),
             "top_logprobs": [{"token": x[2], "logprob": x[0], "bytes": list(x[2].encode())} for x in top]}
            for t, top in zip(lp["output_token_logprobs"], tops)
        ]}
    return choice


async def _respond(ctx: ServerContext, request: Request, body: dict[str, Any], gen: GenerateInput, view) -> Response:
    sub = Submission(ctx, gen)
    chat = view is _chat_view
    meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": ctx.args.model_name}
    logprobs = bool(body.get("logprobs"))
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_stream(sub, meta, chat, logprobs, include_usage), media_type="text/event-stream")
    if not await sub.wait(request):
        raise ApiError(499, "client closed the request")
    tok = ctx.manager.tokenizer
    choices = [view(tok, s, i, s.result(tok)["text"], logprobs) for i, s in enumerate(sub.states)]
    obj = "chat.completion" if chat else "text_completion"
    return json_response({**meta, "object": obj, "choices": choices, "usage": _usage(sub.states)})


async def _stream(sub: Submission, meta: dict[str, Any], chat: bool, logprobs: bool, include_usage: bool) -> AsyncIterator[bytes]:
    tok = sub.ctx.manager.tokenizer
    obj = "chat.completion.chunk" if chat else "text_completion"
    sent = [""] * len(sub.states)
    finished = [False] * len(sub.states)
    if chat:
        for i in range(len(sub.states)):
            yield sse({**meta, "object": obj, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    async for _ in sub.stream():
        for i, s in enumerate(sub.states):
            text = s.result(tok)["text"]
            delta, done = text[len(sent[i]) :], s.done and not finished[i]
            if not delta and not done:
                continue
            sent[i], finished[i] = text, s.done
            reason = _finish_reason(s) if s.done else None
            choice = {"index": i, "delta": {"content": delta}, "finish_reason": reason} if chat else \
                     {"index": i, "text": delta, "logprobs": None, "finish_reason": reason}
            yield sse({**meta, "object": obj, "choices": [choice]})
    if include_usage:
        yield sse({**meta, "object": obj, "choices": [], "usage": _usage(sub.states)})
    yield SSE_DONE
