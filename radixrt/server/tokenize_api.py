"""SGLang's tokenizer routes: POST /tokenize and /detokenize (and their /v1/ names).

/tokenize {prompt, add_special_tokens} answers {tokens, count, max_model_len}: one id list and
its length for a text, a list of each for a list of texts. max_model_len is the served context
length (SGLang reports its tokenizer's model_max_length, often a placeholder of 10^30; the
context is what a prompt must fit, and what /v1/models reports). /detokenize {tokens,
skip_special_tokens} answers {text}: a string for one id list, a list for a list of them.

Both use the served tokenizer, off the event loop, under /generate's bounds: at most
--max-requests-per-call texts or id lists, and no text longer than could fit in the context
(TextBound: a longer one is a 400 before the tokenizer spends seconds on it). Ids outside the
vocabulary are a 400 naming `tokens` (a fast tokenizer would decode them silently as nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request, Response

from radixrt.errors import RequestError
from radixrt.frontend.prompt_checks import check_in_vocabulary
from radixrt.frontend.text_bound import TextBound
from radixrt.server.http_common import (
    ServerContext,
    body_schema,
    json_response,
    read_typed,
)
from radixrt.server.schemas import DetokenizeBody, TokenizeBody


@dataclass(frozen=True)
class TokenizerLimits:
    """What one call may ask of the tokenizer."""

    bound: TextBound  # characters a prompt could have and still fit
    bounded_kv: bool  # a retention policy is on: prompts have no context limit, so no character bound
    max_items: int  # --max-requests-per-call
    vocab_size: int  # the model's: ids at or past it are refused


def add_tokenize_routes(app: FastAPI, ctx: ServerContext) -> None:
    def limits() -> TokenizerLimits:
        door = ctx.intake
        return TokenizerLimits(door.text_bound, ctx.args.retention.active, ctx.http.max_requests_per_call,
                               door.vocab_size)

    @app.post("/tokenize", openapi_extra=body_schema("TokenizeBody"))
    @app.post("/v1/tokenize", openapi_extra=body_schema("TokenizeBody"))
    async def tokenize_route(request: Request) -> Response:
        body: TokenizeBody = await read_typed(ctx, request, TokenizeBody)
        answer = await ctx.intake.run_off_loop(tokenize, ctx.manager.tokenizer, body, limits())
        return json_response({**answer, "max_model_len": ctx.intake.context_length})

    @app.post("/detokenize", openapi_extra=body_schema("DetokenizeBody"))
    @app.post("/v1/detokenize", openapi_extra=body_schema("DetokenizeBody"))
    async def detokenize_route(request: Request) -> Response:
        body: DetokenizeBody = await read_typed(ctx, request, DetokenizeBody)
        return json_response(await ctx.intake.run_off_loop(detokenize, ctx.manager.tokenizer, body, limits()))


def tokenize(tokenizer: Any, body: TokenizeBody, limits: TokenizerLimits) -> dict[str, Any]:
    """{tokens, count}: for a text, its ids and their number; for a list, a list of each."""
    texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    _check_items(len(texts), limits.max_items, "prompt")
    for text in texts:  # all checked before any is encoded
        limits.bound.fit(text, limits.bounded_kv, False, "prompt")
    ids = [tokenizer.encode(t, add_special_tokens=body.add_special_tokens) for t in texts]
    if isinstance(body.prompt, str):
        return {"tokens": ids[0], "count": len(ids[0])}
    return {"tokens": ids, "count": [len(x) for x in ids]}


def detokenize(tokenizer: Any, body: DetokenizeBody, limits: TokenizerLimits) -> dict[str, Any]:
    """{text}: one id list decoded, or each of a list of them; an empty list is ""."""
    tokens = body.tokens
    nested = bool(tokens) and isinstance(tokens[0], list)
    if any(isinstance(t, list) != nested for t in tokens):
        raise RequestError("tokens must be a list of token ids or a list of such lists, not a mix", "tokens")
    lists: list[list[int]] = tokens if nested else [tokens]  # type: ignore[assignment]
    _check_items(len(lists), limits.max_items, "tokens")
    for ids in lists:
        check_in_vocabulary(ids, limits.vocab_size, "tokens")
    texts = [tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens) for ids in lists]
    return {"text": texts if nested else texts[0]}


def _check_items(n: int, most: int, field: str) -> None:
    if n > most:
        raise RequestError(f"{field} has {n} items; this server allows at most {most} per call "
                           "(--max-requests-per-call)", field)
