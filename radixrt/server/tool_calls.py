"""Tool calls: finding them in a model's text, and constraining the text to be them.

Two ways a chat answer carries calls, as in SGLang:

- tool_choice "auto": the model writes calls in its own format inside free text, and a
  parser named by --tool-call-parser (TOOL_CALL_PARSERS) takes them out. hermes and qwen25
  wrap each call in <tool_call>...</tool_call>; llama3 writes bare JSON objects joined by
  ";", after an optional <|python_tag|>. StreamingToolParser does the same on a stream of
  deltas, holding back what may still become a call.
- tool_choice "required" or a named function: the output is constrained by
  tool_choice_schema to a JSON array of {"name", "parameters"} objects, which
  calls_from_constrained reads back.

Parsing never raises on model text: whatever is not a well-formed call stays content, as in
SGLang and vLLM when parsing fails. Arguments are strict JSON: a call whose arguments hold
NaN or Infinity (or a number too large for a float), a lone surrogate, or nesting too deep
to decode or encode is not a call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

from radixrt.errors import RequestError

_JSON = json.JSONDecoder()
_WHITESPACE = " \t\r\n"


def _new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, serialized (OpenAI sends arguments as a string)
    id: str = field(default_factory=_new_call_id)


class Parsed(NamedTuple):
    content: str  # the text outside the calls
    calls: list[ToolCall]


def _calls_of(value: Any) -> list[ToolCall] | None:
    """The calls in one decoded JSON value (an object, or an array of them); None unless all are calls.

    A call is {"name": non-empty string, "arguments" or "parameters": object (default {})}."""
    objs = value if isinstance(value, list) else [value]
    calls = []
    for obj in objs:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        encoded = _strict_json(args) if isinstance(args, dict) else None
        if encoded is None or _strict_json(obj["name"]) is None:
            return None
        calls.append(ToolCall(obj["name"], encoded))
    return calls or None


def _strict_json(value: Any) -> str | None:
    """value as strict JSON text that encodes as UTF-8 (what a client's JSON parser takes), or None:
    NaN or Infinity (allow_nan=False; 1e999 reads as Infinity), a lone surrogate, too deep to encode."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return None
    return text


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def _decode_calls(body: str, separator: str | None) -> tuple[list[ToolCall], str]:
    """Calls decoded from the start of body, one JSON value after another joined by separator
    (None: one value only); stops at the first value that is not a call. Returns the calls
    and the undecoded rest of body."""
    calls: list[ToolCall] = []
    pos = 0
    while True:
        start = _skip_ws(body, pos)
        try:
            value, end = _JSON.raw_decode(body, start)
        except (json.JSONDecodeError, RecursionError):  # not JSON, or nested deeper than the decoder goes
            return calls, body[pos:]
        found = _calls_of(value)
        if found is None:
            return calls, body[pos:]
        calls += found
        pos = _skip_ws(body, end)
        if separator is None or not body.startswith(separator, pos):
            return calls, body[pos:]
        pos += len(separator)


@dataclass(frozen=True)
class ToolCallFormat:
    """How one model family writes calls in free text.

    A call region opens with `begin`, or (only as the first non-blank text) with one of
    `bare_starts`, and closes with `end`; with no `end` it runs to the end of the text.
    Inside, JSON call objects are joined by `separator` (None: exactly one per region)."""

    begin: str
    end: str | None
    bare_starts: tuple[str, ...] = ()
    separator: str | None = None

    def parse(self, text: str) -> Parsed:
        """(content outside the calls, stripped; the calls). Same result as streaming text whole."""
        stream = StreamingToolParser(self)
        content, calls = stream.feed(text)
        rest, more = stream.finish()
        return Parsed(content + rest, calls + more)

    def region(self, body: str) -> Parsed | None:
        """The calls in a region's body (markers removed) and content left over; None: not calls."""
        calls, rest = _decode_calls(body, self.separator)
        if not calls or (self.end is not None and rest.strip()):
            return None  # a tagged block is one call or nothing
        return Parsed(rest, calls)


# Names as SGLang's --tool-call-parser. NOTE: in tagged formats the first end marker closes
# the block, so an argument string that contains "</tool_call>" leaves the block as content.
TOOL_CALL_PARSERS: MappingProxyType[str, ToolCallFormat] = MappingProxyType({
    "hermes": ToolCallFormat("<tool_call>", "</tool_call>"),
    "qwen25": ToolCallFormat("<tool_call>", "</tool_call>"),
    "llama3": ToolCallFormat("<|python_tag|>", None, bare_starts=("{", "["), separator=";"),
})


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of text that is a proper start of marker (may become it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class StreamingToolParser:
    """Finds calls in text that arrives in deltas; content comes out as soon as it cannot be
    part of a call. Concatenating every returned content gives parse()'s content (leading
    and trailing whitespace held back so the whole is stripped), and the calls are the same.

    Not thread-safe: one per stream."""

    def __init__(self, parser: str | ToolCallFormat) -> None:
        self.fmt = TOOL_CALL_PARSERS[parser] if isinstance(parser, str) else parser
        self._buf = ""  # text not yet given out or decided
        self._marker_len: int | None = None  # inside a region: length of its opening marker
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
        """Flush at the end of the text: an open region is decided now (unterminated: content)."""
        out = [self._buf]
        calls: list[ToolCall] = []
        if self._marker_len is not None and self.fmt.end is None:
            found = self.fmt.region(self._buf[self._marker_len:])
            if found is not None:
                out, calls = [found.content], found.calls
        self._buf, self._marker_len = "", None
        return Parsed(self._content(out), calls)

    def _step(self, out: list[str], calls: list[ToolCall]) -> bool:
        """Consume what can be decided from the buffer; True if another step may decide more."""
        fmt, buf = self.fmt, self._buf
        if self._marker_len is None:
            if self._at_start and fmt.bare_starts:
                head = buf.lstrip()
                if not head:
                    return False
                self._at_start = False
                if head.startswith(fmt.bare_starts):
                    self._buf, self._marker_len = head, 0
                    return True
            i = buf.find(fmt.begin)
            if i == -1:
                keep = _partial_suffix(buf, fmt.begin)
                out.append(buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return False
            out.append(buf[:i])
            self._buf, self._marker_len, self._at_start = buf[i:], len(fmt.begin), False
            return True
        if fmt.end is None:
            return False  # the region runs to the end of the text: decided in finish()
        j = buf.find(fmt.end, self._marker_len)
        if j == -1:
            return False
        found = fmt.region(buf[self._marker_len:j])
        if found is None:
            out.append(buf[:j + len(fmt.end)])
        else:
            out.append(found.content)
            calls += found.calls
        self._buf, self._marker_len = buf[j + len(fmt.end):], None
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
    calls = _calls_of(value)
    if calls is None:
        raise ValueError("constrained tool output has a call without a name or strict JSON object parameters")
    return calls
