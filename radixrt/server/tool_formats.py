"""How model families write tool calls in free text: the contract a format meets, and the
formats whose arguments are JSON (hermes/qwen25, llama3, mistral, deepseekv3).

A format (tool_calls.ToolCallFormat) is the markers that open a call region plus two pure
functions on text:

- a Closer reads a region from its opening marker and gives its length once it has ended,
  or WAIT (it may end later: hold it back), or NOT_CALL (the opener starts no region: its
  first character is content, and the search goes on after it);
- a RegionParser reads a whole region (markers included; at the end of the text possibly
  unterminated) into its calls and the content left over, or None: the region is content.

Both must be prefix-stable, so that a stream split anywhere decides as the whole text does:
a closer that gives a length or NOT_CALL for some text gives the same for every text that
extends it. Neither raises on model text.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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


class Undecided(enum.Enum):
    """A closer's answer while a region's length is not known."""

    WAIT = "wait"  # the region may still end: hold it back
    NOT_CALL = "not a call"  # the opener starts no region: its first character is content


ToolSchemas = Mapping[str, Mapping[str, Any]]  # function name -> its parameters' "properties"
Closer = Callable[[str], "int | Undecided"]
RegionParser = Callable[[str, ToolSchemas], "Parsed | None"]


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    """Each function's parameter properties by name, from a request's OpenAI `tools` (None: none).
    Entries that are not well-formed function tools are skipped: parsing never raises."""
    schemas: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            schemas[fn["name"]] = props if isinstance(props, dict) else {}
    return schemas


def strict_json(value: Any) -> str | None:
    """value as strict JSON text that encodes as UTF-8 (what a client's JSON parser takes), or None:
    NaN or Infinity (allow_nan=False; 1e999 reads as Infinity), a lone surrogate, too deep to
    encode, or not JSON at all (a set, bytes)."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except (ValueError, TypeError, RecursionError):  # UnicodeEncodeError is a ValueError
        return None
    return text


def calls_of(value: Any) -> list[ToolCall] | None:
    """The calls in one decoded value (an object, or a list of them); None unless all are calls.

    A call is {"name": non-empty string, "arguments" or "parameters": object (default {})}."""
    objs = value if isinstance(value, list) else [value]
    calls = []
    for obj in objs:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        encoded = strict_json(args) if isinstance(args, dict) else None
        if encoded is None or strict_json(obj["name"]) is None:
            return None
        calls.append(ToolCall(obj["name"], encoded))
    return calls or None


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def decode_json(text: str, pos: int) -> tuple[Any, int] | None:
    """(the JSON value starting at pos, the index after it), or None: not JSON there, or nested
    deeper than the decoder goes."""
    try:
        return _JSON.raw_decode(text, pos)
    except (json.JSONDecodeError, RecursionError):
        return None


def decode_calls(body: str, separator: str | None) -> tuple[list[ToolCall], str]:
    """Calls decoded from the start of body, one JSON value after another joined by separator
    (None: one value only); stops at the first value that is not a call. Returns the calls
    and the undecoded rest of body."""
    calls: list[ToolCall] = []
    pos = 0
    while True:
        decoded = decode_json(body, skip_ws(body, pos))
        found = calls_of(decoded[0]) if decoded is not None else None
        if decoded is None or found is None:
            return calls, body[pos:]
        calls += found
        pos = skip_ws(body, decoded[1])
        if separator is None or not body.startswith(separator, pos):
            return calls, body[pos:]
        pos += len(separator)


def runs_to_end(text: str) -> Undecided:
    """Closer of a region that runs to the end of the text (decided when the stream finishes)."""
    return Undecided.WAIT


def closed_by(begin: str, end: str) -> Closer:
    """Closer of a region `begin ... end`: the first `end` after `begin` closes it.
    NOTE: string-blind, so an argument string holding `end` closes the region early."""
    def close(text: str) -> int | Undecided:
        j = text.find(end, len(begin))
        return Undecided.WAIT if j == -1 else j + len(end)
    return close


def tagged(begin: str, end: str, body: Callable[[str, ToolSchemas], list[ToolCall] | None]) -> RegionParser:
    """Parser of a region `begin body end` that is calls and nothing else (unterminated: content)."""
    def region(text: str, schemas: ToolSchemas) -> Parsed | None:
        if len(text) < len(begin) + len(end) or not text.endswith(end):
            return None
        calls = body(text[len(begin):len(text) - len(end)], schemas)
        return Parsed("", calls) if calls else None
    return region


def one_json_call(body: str, schemas: ToolSchemas) -> list[ToolCall] | None:
    """hermes / qwen25: a tagged block holds one JSON call object and nothing else."""
    calls, rest = decode_calls(body, None)
    return calls if calls and not rest.strip() else None


def llama3_region(text: str, schemas: ToolSchemas) -> Parsed | None:
    """llama3: JSON calls joined by ";", after <|python_tag|> or as the whole text; what follows
    the last call is content."""
    calls, rest = decode_calls(text.removeprefix(LLAMA3_TAG), ";")
    return Parsed(rest, calls) if calls else None


LLAMA3_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
_MISTRAL_COMPACT = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*\[ARGS\]")  # [TOOL_CALLS]name[ARGS]{...}


def _mistral_calls(text: str, pos: int) -> tuple[list[ToolCall] | None, int]:
    """The calls after one [TOOL_CALLS] at pos: a JSON array (or object) of call objects, or the
    compact `name[ARGS]{arguments}`; (None, pos) if neither. Also returns the index after them."""
    start = skip_ws(text, pos)
    if text.startswith(("[", "{"), start):
        decoded = decode_json(text, start)
        return (calls_of(decoded[0]), decoded[1]) if decoded is not None else (None, pos)
    m = _MISTRAL_COMPACT.match(text, pos)
    decoded = decode_json(text, skip_ws(text, m.end())) if m is not None else None
    if m is None or decoded is None:
        return None, pos
    return calls_of({"name": m[1], "arguments": decoded[0]}), decoded[1]


def mistral_region(text: str, schemas: ToolSchemas) -> Parsed | None:
    """mistral: `[TOOL_CALLS] [{call}, ...]`, or `[TOOL_CALLS]name[ARGS]{...}` once per call;
    what follows the last call is content."""
    calls: list[ToolCall] = []
    end = 0
    while text.startswith(MISTRAL_TAG, pos := skip_ws(text, end)):
        found, after = _mistral_calls(text, pos + len(MISTRAL_TAG))
        if found is None:
            break
        calls += found
        end = after
    return Parsed(text[end:], calls) if calls else None


DEEPSEEK_BEGIN, DEEPSEEK_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
# <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{arguments}\n```<｜tool▁call▁end｜>
_DEEPSEEK_CALL = re.compile(r"\s*<｜tool▁call▁begin｜>[^<]*<｜tool▁sep｜>\s*([^\s<`]+)\s*```json")
_DEEPSEEK_CALL_END = re.compile(r"\s*```\s*<｜tool▁call▁end｜>")


def deepseekv3_region(text: str, schemas: ToolSchemas) -> Parsed | None:
    """deepseekv3: calls, each with a ```json block of arguments, between tool▁calls▁begin and
    tool▁calls▁end. A closed block must be calls only; an unterminated one (the text ended)
    keeps its whole calls, and the rest is content."""
    calls: list[ToolCall] = []
    pos = len(DEEPSEEK_BEGIN)
    while (head := _DEEPSEEK_CALL.match(text, pos)) is not None:
        decoded = decode_json(text, skip_ws(text, head.end()))
        tail = _DEEPSEEK_CALL_END.match(text, decoded[1]) if decoded is not None else None
        found = calls_of({"name": head[1], "arguments": decoded[0]}) if tail is not None else None
        if found is None:
            break
        calls += found
        pos = tail.end()
    if text.endswith(DEEPSEEK_END):
        rest = text[pos:len(text) - len(DEEPSEEK_END)]
        return Parsed("", calls) if calls and not rest.strip() else None
    return Parsed(text[pos:], calls) if calls else None
