"""Tool-call formats whose calls are not JSON call objects: pythonic (Python call syntax),
qwen3_coder (XML-like parameters) and gpt-oss (harmony messages). Each is a Closer and a
RegionParser as tool_formats describes, pure functions on text that never raise on it.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Mapping
from typing import Any

from radixrt.server.tool_formats import (
    Parsed, ToolCall, ToolSchemas, Undecided, calls_of, decode_json, skip_ws, strict_json, tagged
)

# --- pythonic: [get_weather(city="Paris"), get_time()] -------------------------------------------
# Llama 4 may wrap the list in <|python_start|> ... <|python_end|>; with them or bare, the list
# may stand anywhere in the text. Arguments are keywords with literal values only.

PY_START, PY_END = "<|python_start|>", "<|python_end|>"
_PY_SCAN = re.compile(r"[\[\]'\"\\]")  # what bracket matching must look at


def _call_head(text: str, pos: int) -> bool | None:
    """Whether the text at pos starts `name(` (None: too short to tell)."""
    i = skip_ws(text, pos)
    if i < len(text) and not (text[i].isalpha() or text[i] == "_"):
        return False
    while i < len(text) and (text[i].isalnum() or text[i] == "_"):
        i += 1
    i = skip_ws(text, i)
    return None if i == len(text) else text[i] == "("


def _bracket_end(text: str, pos: int) -> int | None:
    """The index after the "]" matching the "[" at pos, skipping Python strings; None: not yet."""
    depth, quote, i = 0, None, pos
    while (m := _PY_SCAN.search(text, i)) is not None:
        c, i = m.group(), m.end()
        if quote is not None:
            if c == "\\":
                i += 1  # the escaped character, whatever it is
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
            if depth == 0:
                return i
    return None


def close_pythonic(text: str) -> int | Undecided:
    """A `[name(` list up to its matching "]" (and a <|python_end|> after it, if it opened with
    <|python_start|>). NOT_CALL as soon as the text after "[" cannot be `name(`, so that a "["
    in prose ("[1]", "[link](url)") holds nothing back for long."""
    pos = skip_ws(text, len(PY_START)) if text.startswith(PY_START) else 0
    if pos == len(text):
        return Undecided.WAIT
    head = _call_head(text, pos + 1) if text[pos] == "[" else False
    end = _bracket_end(text, pos) if head else None
    if head is False:
        return Undecided.NOT_CALL
    if end is None:
        return Undecided.WAIT
    if pos == 0:
        return end
    gap = skip_ws(text, end)
    if text.startswith(PY_END, gap):
        return gap + len(PY_END)
    return Undecided.WAIT if PY_END.startswith(text[gap:]) else end


class _NotLiteral(Exception):
    pass


def _literal(node: ast.expr) -> Any:
    """The JSON value of a literal: str, number, True/False/None, list or tuple, dict with string
    keys. Raises _NotLiteral for anything else (names, calls, operators)."""
    if isinstance(node, ast.Constant) and (node.value is None or type(node.value) in (str, int, float, bool)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and type(k.value) is str for k in node.keys):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore[union-attr]
    raise _NotLiteral


def _pythonic_calls(node: ast.expr) -> list[ToolCall] | None:
    if not isinstance(node, ast.List) or not node.elts:
        return None
    calls: list[ToolCall] = []
    for call in node.elts:
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args \
                or any(kw.arg is None for kw in call.keywords):  # positional or **spread: not a call
            return None
        found = calls_of({"name": call.func.id, "arguments": {kw.arg: _literal(kw.value) for kw in call.keywords}})
        if found is None:
            return None
        calls += found
    return calls


def pythonic_region(text: str, schemas: ToolSchemas) -> Parsed | None:
    body = text.removeprefix(PY_START).strip().removesuffix(PY_END)
    try:
        calls = _pythonic_calls(ast.parse(body.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError, MemoryError, _NotLiteral):
        return None
    return Parsed("", calls) if calls else None


# --- qwen3_coder: <tool_call><function=NAME><parameter=P>value</parameter></function></tool_call> ---
# Values are raw text, typed by the request's tool schema as SGLang does (without tools, or for a
# parameter the schema does not name, a value is a string). A value ends at </parameter>, or at
# the next <parameter= or </function> when the model left </parameter> out.

QWEN3_CODER_BEGIN, QWEN3_CODER_END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
_FUNCTION_END, _PARAMETER_END = "</function>", "</parameter>"
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INT_TYPES = ("int", "uint", "long", "short", "unsigned")
_JSON_TYPES = ("object", "array", "arr", "dict", "list")


def _type_name(schema: Any) -> str:
    """The schema's type, lowercased; the first non-null one of a list; "string" if none."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if isinstance(k, str) and k != "null"), None)
    return kind.strip().lower() if isinstance(kind, str) else "string"


def _number(raw: str) -> Any:
    """int when written without "." or exponent, else float; raw when not a finite number."""
    try:
        if "." not in raw and "e" not in raw.lower():
            return int(raw)
    except ValueError:
        pass
    try:
        value = float(raw)
    except ValueError:
        return raw
    return value if math.isfinite(value) else raw


def _typed_value(raw: str, schema: Any) -> Any:
    """A parameter's raw text as the type its schema gives; raw when it does not convert."""
    if raw.lower() == "null":
        return None
    kind = _type_name(schema)
    if schema is None or kind in _STRING_TYPES:
        return raw
    if kind.startswith(_INT_TYPES):
        try:
            return int(raw)
        except ValueError:
            return raw
    if kind.startswith(("num", "float")):
        return _number(raw)
    if kind in ("boolean", "bool", "binary"):
        return raw.lower() == "true"  # as SGLang: anything but "true" is false
    if kind.startswith(_JSON_TYPES):
        decoded = decode_json(raw.strip(), 0)
        if decoded is not None and decoded[1] == len(raw.strip()) and strict_json(decoded[0]) is not None:
            return decoded[0]
    try:
        value = ast.literal_eval(raw)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return raw
    return value if strict_json(value) is not None else raw


def _parameters(text: str, props: Mapping[str, Any]) -> dict[str, Any] | None:
    """A function body's parameters, typed by props; None if anything else is in it."""
    args: dict[str, Any] = {}
    pos = 0
    while (m := _PARAMETER.match(text, pos)) is not None:
        ends = [j for j in (text.find(_PARAMETER_END, m.end()), text.find("<parameter=", m.end())) if j != -1]
        stop = min(ends, default=len(text))
        raw = text[m.end():stop]
        raw = raw.removeprefix("\n").removesuffix("\n")  # the template puts values on their own lines
        name = m[1].strip()
        args[name] = _typed_value(raw, props.get(name))
        pos = stop + len(_PARAMETER_END) if text.startswith(_PARAMETER_END, stop) else stop
    return args if not text[pos:].strip() else None


def qwen3_coder_body(body: str, schemas: ToolSchemas) -> list[ToolCall] | None:
    """The <function=...> calls in one <tool_call> block; None unless the block is calls only."""
    calls: list[ToolCall] = []
    pos = 0
    while (m := _FUNCTION.match(body, pos)) is not None:
        name = m[1].strip()
        end = body.find(_FUNCTION_END, m.end())
        stop = len(body) if end == -1 else end
        args = _parameters(body[m.end():stop], schemas.get(name, {}))
        found = calls_of({"name": name, "arguments": args}) if args is not None else None
        if found is None:
            return None
        calls += found
        pos = stop if end == -1 else end + len(_FUNCTION_END)
    return calls if calls and not body[pos:].strip() else None


qwen3_coder_region = tagged(QWEN3_CODER_BEGIN, QWEN3_CODER_END, qwen3_coder_body)


# --- gpt-oss (harmony): [<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT][<|constrain|>json]<|message|>BODY<|end|> ---
# A message to=functions.NAME is a call (BODY: JSON arguments, ended by <|call|> or by the end
# of the text, as <|call|> is a stop token). The analysis channel is reasoning, dropped here (the
# reasoning parser, when configured, takes it first). Any other message's body is content and
# streams as it comes: its header is a region of its own, and the end markers are dropped.
# A message to another recipient (built-in browser or python tools) stays content, markup and all.

HARMONY_START, HARMONY_CHANNEL, HARMONY_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
HARMONY_OPENERS = (HARMONY_START, HARMONY_CHANNEL) + HARMONY_ENDS
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def _header(head: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of a message header (the text before <|message|>)."""
    channel, recipient = _CHANNEL.search(head), _RECIPIENT.search(head)
    return (channel[1] if channel else None), (recipient[1] if recipient else None)


def _body_is_content(head: str) -> bool:
    channel, recipient = _header(head)
    return recipient is None and channel != "analysis"


def close_harmony(text: str) -> int | Undecided:
    """An end marker alone; a content message's header; any other message through its end marker."""
    for end in HARMONY_ENDS:
        if text.startswith(end):
            return len(end)
    m = text.find(HARMONY_MESSAGE)
    if m == -1:
        return Undecided.WAIT
    body = m + len(HARMONY_MESSAGE)
    if _body_is_content(text[:m]):
        return body
    ends = [j + len(e) for e in HARMONY_ENDS if (j := text.find(e, body)) != -1]
    return min(ends) if ends else Undecided.WAIT  # min: the first end marker


def harmony_region(text: str, schemas: ToolSchemas) -> Parsed | None:
    m = text.find(HARMONY_MESSAGE)
    if text in HARMONY_ENDS or (m != -1 and _body_is_content(text[:m])):
        return Parsed("", [])  # a dropped end marker, or a header whose body follows as content
    if m == -1:
        return None
    recipient = _header(text[:m])[1]
    if recipient is None:
        return Parsed("", [])  # analysis: reasoning, not content
    body = text[m + len(HARMONY_MESSAGE):]
    for end in HARMONY_ENDS:
        body = body.removesuffix(end)
    if not recipient.startswith("functions."):
        return None
    decoded = decode_json(body, skip_ws(body, 0)) if body.strip() else ({}, len(body))
    if decoded is None or body[decoded[1]:].strip():
        return None
    found = calls_of({"name": recipient.removeprefix("functions."), "arguments": decoded[0]})
    return Parsed("", found) if found else None
