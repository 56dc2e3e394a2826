"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions.

Bodies decode into the typed structs of schemas.py; OpenAI names are mapped
to SGLang's sampling fields (response_format to the json_schema constraint)
and become the native GenerateRequest, so both APIs share one validation.
Chat tools are rendered by the chat template; tool_choice required or a named
function constrains the output to a call array, and auto parses calls out of
the text with --tool-call-parser (tool_calls.py).
Results take OpenAI's response and stream-chunk shapes; a request that
failed in the backend is a 5xx (or an error event once a stream has started),
never a 200 with partial text. Errors use OpenAI's body.

As in SGLang, the `model` field is not checked (the answer names what was
asked for), chat without max_tokens runs until a stop or the context limit,
streamed logprobs come per chunk, and stream_options.continuous_usage_stats
puts the usage so far in every chunk.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from radixrt.errors import RequestError
from radixrt.frontend.generate_input import GenerateRequest
from radixrt.frontend.sampling_defaults import with_defaults
from radixrt.frontend.req_state import ReqState
from radixrt.sampling_params import SamplingParamsIn, refuse_unsupported
from radixrt.server.chat_templates import named_template
from radixrt.server.http_common import (
    SSE_DONE, ApiError, ServerContext, Submission, body_schema, counted, error_body, event_stream, failure, generate_input,
    json_response, read_typed, sse
)
from radixrt.server.nesting import check_template_depths
from radixrt.server.schemas import (
    CHAT_UNSUPPORTED, COMPLETION_UNSUPPORTED, RESPONSE_FORMAT_TYPES, ChatCompletionRequest, CompletionRequest,
    OpenAISampling
)
from radixrt.server.tool_calls import (
    TOOL_CALL_PARSERS, StreamingToolParser, ToolCall, calls_from_constrained, tool_choice_schema
)

# OpenAI request field -> sampling_params field, where the names differ
RENAMED = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
SAMPLING_FIELDS = (
    "max_tokens", "temperature", "top_p", "n", "stop", "presence_penalty", "frequency_penalty", "seed", "top_k",
    "min_p", "min_tokens", "repetition_penalty", "stop_token_ids", "ignore_eos", "no_stop_trim", "skip_special_tokens",
    "regex", "json_schema", "ebnf",
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
    @app.get("/v1/models")
    async def models() -> Response:
        card = {"id": ctx.args.model_name, "object": "model", "created": 0, "owned_by": "radixrt",
                "root": ctx.args.model_path, "max_model_len": ctx.manager.context_length}
        return json_response({"object": "list", "data": [card]})

    @app.post("/v1/completions", openapi_extra=body_schema("CompletionRequest"))
    async def completions(request: Request) -> Response:
        body: CompletionRequest = await read_typed(ctx, request, CompletionRequest)
        refuse_unsupported(body, COMPLETION_UNSUPPORTED)
        text, ids = _split_prompt(body.prompt)
        sampling = _sampling(body, {"max_new_tokens": body.max_tokens if body.max_tokens is not None else COMPLETION_MAX_TOKENS})
        req = GenerateRequest(text=text, input_ids=ids, sampling_params=sampling, return_logprob=body.logprobs is not None,
                              top_logprobs_num=body.logprobs or 0, return_text_in_logprobs=True, rid=body.rid,
                              cache_salt=body.cache_salt, extra_key=body.extra_key)
        return await _respond(ctx, request, body, req, _completion_choice, body.logprobs is not None)

    @app.post("/v1/chat/completions", openapi_extra=body_schema("ChatCompletionRequest"))
    async def chat(request: Request) -> Response:
        body: ChatCompletionRequest = await read_typed(ctx, request, ChatCompletionRequest)
        refuse_unsupported(body, CHAT_UNSUPPORTED)
        check_template_depths(body)  # before the template (and tool_choice_schema) recurse into them
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        tools = ToolMode.of(body, ctx.args.tool_call_parser)
        ids = await ctx.manager.run_off_loop(_chat_ids, ctx, body, tools.rendered)
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
        named = named_template(ctx.args.chat_template)
        if named is not None and not body.ignore_eos:  # SGLang adds a named template's stop strings
            overrides["stop"] = named.stops_with(body.stop)
        sampling = with_defaults(_sampling(body, overrides), ctx.manager.sampling_defaults)  # generation_config.json's
        req = GenerateRequest(input_ids=ids, sampling_params=sampling, return_logprob=body.logprobs,
                              top_logprobs_num=body.top_logprobs or 0, return_text_in_logprobs=True, rid=body.rid,
                              cache_salt=body.cache_salt, extra_key=body.extra_key)
        view = ToolChatView(tools) if tools.parses else _chat_choice
        return await _respond(ctx, request, body, req, view, body.logprobs)


def _sampling(body: OpenAISampling, overrides: dict[str, Any]) -> SamplingParamsIn:
    """The sampling params; max_new_tokens is always set (None: until a stop or the context limit)."""
    fields = {RENAMED.get(k, k): getattr(body, k) for k in SAMPLING_FIELDS}
    schema = _response_format_schema(body)
    if schema is not None:
        fields["json_schema"] = schema
    fields.update(overrides)
    return SamplingParamsIn(**{k: v for k, v in fields.items() if v is not None or k == "max_new_tokens"})


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
    ctx.manager.text_bound.fit_messages(flat, tools if named is None else None, ctx.args.retention.active,
                                        ctx.args.allow_auto_truncate)
    messages, prefix = _final_assistant(flat, body.continue_final_message)
    tokenizer = ctx.manager.tokenizer
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


@functools.lru_cache(maxsize=2)
def _template_file(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


@dataclass(frozen=True)
class ToolMode:
    """What a chat request's tools and tool_choice ask for."""

    rendered: list[dict[str, Any]] | None  # tools shown to the model by the chat template
    schema: str | None  # required / a named function: the json_schema of the call array the output must be
    parser: str | None  # auto: the --tool-call-parser that finds calls in free text

    @classmethod
    def of(cls, body: ChatCompletionRequest, parser: str | None) -> ToolMode:
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
        # checks tools and tool_choice (a 400 naming them)
        schema = tool_choice_schema(body.tools or [], choice, body.parallel_tool_calls)
        if choice == "none" or not body.tools:
            return cls(None, None, None)
        return cls(body.tools, schema, parser if schema is None else None)

    @property
    def parses(self) -> bool:
        return self.schema is not None or self.parser is not None


class ToolChatView:
    """Chat choices whose text holds tool calls: the constrained call array (required / named), or
    calls the parser finds in free text (auto). Streams hold back what may be a call."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self._parsers: dict[int, StreamingToolParser] = {}  # auto: per choice
        self._buffers: dict[int, str] = {}  # required / named: the call array so far, per choice
        self._calls_sent: dict[int, int] = {}

    def __call__(self, tok: Any, state: ReqState, index: int, text: str, logprobs: tuple[int, int] | None,
                 stream: bool) -> dict[str, Any]:
        choice = _chat_choice(tok, state, index, text, logprobs, stream)
        if stream:
            content, calls = self._feed(index, text, state.done)
        else:
            content, calls = self._parse(text)
        message = choice["delta" if stream else "message"]
        message["content"] = content if content or stream else (None if calls else content)
        if calls:
            first = self._calls_sent.get(index, 0)
            message["tool_calls"] = [
                {**({"index": first + k} if stream else {}), "id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} for k, c in enumerate(calls)]
            self._calls_sent[index] = first + len(calls)
        if self._calls_sent.get(index) and state.finish is not None and state.finish.type == "stop":
            choice["finish_reason"] = "tool_calls"
        return choice

    def _parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.mode.schema is not None:
            try:
                return "", calls_from_constrained(text)
            except ValueError:  # cut short by max_tokens: not a whole call array
                return text, []
        return TOOL_CALL_PARSERS[self.mode.parser].parse(text)

    def _feed(self, index: int, delta: str, done: bool) -> tuple[str, list[ToolCall]]:
        if self.mode.schema is not None:  # the array is parsed whole, at the end
            buffered = self._buffers[index] = self._buffers.get(index, "") + delta
            return self._parse(buffered) if done else ("", [])
        parser = self._parsers.setdefault(index, StreamingToolParser(self.mode.parser))
        content, calls = parser.feed(delta)
        if done:
            rest, more = parser.finish()
            content, calls = content + rest, calls + more
        return content, calls


def _finish_reason(state: ReqState) -> str | None:
    f = state.finish
    if f is None:
        return None
    return {"stop": "stop", "length": "length"}.get(f.type, "abort")


def _usage(states: list[ReqState]) -> dict[str, Any]:
    # Parallel samples share one prompt (one token list): count it once, as OpenAI does.
    prompts = {id(s.prompt_ids): s for s in states}
    prompt = sum(len(s.prompt_ids) for s in prompts.values())
    completion = sum(len(s.output_ids) for s in states)
    return _usage_of(prompt, completion, sum(s.cached_tokens for s in prompts.values()))


def _usage_of(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# A choice view: (tokenizer, state, index, text, the output tokens [start, end) whose logprobs
# to report or None, stream) -> the choice dict
ChoiceView = Callable[[Any, ReqState, int, str, "tuple[int, int] | None", bool], dict[str, Any]]


def _token_logprobs(tokenizer: Any, state: ReqState, span: tuple[int, int]) -> tuple[list, list]:
    """Output (logprob, id, text) triples of tokens [start, end), and their top alternatives."""
    lp = state.result(tokenizer)["meta_info"]
    start, end = span
    tokens = lp["output_token_logprobs"][start:end]
    tops = (lp["output_top_logprobs"] or [[] for _ in lp["output_token_logprobs"]])[start:end]
    return tokens, tops


def _completion_choice(tok: Any, state: ReqState, index: int, text: str, logprobs: tuple[int, int] | None,
                       stream: bool) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": _finish_reason(state)}
    if logprobs is not None:
        tokens, tops = _token_logprobs(tok, state, logprobs)
        texts = [t[2] for t in tokens]
        choice["logprobs"] = {
            "tokens": texts,
            "token_logprobs": [t[0] for t in tokens],
            "top_logprobs": [{x[2]: x[0] for x in row} for row in tops],
            "text_offset": [sum(len(x) for x in texts[:i]) for i in range(len(texts))],
        }
    return choice


def _chat_choice(tok: Any, state: ReqState, index: int, text: str, logprobs: tuple[int, int] | None,
                 stream: bool) -> dict[str, Any]:
    body = "delta" if stream else "message"
    message = {"content": text} if stream else {"role": "assistant", "content": text}
    choice = {"index": index, body: message, "logprobs": None, "finish_reason": _finish_reason(state)}
    if logprobs is not None:
        tokens, tops = _token_logprobs(tok, state, logprobs)
        choice["logprobs"] = {"content": [
            {"token": t[2], "logprob": t[0], "bytes": list(t[2].encode()),
             "top_logprobs": [{"token": x[2], "logprob": x[0], "bytes": list(x[2].encode())} for x in top]}
            for t, top in zip(tokens, tops)
        ]}
    return choice


async def _respond(ctx: ServerContext, request: Request, body: OpenAISampling, req: GenerateRequest,
                   view: ChoiceView, logprobs: bool) -> Response:
    sub = await Submission.start(ctx, await generate_input(ctx, req))
    chat = view is _chat_choice or isinstance(view, ToolChatView)
    meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": body.model or ctx.args.model_name}  # what was asked for, as SGLang answers
    if body.stream:
        options = body.stream_options
        usage = StreamUsage(bool(options and options.include_usage), bool(options and options.continuous_usage_stats))
        return event_stream(sub, _stream(sub, meta, view, logprobs, usage))
    if not await sub.wait(request):
        raise ApiError(499, "client closed the request", cause="client_closed")
    sub.check()
    tok = ctx.manager.tokenizer
    choices = [view(tok, s, i, s.result(tok)["text"], (0, len(s.output_ids)) if logprobs else None, False)
               for i, s in enumerate(sub.states)]
    obj = "chat.completion" if chat else "text_completion"
    return json_response({**meta, "object": obj, "choices": choices, "usage": _usage(sub.states)})


@dataclass(frozen=True)
class StreamUsage:
    """stream_options: where a stream reports usage."""

    at_end: bool  # include_usage: a last chunk with no choices and the whole request's usage
    per_chunk: bool  # continuous_usage_stats: each chunk carries its choice's usage so far


async def _stream(sub: Submission, meta: dict[str, Any], view: ChoiceView, logprobs: bool,
                  usage: StreamUsage) -> AsyncIterator[bytes]:
    tok = sub.ctx.manager.tokenizer
    chat = view is _chat_choice or isinstance(view, ToolChatView)
    obj = "chat.completion.chunk" if chat else "text_completion"
    n = len(sub.states)
    sent_text, sent_tokens, finished = [""] * n, [0] * n, [False] * n

    def chunk(choice: dict[str, Any], state: ReqState, completion: int) -> bytes:
        extra = {"usage": _usage_of(len(state.prompt_ids), completion, state.cached_tokens)} if usage.per_chunk else {}
        return sse({**meta, "object": obj, "choices": [choice], **extra})

    if chat:
        for i, s in enumerate(sub.states):
            yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}, s, 0)
    async for _ in sub.stream():
        failed = next((s.error for s in sub.states if s.error is not None), None)
        if failed is not None:
            yield sse(error_body(counted(sub.ctx, failure(failed))))
            break
        for i, s in enumerate(sub.states):
            done, end = s.done, len(s.output_ids)  # read first: the receiving thread appends meanwhile
            text = s.result(tok)["text"]
            delta = text[len(sent_text[i]):]
            if not delta and not (done and not finished[i]):
                continue
            choice = view(tok, s, i, delta, (sent_tokens[i], end) if logprobs else None, True)
            if not done:  # the view read the state after `done` was: a finish it saw belongs to the next chunk
                choice["finish_reason"] = None
            sent_text[i], sent_tokens[i], finished[i] = text, end, done
            yield chunk(choice, s, end)
    else:
        if usage.at_end:
            yield sse({**meta, "object": obj, "choices": [], "usage": _usage(sub.states)})
    yield SSE_DONE
