"""Chat answers under --reasoning-parser: message.reasoning_content, delta.reasoning_content, and
usage.reasoning_tokens.

ReasoningChatView wraps the chat view that would answer otherwise (plain, or ToolChatView): it
splits each choice's text with radixrt/reasoning.py and hands only the content on, so tool calls
are looked for after the reasoning. A stream keeps one splitter per choice; a marker that arrives
across tokens is held back until it is whole. separate_reasoning false leaves the text whole
(everything is content); the reasoning is still counted in usage.

reasoning_tokens counts the output tokens up to and including the end marker's last token: the
fewest tokens whose decoded text holds the end marker, found by a binary search over decoded
prefixes (O(log n) decodes, once per choice: cached once the marker is found).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixrt.frontend.req_state import ReqState
from radixrt.reasoning import (
    ReasoningFormat,
    ReasoningStream,
    chat_forced,
    count_reasoning_tokens,
    get_format,
    separate,
    template_forces_reasoning,
)
from radixrt.server.schemas import ChatCompletionRequest

# the chat view wrapped: (tokenizer, state, index, text, logprob span, stream) -> the choice dict
InnerView = Callable[[Any, ReqState, int, str, "tuple[int, int] | None", bool], dict[str, Any]]


class ReasoningChatView:
    def __init__(self, inner: InnerView, fmt: ReasoningFormat, forced: bool, separate: bool, stream_reasoning: bool) -> None:
        self.inner, self.fmt, self.forced = inner, fmt, forced
        self.separate, self.stream_reasoning = separate, stream_reasoning
        self._streams: dict[int, ReasoningStream] = {}  # per choice index
        self._counted: dict[int, int] = {}  # id(state) -> its reasoning tokens, once the end marker is found

    def __call__(self, tok: Any, state: ReqState, index: int, text: str, logprobs: tuple[int, int] | None,
                 stream: bool) -> dict[str, Any]:
        if not self.separate:
            choice = self.inner(tok, state, index, text, logprobs, stream)
            if not stream:
                choice["message"]["reasoning_content"] = None
            return choice
        if stream:
            splitter = self._streams.setdefault(index, ReasoningStream(self.fmt, self.forced, self.stream_reasoning))
            part = splitter.feed(text)
            if state.done:  # finishing twice is harmless: a late piece of text is still split
                part = part + splitter.finish()
        else:
            part = separate(text, self.fmt, self.forced)
        choice = self.inner(tok, state, index, part.content, logprobs, stream)
        message = choice["delta" if stream else "message"]
        if part.reasoning or not stream:
            message["reasoning_content"] = part.reasoning or None  # SGLang's null when there is none
        if message.get("content") == "" and (part.reasoning or not stream):
            message["content"] = None  # SGLang's: no text, no content
        return choice

    def reasoning_tokens(self, state: ReqState) -> int:
        """The output tokens so far that belong to the reasoning, its end marker included."""
        known = self._counted.get(id(state))
        if known is not None:
            return known
        ids = list(state.output_ids)  # the receiving thread appends meanwhile
        found = count_reasoning_tokens(len(ids), lambda k: state.detok.decode(ids[:k]), self.fmt, self.forced)
        if found.ended:
            self._counted[id(state)] = found.count
        return found.count


def reasoning_view(parser: str | None, body: ChatCompletionRequest, inner: InnerView,
                   template: str | None) -> InnerView:
    """The chat view for this request: `inner` itself without a parser (separate_reasoning and
    stream_reasoning are then ignored, as in SGLang). template: the chat template's source, whose
    generation prompt may open the reasoning (SGLang's force_reasoning)."""
    if parser is None:
        return inner
    forced = chat_forced(parser, body.chat_template_kwargs, template_forces_reasoning(template))
    return ReasoningChatView(inner, get_format(parser), forced, bool(body.separate_reasoning),
                             bool(body.stream_reasoning))
