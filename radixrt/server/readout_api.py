"""The prefill-only routes: SGLang's /encode, OpenAI's /v1/embeddings, SGLang's /v1/score and
/v1/rerank (frontend/readout_calls.py builds their requests, frontend/rerank.py chooses how a
document is scored). They run through the same door, cache and batches as /generate; the
generating server serves them too (SGLang needs an --is-embedding server for embeddings), and an
--is-embedding server serves embeddings and a cross-encoder's reranking only."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from radixrt.frontend.prompt_checks import check_in_vocabulary
from radixrt.frontend.readout_calls import (
    Prompt,
    check_encoding_format,
    embedding,
    embedding_prompts,
    encode_prompts,
    encode_results,
    encode_vector,
    label_scores,
    readout_input,
    readout_meta,
    readout_values,
    score_prompts,
)
from radixrt.frontend.req_state import ReqState
from radixrt.frontend.rerank import (
    content_text,
    is_reranker_template,
    ranked,
    relevance,
    render_prompts,
    yes_no_ids,
)
from radixrt.messages import Readout
from radixrt.sampling_params import refuse_unsupported
from radixrt.server.chat_templates import named_template
from radixrt.server.http_common import (
    ApiError,
    ServerContext,
    Submission,
    body_schema,
    counted,
    json_response,
    prepare,
    read_typed,
)
from radixrt.server.readout_schemas import (
    ENCODE_UNSUPPORTED,
    EmbeddingRequest,
    EncodeRequest,
    RerankRequest,
    ScoringRequest,
)

# What an --is-embedding server refuses (SGLang's embedding server cannot generate)
GENERATING_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/score")


def add_readout_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.api_route("/encode", methods=["POST", "PUT"], openapi_extra=body_schema("EncodeRequest"))
    async def encode(request: Request) -> Response:
        body: EncodeRequest = await read_typed(ctx, request, EncodeRequest)
        refuse_unsupported(body, ENCODE_UNSUPPORTED)
        if body.is_cross_encoder_request:
            return await _cross_encode(ctx, request, body)
        prompts, is_batch = encode_prompts(body.text, body.input_ids)
        states = await _embed(ctx, request, prompts, is_batch, body.dimensions, body.rid, body.priority, body.log_metrics)
        out = encode_results(states, ctx.intake.pooler, body.dimensions)
        return json_response(out if is_batch else out[0])

    @app.post("/v1/embeddings", openapi_extra=body_schema("EmbeddingRequest"))
    async def embeddings(request: Request) -> Response:
        body: EmbeddingRequest = await read_typed(ctx, request, EmbeddingRequest)
        check_encoding_format(body.encoding_format)
        if body.lora_path is not None:
            raise ApiError(400, "embeddings run the base model: lora_path must be null", param="lora_path")
        prompts, is_batch = embedding_prompts(body.input)
        states = await _embed(ctx, request, prompts, is_batch, body.dimensions, body.rid, body.priority)
        pooler = ctx.intake.pooler
        data = [{"object": "embedding", "index": i,
                 "embedding": encode_vector(embedding(s, pooler, body.dimensions), body.encoding_format)}
                for i, s in enumerate(states)]
        return json_response({"object": "list", "data": data, "model": ctx.args.model_name, "usage": _usage(states)})

    @app.post("/v1/score", openapi_extra=body_schema("ScoringRequest"))
    async def score(request: Request) -> Response:
        body: ScoringRequest = await read_typed(ctx, request, ScoringRequest)
        if body.label_token_ids is None:
            raise ApiError(400, "label_token_ids must be provided", param="label_token_ids")
        check_in_vocabulary(body.label_token_ids, ctx.intake.vocab_size, "label_token_ids")
        prompts = score_prompts(body.query, body.items, body.item_first)
        states = await _run(ctx, request, prompts, Readout("labels", list(body.label_token_ids)), True)
        scores = [label_scores(s, body.apply_softmax) for s in states]
        return json_response({"scores": scores, "model": body.model or ctx.args.model_name, "usage": _usage(states),
                              "object": "scoring"})

    @app.api_route("/v1/rerank", methods=["POST", "PUT"], openapi_extra=body_schema("RerankRequest"))
    async def rerank(request: Request) -> Response:
        body: RerankRequest = await read_typed(ctx, request, RerankRequest)
        if body.top_n is not None and body.top_n < 1:
            raise ApiError(400, "top_n must be larger than 0", param="top_n")
        if not body.documents:
            raise ApiError(400, "documents cannot be empty", param="documents")
        query = content_text(body.query, "query")
        docs = [content_text(d, "documents") for d in body.documents]
        scores, metas = await _rerank_scores(ctx, request, query, docs, body.instruct)
        return json_response(ranked(scores, docs, body.top_n, body.return_documents, metas))


def refuse_generation(ctx: ServerContext, path: str) -> ApiError | None:
    """On an --is-embedding server, the error of a route that generates (None: any other)."""
    if ctx.args.is_embedding and path in GENERATING_PATHS:
        return ApiError(400, f"this server was launched with --is-embedding: it serves /encode, /v1/embeddings and "
                             f"/v1/rerank, not {path}", cause="is_embedding")
    return None


async def _rerank_scores(ctx: ServerContext, request: Request, query: str, docs: list[str],
                         instruct: str | None) -> tuple[list[float], list[dict[str, Any]] | None]:
    template = _chat_template(ctx)
    if is_reranker_template(template):
        if ctx.args.is_embedding:
            raise ApiError(400, "this reranker's chat template asks for yes/no, which needs a generating server: "
                                "launch it without --is-embedding", param="query")
        yes, no = yes_no_ids(ctx.manager.tokenizer)
        prompts: list[Prompt] = [(p, None) for p in render_prompts(template or "", query, docs, instruct)]
        states = await _run(ctx, request, prompts, Readout("labels", [yes, no]), True)
        return [relevance(*label_scores(s, False)) for s in states], None
    if ctx.intake.pooler.head_labels:
        pairs = await ctx.intake.run_off_loop(_pairs, ctx, [[query, d] for d in docs])
        states = await _run(ctx, request, pairs, Readout("head"), True)
        return [_head_score(s) for s in states], [readout_meta(s) for s in states]
    raise ApiError(400, "this model cannot rerank: it has neither a reranker chat template (one asking for \"yes\" or "
                        "\"no\", as Qwen3-Reranker's; --chat-template sets one) nor a classification head "
                        "(a ...ForSequenceClassification checkpoint)", param="query")


async def _cross_encode(ctx: ServerContext, request: Request, body: EncodeRequest) -> Response:
    """/encode's is_cross_encoder_request: [query, document] pairs through the classification head."""
    if not ctx.intake.pooler.head_labels:
        raise ApiError(400, "is_cross_encoder_request needs a checkpoint with a classification head "
                            "(a ...ForSequenceClassification)", param="is_cross_encoder_request")
    text = body.text
    if not isinstance(text, list) or not text or not all(isinstance(p, list) and len(p) == 2 for p in text):
        raise ApiError(400, "a cross-encoder request's text is a list of [query, document] pairs", param="text")
    pairs = await ctx.intake.run_off_loop(_pairs, ctx, text)
    states = await _run(ctx, request, pairs, Readout("head"), True, body.rid, body.priority)
    return json_response([{"embedding": readout_values(s).tolist(), "meta_info": readout_meta(s)} for s in states])


def _pairs(ctx: ServerContext, pairs: list[list[str]]) -> list[Prompt]:
    """Each pair as the tokenizer encodes a text pair (its separators), as SGLang's cross-encoder reads it."""
    tok = ctx.manager.tokenizer
    return [(None, list(tok(q, d, add_special_tokens=True)["input_ids"])) for q, d in pairs]


def _head_score(s: ReqState) -> float:
    return float(readout_values(s)[0])  # SGLang's: a reranker head's first output (its activation: identity)


async def _embed(ctx: ServerContext, request: Request, prompts: list[Prompt], is_batch: bool, dimensions: int | None,
                 rid: Any, priority: int | None, log_metrics: bool = True) -> list[ReqState]:
    try:
        ctx.intake.pooler.check_dimensions(dimensions)
    except ValueError as e:
        raise ApiError(400, str(e), param="dimensions") from None
    return await _run(ctx, request, prompts, Readout(ctx.intake.pooler.kind), is_batch, rid, priority, log_metrics)


async def _run(ctx: ServerContext, request: Request, prompts: list[Prompt], readout: Readout, is_batch: bool,
               rid: Any = None, priority: int | None = None, log_metrics: bool = True) -> list[ReqState]:
    """Send the prompts as prefill-only requests of one call (the caller's tenant's) and await them."""
    if len(prompts) > ctx.http.max_requests_per_call:
        raise ApiError(400, f"at most {ctx.http.max_requests_per_call} inputs per call (--max-requests-per-call)",
                       param="input")
    gen = readout_input(prompts, readout, is_batch=is_batch, rid=rid, priority=priority, log_metrics=log_metrics)
    # a score's query, a reranker's template: prefilled once first, unless every row is needed anyway
    sub = await Submission.start(ctx, await prepare(ctx, gen, request, share_prefix=not readout.whole_prompt))
    if not await sub.wait(request):
        raise counted(ctx, ApiError(499, "client closed the request", cause="client_closed"))
    sub.check()
    return sub.states


def _usage(states: list[ReqState]) -> dict[str, Any]:
    prompt = sum(len(s.prompt_ids) for s in states)
    return {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt,
            "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in states)}}


def _chat_template(ctx: ServerContext) -> str | None:
    """The template a reranker is recognised by: --chat-template's file, else the tokenizer's own."""
    path = ctx.args.chat_template
    if path and named_template(path) is None:  # a file (a name is one of SGLang's conversation templates)
        with open(path, encoding="utf-8") as f:
            return f.read()
    return getattr(ctx.manager.tokenizer, "chat_template", None)

