"""Tool-call parsing (hermes, qwen25, llama3; whole and streamed) and the tool_choice schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from radixrt.errors import RequestError
from radixrt.server.tool_calls import (
    TOOL_CALL_PARSERS, StreamingToolParser, ToolCall, calls_from_constrained, tool_choice_schema
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}'
TIME = '{"name": "get_time", "arguments": {}}'
TAGGED = {  # text -> (content, [(name, arguments dict)])
    f"<tool_call>\n{WEATHER}\n</tool_call>": ("", [("get_weather", {"city": "Paris", "unit": "°C"})]),
    f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>":
        ("", [("get_weather", {"city": "Paris", "unit": "°C"}), ("get_time", {})]),
    f"Let me check.\n<tool_call>\n{TIME}\n</tool_call>\nDone. ": ("Let me check.\n\nDone.", [("get_time", {})]),
    '<tool_call>\n{"name": "x", "arguments": {</tool_call> after': ('<tool_call>\n{"name": "x", "arguments": {</tool_call> after', []),
    '<tool_call>{"arguments": {}}</tool_call>': ('<tool_call>{"arguments": {}}</tool_call>', []),
    f"A <tool_call>{TIME}</tool_call> B <tool_call>not json</tool_call>":
        ("A  B <tool_call>not json</tool_call>", [("get_time", {})]),
    "  Just an answer, no <tool_ tags. ": ("Just an answer, no <tool_ tags.", []),
    f"cut short <tool_call>{TIME}": (f"cut short <tool_call>{TIME}", []),
    "ends in a partial <tool_ca": ("ends in a partial <tool_ca", []),
}
LLAMA_A = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_B = '{"name": "get_time", "parameters": {"tz": "UTC"}}'
LLAMA3 = {
    LLAMA_A: ("", [("get_weather", {"city": "Paris"})]),
    f"<|python_tag|>{LLAMA_A}; {LLAMA_B}": ("", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]),
    f"{LLAMA_A};{LLAMA_B}": ("", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]),
    f"[{LLAMA_A}, {LLAMA_B}]": ("", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]),
    f"Calling it now. <|python_tag|>{LLAMA_A}": ("Calling it now.", [("get_weather", {"city": "Paris"})]),
    f"\n{LLAMA_A}; then some words": ("then some words", [("get_weather", {"city": "Paris"})]),
    '{"name": "get_weather", "parameters": {"city": ': ('{"name": "get_weather", "parameters": {"city":', []),
    '{"city": "Paris"}': ('{"city": "Paris"}', []),
    "The answer is 4; {no call} here.": ("The answer is 4; {no call} here.", []),
    "partial tag <|python_": ("partial tag <|python_", []),
}
CASES = [("hermes", t, e) for t, e in TAGGED.items()] + [("qwen25", t, e) for t, e in TAGGED.items()] \
    + [("llama3", t, e) for t, e in LLAMA3.items()]


def _summary(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parser,text,expected", CASES)
def test_parse(parser: str, text: str, expected: tuple[str, list]) -> None:
    content, calls = TOOL_CALL_PARSERS[parser].parse(text)
    assert (content, _summary(calls)) == expected
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert len({c.id for c in calls}) == len(calls)
    assert all("\\u" not in c.arguments for c in calls)  # ensure_ascii=False: "°C" stays as is


@pytest.mark.parametrize("parser,text,expected", CASES)
@pytest.mark.parametrize("chunk", range(1, 8))
def test_streaming_matches_parse(parser: str, text: str, expected: tuple[str, list], chunk: int) -> None:
    stream = StreamingToolParser(parser)
    contents, calls = [], []
    for i in range(0, len(text), chunk):
        content, new = stream.feed(text[i:i + chunk])
        contents.append(content)
        calls += new
    content, new = stream.finish()
    assert ("".join(contents) + content, _summary(calls + new)) == expected


def test_streaming_shows_content_early_and_holds_markers() -> None:
    stream = StreamingToolParser("hermes")
    assert stream.feed("Hello <tool_") == ("Hello", [])  # the space may end the text; the tag may start a call
    assert stream.feed("call>{") == ("", [])
    content, calls = stream.feed(f'"name": "f", "arguments": {{}}}}</tool_call> bye')
    assert content == "  bye" and [c.name for c in calls] == ["f"]
    assert stream.finish() == ("", [])


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]


def test_required_schema_validates_calls() -> None:
    schema = json.loads(tool_choice_schema(TOOLS, "required"))
    assert schema["minItems"] == 1 and "maxItems" not in schema
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}},
                         {"name": "get_time", "parameters": {}}], schema)
    for bad in ([], [{"name": "get_wether", "parameters": {"city": "Paris"}}],
                [{"name": "get_weather", "parameters": {}}], [{"name": "get_time"}],
                [{"name": "get_time", "parameters": {}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_named_schema_allows_only_that_tool() -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    schema = json.loads(tool_choice_schema(TOOLS, choice))
    jsonschema.validate([{"name": "get_time", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}}], schema)
    one = json.loads(tool_choice_schema(TOOLS, choice, parallel_tool_calls=False))
    assert one["maxItems"] == 1


def test_schema_lifts_defs_to_root() -> None:
    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"],
              "$defs": {"P": {"type": "integer"}}}
    schema = json.loads(tool_choice_schema([{"type": "function", "function": {"name": "f", "parameters": params}}],
                                           "required"))
    jsonschema.validate([{"name": "f", "parameters": {"p": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": "three"}}], schema)


@pytest.mark.parametrize("choice", ["auto", "none", None])
def test_unconstrained_choices(choice: str | None) -> None:
    assert tool_choice_schema(TOOLS, choice) is None
    assert tool_choice_schema([], choice) is None


@pytest.mark.parametrize("tools,choice,param", [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (TOOLS, {"type": "tool", "function": {"name": "get_time"}}, "tool_choice"),
    (TOOLS, ["required"], "tool_choice"),
    ([], "required", "tools"),
    ([{"type": "function", "function": {}}], "required", "tools"),
    ([{"type": "retrieval", "function": {"name": "f"}}], "auto", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "required", "tools"),
    (TOOLS + TOOLS[:1], "required", "tools"),
])
def test_bad_tools_or_choice(tools: list, choice: object, param: str) -> None:
    with pytest.raises(RequestError) as e:
        tool_choice_schema(tools, choice)
    assert e.value.param == param and e.value.status == 400


def test_unknown_named_function_is_named() -> None:
    with pytest.raises(RequestError, match="nope"):
        tool_choice_schema(TOOLS, {"type": "function", "function": {"name": "nope"}})


def test_calls_from_constrained_round_trip() -> None:
    array = [{"name": "get_weather", "parameters": {"city": "Zürich"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(array, json.loads(tool_choice_schema(TOOLS, "required")))
    calls = calls_from_constrained(json.dumps(array))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(a["name"], a["parameters"]) for a in array]
    assert "Zürich" in calls[0].arguments
    for bad in ('[{"name": "get_time", "parameters": {}}', "[]", '{"name": "f", "parameters": {}}',
                '[{"name": "f"}]', '[{"parameters": {}}]'):
        with pytest.raises(ValueError):
            calls_from_constrained(bad)
