"""The OpenAI API's answers: choices, usage, whole responses and SSE stream chunks.

A completion choice carries text (and OpenAI's legacy logprobs), a chat choice a message
or a delta (and per-token logprobs with bytes); with tools, ToolChatView reads calls out
of the text: the constrained call array (tool_choice required or a named function) or
what --tool-call-parser finds (auto), holding back a stream's text that may be a call.
Usage counts a prompt shared by parallel samples once; stream_options put it at the end
or in every chunk. A whole answer carries SGLang's `sglext` when asked (cached tokens by tier).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response

from radixrt.frontend.generate_input import GenerateRequest
from radixrt.frontend.req_state import ReqState, cached_tokens_details
from radixrt.server.http_common import (
    SSE_DONE, ApiError, ServerContext, Submission, counted, error_body, event_stream, failure, json_response, prepare,
    sse
)
from radixrt.server.reasoning_chat import ReasoningChatView
from radixrt.server.schemas import ChatCompletionRequest, OpenAISampling
from radixrt.server.tool_calls import (
    TOOL_CALL_PARSERS, StreamingToolParser, ToolCall, calls_from_constrained, tool_choice_schema
)


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
        choice = chat_choice(tok, state, index, text, logprobs, stream)
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
        return TOOL_CALL_PARSERS[self.mode.parser].parse(text, self.mode.rendered)

    def _feed(self, index: int, delta: str, done: bool) -> tuple[str, list[ToolCall]]:
        if self.mode.schema is not None:  # the array is parsed whole, at the end
            buffered = self._buffers[index] = self._buffers.get(index, "") + delta
            return self._parse(buffered) if done else ("", [])
        parser = self._parsers.setdefault(index, StreamingToolParser(self.mode.parser, self.mode.rendered))
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


def _usage(states: list[ReqState], reasoning: Callable[[ReqState], int] | None = None) -> dict[str, Any]:
    """reasoning: a state's reasoning tokens (ReasoningChatView.reasoning_tokens); None: none."""
    # Parallel samples share one prompt (one token list): count it once, as OpenAI does.
    prompts = {id(s.prompt_ids): s for s in states}
    prompt = sum(len(s.prompt_ids) for s in prompts.values())
    completion = sum(len(s.output_ids) for s in states)
    thought = sum(reasoning(s) for s in states) if reasoning is not None else 0
    return _usage_of(prompt, completion, sum(s.cached_tokens for s in prompts.values()), thought)


def _usage_of(prompt: int, completion: int, cached: int, reasoning: int = 0) -> dict[str, Any]:
    # reasoning_tokens: SGLang's field (always there, 0 without a reasoning parser); the details: OpenAI's
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}, "reasoning_tokens": reasoning,
            "completion_tokens_details": {"reasoning_tokens": reasoning}}


def _is_chat(view: Any) -> bool:
    return view is chat_choice or isinstance(view, (ToolChatView, ReasoningChatView))


def _reasoning_counter(view: Any) -> Callable[[ReqState], int] | None:
    return view.reasoning_tokens if isinstance(view, ReasoningChatView) else None


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


def completion_choice(tok: Any, state: ReqState, index: int, text: str, logprobs: tuple[int, int] | None,
                       stream: bool) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": _finish_reason(state)}
    if logprobs is not None:
        start, end = logprobs
        # offsets count from the start of the whole completion, a stream's earlier chunks included
        tokens, tops = _token_logprobs(tok, state, (0, end))
        offsets = text_offsets([t[2] for t in tokens])
        choice["logprobs"] = legacy_logprobs(tokens[start:], tops[start:], offsets[start:])
    return choice


def legacy_logprobs(tokens: list, tops: list, offsets: list[int]) -> dict[str, Any]:
    """OpenAI's completions logprobs of (logprob, id, text) triples, their top alternatives (a row
    of None: none, as for a prompt's first token) and where each token's text starts."""
    return {
        "tokens": [t[2] for t in tokens],
        "token_logprobs": [t[0] for t in tokens],
        "top_logprobs": [None if row is None else {x[2]: x[0] for x in row} for row in tops],
        "text_offset": offsets,
    }


def text_offsets(texts: list[str], start: int = 0) -> list[int]:
    """Where each text starts when they are laid end to end from `start`."""
    out = []
    for t in texts:
        out.append(start)
        start += len(t)
    return out


def chat_choice(tok: Any, state: ReqState, index: int, text: str, logprobs: tuple[int, int] | None,
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


async def respond(ctx: ServerContext, request: Request, body: OpenAISampling, req: GenerateRequest,
                   view: ChoiceView, logprobs: bool) -> Response:
    sub = await Submission.start(ctx, await prepare(ctx, req, request))
    chat = _is_chat(view)
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
    usage = _usage(sub.states, _reasoning_counter(view))
    return json_response({**meta, "object": obj, "choices": choices, "usage": usage,
                          **sglext(body, sub.states[0])})


def sglext(body: OpenAISampling, first: ReqState) -> dict[str, Any]:
    """SGLang's extensions of a whole (not streamed) answer: with return_cached_tokens_details,
    {"sglext": {"cached_tokens_details": ...}} of the first choice's request, when it has one
    (the hierarchical cache is on and it hit); else nothing, as SGLang leaves sglext out."""
    details = cached_tokens_details(first.cached_details) if body.return_cached_tokens_details else None
    return {"sglext": {"cached_tokens_details": details}} if details is not None else {}


@dataclass(frozen=True)
class StreamUsage:
    """stream_options: where a stream reports usage."""

    at_end: bool  # include_usage: a last chunk with no choices and the whole request's usage
    per_chunk: bool  # continuous_usage_stats: each chunk carries its choice's usage so far


async def _stream(sub: Submission, meta: dict[str, Any], view: ChoiceView, logprobs: bool,
                  usage: StreamUsage) -> AsyncIterator[bytes]:
    tok = sub.ctx.manager.tokenizer
    chat = _is_chat(view)
    reasoning = _reasoning_counter(view)
    obj = "chat.completion.chunk" if chat else "text_completion"
    n = len(sub.states)
    sent_text, sent_tokens, finished = [""] * n, [0] * n, [False] * n
    ready = getattr(view, "ready", None)  # a view may hold a choice's chunks back (EchoView)

    def chunk(choice: dict[str, Any], state: ReqState, completion: int) -> bytes:
        if not usage.per_chunk:
            return sse({**meta, "object": obj, "choices": [choice]})
        thought = min(reasoning(state), completion) if reasoning is not None else 0  # state may have run ahead
        extra = {"usage": _usage_of(len(state.prompt_ids), completion, state.cached_tokens, thought)}
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
            if ready is not None and not ready(i, s):  # echo with logprobs: not before the prompt's
                continue
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
            yield sse({**meta, "object": obj, "choices": [], "usage": _usage(sub.states, reasoning)})
    yield SSE_DONE
