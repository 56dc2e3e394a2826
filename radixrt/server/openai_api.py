"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions, and each
request's conversion into the native one.

Bodies decode into the typed structs of schemas.py; OpenAI names are mapped
to SGLang's sampling fields (response_format to the json_schema constraint)
and become the native GenerateRequest, so both APIs share one validation.
Chat tools are rendered by the chat template; tool_choice required or a named
function constrains the output to a call array, and auto parses calls out of
the text with --tool-call-parser (tool_calls.py).
Results take OpenAI's response and stream-chunk shapes (openai_responses.py);
a request that failed in the backend is a 5xx (or an error event once a stream
has started), never a 200 with partial text. Errors use OpenAI's body.

As in SGLang, the `model` field is not checked (the answer names what was
asked for), chat without max_tokens runs until a stop or the context limit,
streamed logprobs come per chunk, and stream_options.continuous_usage_stats
puts the usage so far in every chunk.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from radixrt.errors import RequestError
from radixrt.frontend.generate_input import GenerateRequest
from radixrt.frontend.sampling_defaults import with_defaults
from radixrt.settings.lora import split_model_name
from radixrt.reasoning import thinks
from radixrt.sampling_params import SamplingParamsIn, refuse_unsupported
from radixrt.server.chat_templates import named_template
from radixrt.server.completion_echo import EchoView
from radixrt.server.http_common import ApiError, ServerContext, body_schema, json_response, read_typed
from radixrt.server.nesting import check_template_depths
from radixrt.server.reasoning_chat import reasoning_view
from radixrt.server.schemas import (
    CHAT_UNSUPPORTED, COMPLETION_UNSUPPORTED, RESPONSE_FORMAT_TYPES, ChatCompletionRequest, CompletionRequest,
    OpenAISampling
)
from radixrt.server.openai_responses import ToolChatView, ToolMode, chat_choice, completion_choice, respond

# OpenAI request field -> sampling_params field, where the names differ
RENAMED = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
SAMPLING_FIELDS = (
    "max_tokens", "temperature", "top_p", "n", "stop", "presence_penalty", "frequency_penalty", "seed", "top_k",
    "min_p", "min_tokens", "repetition_penalty", "stop_token_ids", "ignore_eos", "no_stop_trim", "skip_special_tokens",
    "regex", "json_schema", "ebnf", "logit_bias", "stop_regex",
)
COMPLETION_MAX_TOKENS = 16  # OpenAI's (and SGLang's) default for /v1/completions; chat has none
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # SGLang's, in any case
# apply_chat_template's own arguments: chat_template_kwargs passes template variables, not these
TEMPLATE_CALL_ARGS = frozenset({
    "self", "conversation", "conversations", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception", "strftime_now",
})
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object: any JSON object, as in SGLang


def add_openai_routes(app: FastAPI, ctx: ServerContext) -> None:
    _add_models(app, ctx)
    _add_completions(app, ctx)
    _add_chat(app, ctx)


def _add_models(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/v1/models")
    async def models() -> Response:
        card = {"id": ctx.args.model_name, "object": "model", "created": 0, "owned_by": "radixrt",
                "root": ctx.args.model_path, "parent": None, "max_model_len": ctx.intake.context_length}
        return json_response({"object": "list", "data": [card, *ctx.manager.lora.model_cards(ctx.args.model_name)]})


def _add_completions(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/completions", openapi_extra=body_schema("CompletionRequest"))
    async def completions(request: Request) -> Response:
        body: CompletionRequest = await read_typed(ctx, request, CompletionRequest)
        refuse_unsupported(body, COMPLETION_UNSUPPORTED)
        text, ids = _split_prompt(body.prompt)
        sampling = _sampling(body, {"max_new_tokens": body.max_tokens if body.max_tokens is not None else COMPLETION_MAX_TOKENS})
        logprobs = body.logprobs is not None
        req = native_request(body, text=text, input_ids=ids, sampling_params=sampling, return_logprob=logprobs,
                             top_logprobs_num=body.logprobs or 0,
                             logprob_start_len=0 if body.echo and logprobs else None)  # echo: the prompt's too
        view = EchoView(body.prompt, body.n, body.logprobs) if body.echo else completion_choice
        return await respond(ctx, request, body, req, view, logprobs)


def _add_chat(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/chat/completions", openapi_extra=body_schema("ChatCompletionRequest"))
    async def chat(request: Request) -> Response:
        body: ChatCompletionRequest = await read_typed(ctx, request, ChatCompletionRequest)
        refuse_unsupported(body, CHAT_UNSUPPORTED)
        check_template_depths(body)  # before the template (and tool_choice_schema) recurse into them
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        tools = ToolMode.of(body, ctx.args.tool_call_parser)
        ids = await ctx.intake.run_off_loop(_chat_ids, ctx, body, tools.rendered)
        sampling = _chat_sampling(ctx, body, tools)
        # SGLang's: a reasoning request's grammar (response_format, tool_choice) holds what follows the reasoning
        thinking = ctx.args.reasoning_parser is not None and thinks(ctx.args.reasoning_parser, body.chat_template_kwargs)
        req = native_request(body, input_ids=ids, sampling_params=sampling, return_logprob=body.logprobs,
                             top_logprobs_num=body.top_logprobs or 0, require_reasoning=thinking)
        view = ToolChatView(tools) if tools.parses else chat_choice
        # --reasoning-parser: the reasoning comes apart first; the tools are looked for in the content
        view = reasoning_view(ctx.args.reasoning_parser, body, view, _template_source(ctx))
        return await respond(ctx, request, body, req, view, body.logprobs)


def _chat_sampling(ctx: ServerContext, body: ChatCompletionRequest, tools: ToolMode) -> SamplingParamsIn:
    """A chat request's sampling params: OpenAI's fields, what its tools, template and parsers
    add, and generation_config.json's values where it leaves them unset."""
    # neither: None, until a stop or the context limit (SGLang's meaning)
    max_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    overrides: dict[str, Any] = {"max_new_tokens": max_new}
    spaces = (body.chat_template_kwargs or {}).get("spaces_between_special_tokens")  # SGLang reads it there
    if spaces is not None:
        overrides["spaces_between_special_tokens"] = spaces
    if tools.schema is not None:
        if _response_format_schema(body) is not None:
            raise ApiError(400, "tool_choice required or a named function constrains the output; "
                           "it cannot take a response_format too", param="tool_choice")
        overrides["json_schema"] = tools.schema
    if _keeps_special_tokens(ctx, body):
        overrides["skip_special_tokens"] = False
    named = named_template(ctx.args.chat_template)
    if named is not None and not body.ignore_eos:  # SGLang adds a named template's stop strings
        overrides["stop"] = named.stops_with(body.stop)
    return with_defaults(_sampling(body, overrides), ctx.intake.sampling_defaults)  # generation_config.json's


def native_request(body: OpenAISampling, **fields: Any) -> GenerateRequest:
    """The native request of an OpenAI one: its prompt, sampling and logprob fields (given), and
    what both routes pass through alike (rid, the cache namespace, cache_control, the LoRA adapter)."""
    _, adapter = split_model_name(body.model)  # SGLang's: "base:adapter" wins over lora_path
    return GenerateRequest(return_text_in_logprobs=True, rid=body.rid, cache_salt=body.cache_salt,
                           extra_key=body.extra_key, cache_control=body.cache_control, priority=body.priority,
                           lora_path=adapter if adapter is not None else body.lora_path, stream=body.stream, **fields)


def _sampling(body: OpenAISampling, overrides: dict[str, Any]) -> SamplingParamsIn:
    """The sampling params; max_new_tokens is always set (None: until a stop or the context limit)."""
    fields = {RENAMED.get(k, k): getattr(body, k) for k in SAMPLING_FIELDS}
    schema = _response_format_schema(body)
    if schema is not None:
        fields["json_schema"] = schema
    fields.update(overrides)
    return SamplingParamsIn(**{k: v for k, v in fields.items() if v is not None or k == "max_new_tokens"})


def _keeps_special_tokens(ctx: ServerContext, body: ChatCompletionRequest) -> bool:
    """SGLang's rule: with tools offered (and tool_choice not "none") the answer keeps special tokens,
    which some formats' call markers are ([TOOL_CALLS], <｜tool▁calls▁begin｜>); so does a harmony
    (gpt-oss) answer, whose channels are special tokens."""
    if body.tools and body.tool_choice != "none":
        return True
    return "gpt-oss" in (ctx.args.reasoning_parser, ctx.args.tool_call_parser)


def _response_format_schema(body: OpenAISampling) -> str | None:
    """The json_schema constraint (a JSON string) that response_format asks for; None for none or text.

    As in SGLang, it replaces a json_schema field sent beside it, and beside regex or ebnf it is a 400
    (two grammars). The schema itself is checked where every json_schema is: in the sampling params."""
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        schema = JSON_OBJECT_SCHEMA
    elif rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema is None:
            raise ApiError(400, "response_format of type json_schema needs json_schema.schema, a JSON Schema object",
                           param="response_format")
        schema = json.dumps(rf.json_schema.schema)
    else:
        raise ApiError(400, f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {rf.type!r}",
                       param="response_format")
    for other in ("regex", "ebnf"):
        if getattr(body, other):
            raise ApiError(400, f"response_format {rf.type} and {other} are two constraints; give one",
                           param="response_format")
    return schema


def _split_prompt(prompt: Any) -> tuple[Any, Any]:
    """OpenAI prompts: a string, a list of strings, a token list, or a list of token lists."""
    if isinstance(prompt, str):
        return prompt, None
    if not prompt:
        raise RequestError("prompt is empty", "prompt")
    for kind in (str, int, list):
        if all(isinstance(p, kind) for p in prompt):
            return (prompt, None) if kind is str else (None, prompt)
    raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of such lists, "
                       "not a mix", "prompt")


def _chat_ids(ctx: ServerContext, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> list[int]:
    """The prompt's token ids: the messages through the chat template (SGLang's rules for a last
    assistant message), then the continued message's own tokens if continue_final_message."""
    flat = _template_messages(body)
    named = named_template(ctx.args.chat_template)  # a name wins over a file, as in SGLang
    # /generate's character bound, before the template and the tokenizer see the text (named templates render no tools)
    ctx.intake.text_bound.fit_messages(flat, tools if named is None else None, ctx.args.retention.active,
                                        ctx.args.allow_auto_truncate)
    messages, prefix = _final_assistant(flat, body.continue_final_message)
    tokenizer = ctx.intake.tokenizer
    template = _template_file(ctx.args.chat_template) if ctx.args.chat_template and named is None else None
    if named is None and not template and not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model has no chat template; use /v1/completions", "messages")
    kwargs = dict(body.chat_template_kwargs or {})
    taken = sorted(set(kwargs) & TEMPLATE_CALL_ARGS)
    if taken:
        raise RequestError(f"chat_template_kwargs: {', '.join(taken)} are not template variables", "chat_template_kwargs")
    effort = kwargs.pop("reasoning_effort", None) or body.reasoning_effort  # SGLang lets the kwargs override it
    try:
        if named is not None:  # SGLang's conversation templates: their text, encoded as a prompt
            ids = named.render_ids(tokenizer, messages)
        else:
            ids = list(tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False, reasoning_effort=effort, **kwargs))
    except Exception as e:  # noqa: BLE001 - the template refusing these messages (jinja raise_exception)
        if type(e).__module__.startswith("jinja2"):
            raise RequestError(f"the chat template refused these messages: {e}", "messages") from None
        if kwargs and isinstance(e, (TypeError, ValueError)):  # a variable of the wrong type for this template
            raise RequestError(f"the chat template failed with these chat_template_kwargs: {e}"[:500],
                               "chat_template_kwargs") from None
        raise
    if prefix:
        continued = tokenizer.encode(prefix)
        ids += continued[1:] if continued and continued[0] == tokenizer.bos_token_id else continued
    return ids


def _template_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: text parts joined, roles in lower case."""
    flat = []
    for i, m in enumerate(body.messages):
        role = m.role.lower()
        if role not in CHAT_ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.role!r}", "messages")
        content = m.content
        if isinstance(content, list):  # content parts: text only
            if any(p.type != "text" or p.text is None for p in content):
                raise RequestError(f"messages[{i}].content: only text parts (with a text) are supported", "messages")
            content = "".join(p.text for p in content)
        if content is None and not m.tool_calls:
            raise RequestError(f"messages[{i}].content is required", "messages")
        message: dict[str, Any] = {"role": role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        for key in ("name", "reasoning_content", "tool_call_id"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        flat.append(message)
    return flat


def _final_assistant(messages: list[dict[str, Any]], continue_final: bool) -> tuple[list[dict[str, Any]], str | None]:
    """SGLang's rule for a conversation that ends with an assistant's text: continue_final_message
    takes it out of the messages and returns it, to follow the generation prompt as the start of
    the answer; otherwise it becomes a user message, so that the template ends on a user turn."""
    if not messages or messages[-1]["role"] != "assistant" or not isinstance(messages[-1]["content"], str):
        return messages, None
    if continue_final:
        return messages[:-1], messages[-1]["content"]
    return messages[:-1] + [{"role": "user", "content": messages[-1]["content"]}], None


def _template_source(ctx: ServerContext) -> str | None:
    """The Jinja chat template in use (--chat-template's file, else the tokenizer's); None for a named one."""
    if ctx.args.chat_template:
        return None if named_template(ctx.args.chat_template) is not None else _template_file(ctx.args.chat_template)
    source = getattr(ctx.manager.tokenizer, "chat_template", None)
    return source if isinstance(source, str) else None


@functools.lru_cache(maxsize=2)
def _template_file(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()
