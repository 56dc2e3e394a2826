"""Tool calls: finding them in a model's text, and constraining the text to be them.

Two ways a chat answer carries calls, as in SGLang:

- tool_choice "auto": the model writes calls in its own format inside free text, and a
  parser named by --tool-call-parser (TOOL_CALL_PARSERS) takes them out. Each format opens a
  call region with a marker and reads it with its own closer and region parser
  (tool_formats.py: hermes, qwen25, llama3, mistral, deepseekv3; tool_formats_markup.py:
  pythonic, qwen3_coder, gpt-oss). StreamingToolParser does the same on a stream of deltas,
  holding back what may still become a call; parse() is the stream fed whole, so both agree.
- tool_choice "required" or a named function: the output is constrained by
  tool_choice_schema to a JSON array of {"name", "parameters"} objects, which
  calls_from_constrained reads back.

Parsing never raises on model text: whatever is not a well-formed call stays content, as in
SGLang and vLLM when parsing fails. Arguments are strict JSON: a call whose arguments hold
NaN or Infinity (or a number too large for a float), a lone surrogate, or nesting too deep
to decode or encode is not a call. Unlike SGLang, calls to functions the request did not
offer are kept (the client sees what the model asked for); the request's tools only type
qwen3_coder's parameter values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from radixrt.errors import RequestError
from radixrt.server import tool_formats as tf
from radixrt.server import tool_formats_markup as tm
from radixrt.server.tool_formats import Parsed, ToolCall, Undecided, calls_of, tool_schemas

__all__ = ["TOOL_CALL_PARSERS", "Parsed", "StreamingToolParser", "ToolCall", "ToolCallFormat",
           "calls_from_constrained", "tool_choice_schema"]


@dataclass(frozen=True)
class ToolCallFormat:
    """How one model family writes calls in free text.

    A call region opens at the earliest of `openers`, or (only as
    the first non-blank text) at one of `bare_starts`; `close` says where it ends and `region`
    reads it (the contract is in tool_formats)."""

    openers: tuple[str, ...]
    close: tf.Closer
    region: tf.RegionParser
    bare_starts: tuple[str, ...] = ()

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> Parsed:
        """(content outside the calls, stripped; the calls). Same result as streaming text whole.
        tools: the request's OpenAI tools, which some formats use to type arguments."""
        stream = StreamingToolParser(self, tools)
        content, calls = stream.feed(text)
        rest, more = stream.finish()
        return Parsed(content + rest, calls + more)


def _tagged_json(begin: str, end: str) -> ToolCallFormat:
    return ToolCallFormat((begin,), tf.closed_by(begin, end), tf.tagged(begin, end, tf.one_json_call))


# Names as SGLang's --tool-call-parser. NOTE: in tagged formats (hermes, qwen25, qwen3_coder,
# deepseekv3, gpt-oss) the first end marker closes the block, so an argument string that holds
# the end marker leaves the block as content.
TOOL_CALL_PARSERS: MappingProxyType[str, ToolCallFormat] = MappingProxyType({
    "hermes": _tagged_json("<tool_call>", "</tool_call>"),
    "qwen25": _tagged_json("<tool_call>", "</tool_call>"),
    "llama3": ToolCallFormat((tf.LLAMA3_TAG,), tf.runs_to_end, tf.llama3_region, bare_starts=("{", "[")),
    "mistral": ToolCallFormat((tf.MISTRAL_TAG,), tf.runs_to_end, tf.mistral_region),
    "deepseekv3": ToolCallFormat((tf.DEEPSEEK_BEGIN,), tf.closed_by(tf.DEEPSEEK_BEGIN, tf.DEEPSEEK_END),
                                 tf.deepseekv3_region),
    "pythonic": ToolCallFormat((tm.PY_START, "["), tm.close_pythonic, tm.pythonic_region),
    "qwen3_coder": ToolCallFormat((tm.QWEN3_CODER_BEGIN,), tf.closed_by(tm.QWEN3_CODER_BEGIN, tm.QWEN3_CODER_END),
                                  tm.qwen3_coder_region),
    "gpt-oss": ToolCallFormat(tm.HARMONY_OPENERS, tm.close_harmony, tm.harmony_region),
})


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of text that is a proper start of marker (may become it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _first_opener(text: str, openers: tuple[str, ...]) -> int:
    """Where the earliest opener in text starts; -1 if none."""
    found = [i for m in openers if (i := text.find(m)) != -1]
    return min(found, default=-1)


class StreamingToolParser:
    """Finds calls in text that arrives in deltas; content comes out as soon as it cannot be
    part of a call. Concatenating every returned content gives parse()'s content (leading
    and trailing whitespace held back so the whole is stripped), and the calls are the same.

    Not thread-safe: one per stream."""

    def __init__(self, parser: str | ToolCallFormat, tools: list[dict[str, Any]] | None = None) -> None:
        self.fmt = TOOL_CALL_PARSERS[parser] if isinstance(parser, str) else parser
        self._schemas = tool_schemas(tools)
        self._buf = ""  # text not yet given out or decided
        self._in_region = False  # the buffer starts with an open call region
        self._at_start = True  # no non-blank text yet: a bare start may open a region
        self._blank = ""  # whitespace held back: given out only if content follows it
        self._started = False  # some content given out (so leading whitespace is no longer dropped)

    def feed(self, delta_text: str) -> Parsed:
        """(content safe to show now, calls completed by this delta)."""
        self._buf += delta_text
        out: list[str] = []
        calls: list[ToolCall] = []
        while self._step(out, calls):
            pass
        return Parsed(self._content(out), calls)

    def finish(self) -> Parsed:
        """Flush at the end of the text: an open region is decided now, as its format reads an
        unterminated region (most: content)."""
        out = [self._buf]
        calls: list[ToolCall] = []
        if self._in_region:
            found = self.fmt.region(self._buf, self._schemas)
            if found is not None:
                out, calls = [found.content], found.calls
        self._buf, self._in_region = "", False
        return Parsed(self._content(out), calls)

    def _step(self, out: list[str], calls: list[ToolCall]) -> bool:
        """Consume what can be decided from the buffer; True if another step may decide more."""
        fmt, buf = self.fmt, self._buf
        if not self._in_region:
            return self._open(out)
        end = fmt.close(buf)
        if end is Undecided.WAIT:
            return False
        if end is Undecided.NOT_CALL:  # the opener's first character is content; look again after it
            out.append(buf[:1])
            self._buf, self._in_region = buf[1:], False
            return True
        found = fmt.region(buf[:end], self._schemas)
        if found is None:
            out.append(buf[:end])
        else:
            out.append(found.content)
            calls += found.calls
        self._buf, self._in_region = buf[end:], False
        return True

    def _open(self, out: list[str]) -> bool:
        """Give out content up to the next region's opener; True if a region opened."""
        fmt, buf = self.fmt, self._buf
        if self._at_start and fmt.bare_starts:
            head = buf.lstrip()
            if not head:
                return False
            self._at_start = False
            if head.startswith(fmt.bare_starts):
                self._buf, self._in_region = head, True
                return True
        i = _first_opener(buf, fmt.openers)
        if i == -1:
            keep = max(_partial_suffix(buf, m) for m in fmt.openers)
            out.append(buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        out.append(buf[:i])
        self._buf, self._in_region, self._at_start = buf[i:], True, False
        return True

    def _content(self, pieces: list[str]) -> str:
        """Pieces of content as the next delta, holding back whitespace that may end the text."""
        text = self._blank + "".join(pieces)
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        self._blank = text[len(body):]
        self._started = self._started or bool(body)
        return body


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The tools' function objects by name; RequestError (param "tools") if malformed."""
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise RequestError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools[{i}].function.name must be a non-empty string", "tools")
        if name in functions:
            raise RequestError(f"tools[{i}]: function {name!r} is defined twice", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
        functions[name] = fn
    return functions


def _chosen(functions: dict[str, dict[str, Any]], tool_choice: Any) -> list[dict[str, Any]] | None:
    """The functions tool_choice allows the constrained output to call; None: not constrained."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if tool_choice == "required":
        if not functions:
            raise RequestError('tool_choice "required" needs at least one tool', "tools")
        return list(functions.values())
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise RequestError('tool_choice must be "none", "auto", "required" or '
                           '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in functions:
        raise RequestError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
    return [functions[name]]


def tool_choice_schema(tools: list[dict[str, Any]], tool_choice: Any, parallel_tool_calls: bool = True) -> str | None:
    """The JSON Schema (a JSON string) the output must match for tool_choice "required" or a
    named function: an array of one or more {"name": const, "parameters": that tool's schema}.
    None for "auto", "none" or None. Raises RequestError naming "tools" or "tool_choice".

    As in SGLang, maxItems 1 only when parallel_tool_calls is false, and each tool's $defs
    are lifted to the root, where their "#/$defs/..." references point."""
    chosen = _chosen(_functions(tools), tool_choice)
    if chosen is None:
        return None
    items, defs = [], {}
    for fn in chosen:
        params = fn.get("parameters") or {"type": "object"}
        own_defs = params.get("$defs")
        for key, sub in (own_defs.items() if isinstance(own_defs, dict) else ()):
            if defs.setdefault(key, sub) != sub:
                raise RequestError(f"tools define $defs {key!r} twice, differently", "tools")
        items.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return json.dumps(schema, ensure_ascii=False)


def calls_from_constrained(text: str) -> list[ToolCall]:
    """The calls in output constrained by tool_choice_schema. Raises ValueError if text is not
    such an array (e.g. cut short by max_tokens, or nested deeper than the decoder goes)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("constrained tool output is nested too deeply to decode") from None
    if not isinstance(value, list) or any(not isinstance(v, dict) or "parameters" not in v for v in value):
        raise ValueError("constrained tool output is not an array of {name, parameters} objects")
    calls = calls_of(value)
    if calls is None:
        raise ValueError("constrained tool output has a call without a name or strict JSON object parameters")
    return calls
