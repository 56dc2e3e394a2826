"""Reasoning output: SGLang 0.5.9's --reasoning-parser formats, and the split of a model's text
into its reasoning and its answer (content), whole or streamed.

A format is its two markers (Qwen3's `<think>` and `</think>`) and whether an output starts inside
the reasoning without writing the start marker ("forced": DeepSeek-R1's template ends the prompt
with `<think>`). One rule serves whole texts and streams, so that a stream's pieces joined equal the
whole-text split wherever the deltas are cut (a marker may arrive across any number of tokens):

  * the start marker counts only at the start of the output (after whitespace); unforced and
    without it, the whole output is content, verbatim;
  * the reasoning runs to the first end marker (or the end of the text: cut short, it is all
    reasoning); it is stripped of surrounding whitespace, and the content after the end marker of
    leading whitespace (and, for gpt-oss, of the final channel's header);
  * a stream holds back only what may still be the start of a marker (or whitespace that may
    end the reasoning); with stream_reasoning false, the reasoning comes in one piece when it ends.

Where SGLang differs: its whole-text parser also takes a start marker later in the text and keeps
the reasoning's trailing newline; its stream keeps the content's leading whitespace.
Pure Python (L0): the server, the scheduler (require_reasoning's end marker) and the DSL use it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple


class Forcing(Enum):
    """Whether an output starts inside the reasoning, without a start marker."""

    ALWAYS = "always"  # the template opens the reasoning (DeepSeek-R1, Qwen3-Thinking-2507, gpt-oss)
    NEVER = "never"  # only a start marker opens it (SGLang's kimi detector)
    PER_REQUEST = "per_request"  # in chat: when the request thinks (thinks()) or the template opens it


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    think_start: str
    think_end: str  # also where a grammar starts under require_reasoning
    forcing: Forcing
    # (chat_template_kwargs key, its default): whether a chat request thinks; None: it always does
    switch: tuple[str, bool] | None = None
    content_headers: tuple[str, ...] = ()  # framing dropped where the content starts (gpt-oss's final channel)

    @property
    def forced_by_default(self) -> bool:
        """Forced outside chat (/separate_reasoning, the DSL), as SGLang's detectors default."""
        return self.forcing is Forcing.ALWAYS


THINK = ("<think>", "</think>")
_GPT_OSS_FINAL = ("<|start|>assistant<|channel|>final<|message|>", "<|channel|>final<|message|>")
FORMATS: dict[str, ReasoningFormat] = {f.name: f for f in (
    ReasoningFormat("deepseek-r1", *THINK, Forcing.ALWAYS),
    ReasoningFormat("deepseek-v3", *THINK, Forcing.PER_REQUEST, ("thinking", False)),
    ReasoningFormat("glm45", *THINK, Forcing.PER_REQUEST, ("enable_thinking", True)),
    ReasoningFormat("gpt-oss", "<|channel|>analysis<|message|>", "<|end|>", Forcing.ALWAYS,
                    content_headers=_GPT_OSS_FINAL),
    ReasoningFormat("interns1", *THINK, Forcing.PER_REQUEST, ("enable_thinking", True)),
    ReasoningFormat("kimi", "◁think▷", "◁/think▷", Forcing.NEVER),
    ReasoningFormat("kimi_k2", *THINK, Forcing.PER_REQUEST, ("thinking", True)),
    ReasoningFormat("minimax", *THINK, Forcing.ALWAYS),
    ReasoningFormat("nano_v3", *THINK, Forcing.PER_REQUEST, ("enable_thinking", True)),
    ReasoningFormat("qwen3", *THINK, Forcing.PER_REQUEST, ("enable_thinking", True)),
    ReasoningFormat("qwen3-thinking", *THINK, Forcing.ALWAYS),
    ReasoningFormat("step3", *THINK, Forcing.ALWAYS),
    ReasoningFormat("step3p5", *THINK, Forcing.ALWAYS),
)}
REASONING_PARSERS = tuple(FORMATS)  # --reasoning-parser's choices
# SGLang's TemplateManager: a template that opens the reasoning in its generation prompt forces it
_TEMPLATE_OPENS_REASONING = "<|im_start|>assistant\\n<think>\\n"


def get_format(name: str) -> ReasoningFormat:
    """The format by SGLang's name (any case); ValueError naming the choices."""
    fmt = FORMATS.get(name.lower()) if isinstance(name, str) else None
    if fmt is None:
        raise ValueError(f"unknown reasoning parser {name!r}; choices: {', '.join(REASONING_PARSERS)}")
    return fmt


def thinks(parser: str, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
    """Whether a chat request reasons (SGLang's rule, and its require_reasoning): qwen3 and its kin
    unless enable_thinking is false, deepseek-v3 only with thinking true, kimi_k2 unless thinking
    is false, the others always."""
    fmt = get_format(parser)
    if fmt.switch is None:
        return True
    key, default = fmt.switch
    value = (chat_template_kwargs or {}).get(key)
    return value is not False if default else value is True


def template_forces_reasoning(template: str | None) -> bool:
    """A chat template whose generation prompt opens the reasoning (SGLang's check, on the source)."""
    return bool(template) and _TEMPLATE_OPENS_REASONING in template


def chat_forced(parser: str, chat_template_kwargs: Mapping[str, Any] | None, template_forced: bool = False) -> bool:
    """Whether a chat answer starts inside the reasoning (SGLang's serving_chat rule)."""
    fmt = get_format(parser)
    if fmt.forcing is Forcing.PER_REQUEST:
        return template_forced or thinks(parser, chat_template_kwargs)
    return fmt.forcing is Forcing.ALWAYS


class Separated(NamedTuple):
    reasoning: str
    content: str

    def __add__(self, other: Separated) -> Separated:  # type: ignore[override]
        return Separated(self.reasoning + other.reasoning, self.content + other.content)


class _Stage(Enum):
    OPENING = 1  # nothing decided: leading whitespace, maybe the start marker
    REASONING = 2
    AFTER = 3  # the end marker seen: dropping whitespace (and headers) before the content
    CONTENT = 4


def _partial_tail(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of text that is a proper start of one of the markers."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


class ReasoningStream:
    """Splits one output fed in deltas. feed() returns what each delta settles; finish() the rest
    (text held as a possible marker start, reasoning cut short). finish() may be called again, and
    feeding may go on after it (a stream that learnt of its end early)."""

    def __init__(self, fmt: ReasoningFormat | str, forced: bool | None = None, stream_reasoning: bool = True) -> None:
        self.fmt = get_format(fmt) if isinstance(fmt, str) else fmt
        self.forced = self.fmt.forced_by_default if forced is None else forced
        self.stream_reasoning = stream_reasoning
        self.stage = _Stage.OPENING
        self.reasoned = False  # entered the reasoning
        self.ended = False  # saw the end marker
        self._held = ""  # undecided text
        self._pending = ""  # reasoning kept until it ends (stream_reasoning false)
        self._reasoning_begun = False  # some reasoning text settled (its leading whitespace is dropped)

    @property
    def in_reasoning(self) -> bool:
        return self.stage is _Stage.REASONING or (self.stage is _Stage.OPENING and self.forced)

    def feed(self, delta: str) -> Separated:
        self._held += delta
        out: list[Separated] = []
        while self._step(out):
            pass
        return _join(out)

    def finish(self) -> Separated:
        """Settle what is held: the output has ended."""
        out: list[Separated] = []
        while self._step(out):
            pass
        held, self._held = self._held, ""
        if self.stage is _Stage.OPENING:
            self._enter(_Stage.REASONING if self.forced else _Stage.CONTENT)
        if self.stage is _Stage.REASONING:
            self._settle_reasoning(held.rstrip(), out)
            out.append(self._flush_pending())
        else:  # content as it is; in AFTER, a partial header
            out.append(Separated("", held))
        return _join(out)

    # --- one step of the state machine: True when it moved on and should run again ---

    def _step(self, out: list[Separated]) -> bool:
        if self.stage is _Stage.OPENING:
            return self._opening()
        if self.stage is _Stage.REASONING:
            return self._reasoning(out)
        if self.stage is _Stage.AFTER:
            return self._after()
        if self._held:
            out.append(Separated("", self._held))
            self._held = ""
        return False

    def _opening(self) -> bool:
        start = self.fmt.think_start
        text = self._held.lstrip()
        if text.startswith(start):
            self._held = text[len(start):]
            self._enter(_Stage.REASONING)
            return True
        if start.startswith(text):  # may still become the start marker
            return False
        self._enter(_Stage.REASONING if self.forced else _Stage.CONTENT)
        return True

    def _reasoning(self, out: list[Separated]) -> bool:
        end = self.fmt.think_end
        text = self._held
        at = text.find(end)
        if at >= 0:
            self._settle_reasoning(text[:at].rstrip(), out)
            out.append(self._flush_pending())
            self._held = text[at + len(end):]
            self.ended = True
            self._enter(_Stage.AFTER)
            return True
        body = text[: len(text) - _partial_tail(text, (end,))]
        settled = body.rstrip()  # trailing whitespace may yet precede the end marker
        self._settle_reasoning(settled, out)
        self._held = text[len(settled):]
        return False

    def _after(self) -> bool:
        text = self._held.lstrip()
        for header in self.fmt.content_headers:
            if text.startswith(header):
                self._held = text[len(header):]
                return True
        self._held = text
        if not text or any(h.startswith(text) for h in self.fmt.content_headers):
            return False
        self._enter(_Stage.CONTENT)
        return True

    def _enter(self, stage: _Stage) -> None:
        self.stage = stage
        self.reasoned = self.reasoned or stage is _Stage.REASONING

    def _settle_reasoning(self, text: str, out: list[Separated]) -> None:
        if not self._reasoning_begun:
            text = text.lstrip()
        if not text:
            return
        self._reasoning_begun = True
        if self.stream_reasoning:
            out.append(Separated(text, ""))
        else:
            self._pending += text

    def _flush_pending(self) -> Separated:
        pending, self._pending = self._pending, ""
        return Separated(pending, "")


def _join(parts: list[Separated]) -> Separated:
    return Separated("".join(p.reasoning for p in parts), "".join(p.content for p in parts))


def separate(text: str, parser: ReasoningFormat | str, forced: bool | None = None) -> Separated:
    """The whole text's (reasoning, content). forced None: the format's default outside chat."""
    stream = ReasoningStream(parser, forced)
    return stream.feed(text) + stream.finish()


class ReasoningTokens(NamedTuple):
    count: int  # output tokens that belong to the reasoning, its end marker included
    ended: bool  # the end marker is among them (the count is final)


def count_reasoning_tokens(n_tokens: int, text_of: Callable[[int], str], parser: ReasoningFormat | str,
                           forced: bool | None = None) -> ReasoningTokens:
    """The reasoning's share of an output of n_tokens, where text_of(k) decodes its first k tokens:
    none if it never reasons, all of them if the reasoning never ends, else the fewest tokens whose
    text holds the end marker (a binary search: O(log n) decodes)."""
    def probe(k: int) -> ReasoningStream:
        stream = ReasoningStream(parser, forced)
        stream.feed(text_of(k))
        return stream

    whole = probe(n_tokens)
    if not whole.ended:
        return ReasoningTokens(n_tokens if whole.in_reasoning or whole.reasoned else 0, False)
    lo, hi = 1, n_tokens  # probe(hi) has ended
    while lo < hi:
        mid = (lo + hi) // 2
        if probe(mid).ended:
            hi = mid
        else:
            lo = mid + 1
    return ReasoningTokens(hi, True)


__all__ = [
    "FORMATS", "REASONING_PARSERS", "Forcing", "ReasoningFormat", "ReasoningStream", "ReasoningTokens", "Separated",
    "chat_forced", "count_reasoning_tokens", "get_format", "separate", "template_forces_reasoning", "thinks",
]
