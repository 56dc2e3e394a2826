"""The tool-call parsers beyond hermes/qwen25/llama3: mistral, pythonic, deepseekv3, qwen3_coder and
gpt-oss (harmony), on the cases SGLang's parser tests cover (one call, several, text around them,
malformed calls left as content, nested arguments and strings holding markers, no call), and a
stream split at every character boundary agreeing with parse()."""

from __future__ import annotations

import json
import random

import pytest

from radixrt.settings.chat import TOOL_CALL_PARSERS as CONFIG_PARSERS
from radixrt.server.tool_calls import TOOL_CALL_PARSERS, StreamingToolParser, ToolCall

W = ("get_weather", {"city": "Paris", "unit": "°C"})
T = ("get_time", {})
NESTED = {"q": "a [b] {c} \"d\"", "opts": {"list": [1, [2, {"x": None}]], "ok": True}}

MISTRAL = {  # text -> (content, [(name, arguments)])
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}]': ("", [W]),
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}, {"name": "get_time", '
    '"arguments": {}}]': ("", [W, T]),
    'Let me look. [TOOL_CALLS] [{"name": "get_time", "arguments": {}}] Then more.': ("Let me look.  Then more.", [T]),
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "°C"}': ("", [W]),
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "°C"}[TOOL_CALLS]get_time[ARGS]{}': ("", [W, T]),
    f'[TOOL_CALLS] [{{"name": "search", "arguments": {json.dumps(NESTED)}}}]': ("", [("search", NESTED)]),
    '[TOOL_CALLS] [{"name": "s", "arguments": {"t": "[TOOL_CALLS] x ]"}}]': ("", [("s", {"t": "[TOOL_CALLS] x ]"})]),
    '[TOOL_CALLS] [{"name": "get_time", "arguments": {': ('[TOOL_CALLS] [{"name": "get_time", "arguments": {', []),
    '[TOOL_CALLS] [{"arguments": {}}]': ('[TOOL_CALLS] [{"arguments": {}}]', []),
    "[TOOL_CALLS]get_time[ARGS]not json": ("[TOOL_CALLS]get_time[ARGS]not json", []),
    "Just text with [brackets] and a partial [TOOL_": ("Just text with [brackets] and a partial [TOOL_", []),
}
PYTHONIC = {
    "[get_weather(city='Paris', unit='°C')]": ("", [W]),
    "[get_weather(city='Paris', unit=\"°C\"), get_time()]": ("", [W, T]),
    "Here's a call: [get_time()] and after.": ("Here's a call:  and after.", [T]),
    "<|python_start|>[get_time()]<|python_end|> Done.": ("Done.", [T]),
    "Mars first. <|python_start|>[get_weather(city='Paris', unit='°C')]": ("Mars first.", [W]),
    "[search(q='a [b] {c} \"d\"', opts={'list': [1, (2, {'x': None})], 'ok': True})]": ("", [("search", NESTED)]),
    "[f(n=-3, x=+2.5, s='it\\'s ]')]": ("", [("f", {"n": -3, "x": 2.5, "s": "it's ]"})]),
    "[get_weather(city=CITY)]": ("[get_weather(city=CITY)]", []),  # not a literal
    "[get_weather('Paris')]": ("[get_weather('Paris')]", []),  # positional
    "[get_weather(city='Paris'": ("[get_weather(city='Paris'", []),
    "[os.system(cmd='ls')]": ("[os.system(cmd='ls')]", []),
    "See [1] and [the docs](http://x) or [ ] [].": ("See [1] and [the docs](http://x) or [ ] [].", []),
    "No calls here.": ("No calls here.", []),
}
DS_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"
DS_W = DS_CALL.format("get_weather", '{"city": "Paris", "unit": "°C"}')
DS_T = DS_CALL.format("get_time", "{}")
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEKV3 = {
    f"{DS_BEGIN}{DS_W}{DS_END}": ("", [W]),
    f"{DS_BEGIN}{DS_W}\n{DS_T}{DS_END}": ("", [W, T]),
    f"I will check.{DS_BEGIN}{DS_T}{DS_END} Done.": ("I will check. Done.", [T]),
    f"{DS_BEGIN}{DS_W}": ("", [W]),  # the text ended before tool▁calls▁end
    f"{DS_BEGIN}{DS_CALL.format('search', json.dumps(NESTED))}{DS_END}": ("", [("search", NESTED)]),
    f"{DS_BEGIN}{DS_CALL.format('s', json.dumps({'t': '```<｜tool▁call▁end｜>'}))}{DS_END}":
        ("", [("s", {"t": "```<｜tool▁call▁end｜>"})]),
    f"{DS_BEGIN}{DS_CALL.format('get_time', '{oops}')}{DS_END}": (f"{DS_BEGIN}{DS_CALL.format('get_time', '{oops}')}{DS_END}", []),
    f"{DS_BEGIN}{DS_W}junk{DS_END}": (f"{DS_BEGIN}{DS_W}junk{DS_END}", []),
    f"cut {DS_BEGIN}<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{{":
        (f"cut {DS_BEGIN}<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{{", []),
    "Plain answer.": ("Plain answer.", []),
}
QC_W = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\n°C\n</parameter>\n" \
       "</function>\n</tool_call>"
QC_T = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
QWEN3_CODER = {
    QC_W: ("", [W]),
    f"{QC_W}\n{QC_T}": ("", [W, T]),
    f"Checking.\n{QC_T}\nDone.": ("Checking.\n\nDone.", [T]),
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=unit>\n°C\n</function>\n</tool_call>":
        ("", [W]),  # </parameter> left out
    "<tool_call><function=get_time></function><function=get_weather><parameter=city>Paris</parameter>"
    "<parameter=unit>°C</parameter></function></tool_call>": ("", [T, W]),
    "<tool_call>\n<function=write>\n<parameter=code>\nif a < b:\n    x = {\"k\": [1]}\n</parameter>\n</function>\n"
    "</tool_call>": ("", [("write", {"code": "if a < b:\n    x = {\"k\": [1]}"})]),
    "<tool_call>\n<function=get_time>\nstray text\n</function>\n</tool_call>":
        ("<tool_call>\n<function=get_time>\nstray text\n</function>\n</tool_call>", []),
    "<tool_call>no function</tool_call>": ("<tool_call>no function</tool_call>", []),
    "cut <tool_call>\n<function=get_time>\n": ("cut <tool_call>\n<function=get_time>", []),
    "No call <tool_": ("No call <tool_", []),
}
H_W = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>' \
      '{"city": "Paris", "unit": "°C"}<|call|>'
H_T = "<|start|>assistant<|channel|>commentary to=functions.get_time<|message|><|call|>"
H_THINK = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
GPT_OSS = {
    f"{H_THINK}{H_W}": ("", [W]),
    f"{H_THINK}{H_W}{H_T}": ("", [W, T]),
    f"{H_THINK}<|start|>assistant<|channel|>commentary<|message|>Checking now.<|end|>{H_T}": ("Checking now.", [T]),
    f"{H_THINK}<|start|>assistant<|channel|>final<|message|>It is 20 °C.<|return|>": ("It is 20 °C.", []),
    f"{H_THINK}<|start|>assistant<|channel|>final<|message|>It is 20 °C.": ("It is 20 °C.", []),
    f"{H_THINK}{H_W.removesuffix('<|call|>')}": ("", [W]),  # <|call|> trimmed as a stop token
    '<|channel|>commentary to=functions.search <|constrain|>json<|message|>' + json.dumps(NESTED) + "<|call|>":
        ("", [("search", NESTED)]),
    "<|channel|>commentary to=functions.get_time<|message|>{not json<|call|>":
        ("<|channel|>commentary to=functions.get_time<|message|>{not json<|call|>", []),
    "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>commentary to=browser.search<|message|>"
    '{"query": "x"}<|call|>': ('<|start|>assistant<|channel|>commentary to=browser.search<|message|>{"query": "x"}<|call|>', []),
    "Plain text, no harmony.": ("Plain text, no harmony.", []),
    "dangling <|start|>assistant": ("dangling <|start|>assistant", []),
}
CASES = [(p, t, e) for p, table in (("mistral", MISTRAL), ("pythonic", PYTHONIC), ("deepseekv3", DEEPSEEKV3),
                                     ("qwen3_coder", QWEN3_CODER), ("gpt-oss", GPT_OSS)) for t, e in table.items()]


def _summary(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _streamed(parser: str, pieces: list[str], tools: list | None = None) -> tuple[str, list[tuple[str, dict]]]:
    stream = StreamingToolParser(parser, tools)
    contents, calls = [], []
    for piece in pieces:
        content, new = stream.feed(piece)
        contents.append(content)
        calls += new
    content, new = stream.finish()
    return "".join(contents) + content, _summary(calls + new)


def test_config_names_every_parser() -> None:
    assert set(CONFIG_PARSERS) == set(TOOL_CALL_PARSERS)


@pytest.mark.parametrize("parser,text,expected", CASES)
def test_parse(parser: str, text: str, expected: tuple[str, list]) -> None:
    content, calls = TOOL_CALL_PARSERS[parser].parse(text)
    assert (content, _summary(calls)) == expected
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("parser,text,expected", CASES)
def test_stream_split_anywhere_matches_parse(parser: str, text: str, expected: tuple[str, list]) -> None:
    assert _streamed(parser, list(text)) == expected  # one character per delta
    for i in range(len(text) + 1):  # and every two-piece split
        assert _streamed(parser, [text[:i], text[i:]]) == expected, i


def test_streams_content_before_a_call_and_holds_the_call() -> None:
    stream = StreamingToolParser("pythonic")
    assert stream.feed("Weather [1] next: [get_weather(city=") == ("Weather [1] next:", [])
    content, calls = stream.feed("'Paris')] ok")
    assert content == "  ok" and _summary(calls) == [("get_weather", {"city": "Paris"})]
    stream = StreamingToolParser("gpt-oss")
    assert stream.feed(f"{H_THINK}<|start|>assistant<|channel|>final<|message|>It is") == ("It is", [])
    assert stream.feed(" warm.<|ret") == (" warm.", [])
    assert stream.feed("urn|>") == ("", []) and stream.finish() == ("", [])


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
    "o": {"type": "object"}, "a": {"type": "array"}, "opt": {"type": ["integer", "null"]}, "u": {},
    "big": {"type": "number"}, "bad": {"type": "integer"}, "nan": {"type": "number"}}}}}]
TYPED = {  # parameter -> (raw text, value with TOOLS)
    "s": ("123", "123"), "i": ("42", 42), "n": ("5", 5), "b": ("True", True), "o": ('{"k": [1, 2]}', {"k": [1, 2]}),
    "a": ("[1, 'two']", [1, "two"]), "opt": ("7", 7), "u": ("x", "x"), "big": ("2.5e3", 2500.0),
    "bad": ("forty", "forty"), "nan": ("nan", "nan"), "none": ("null", None), "extra": ("3", "3"),
}


def test_qwen3_coder_types_values_by_the_tools_schema() -> None:
    params = "".join(f"<parameter={k}>\n{raw}\n</parameter>\n" for k, (raw, _) in TYPED.items())
    text = f"<tool_call>\n<function=f>\n{params}</function>\n</tool_call>"
    want = ("", [("f", {k: v for k, (_, v) in TYPED.items()})])
    assert _summary(TOOL_CALL_PARSERS["qwen3_coder"].parse(text, TOOLS).calls) == want[1]
    assert _streamed("qwen3_coder", list(text), TOOLS) == want
    untyped = TOOL_CALL_PARSERS["qwen3_coder"].parse(text).calls  # without tools every value is a string
    assert _summary(untyped) == [("f", {k: (None if raw == "null" else raw) for k, (raw, _) in TYPED.items()})]


def test_malformed_tools_do_not_raise() -> None:
    text = "<tool_call><function=f><parameter=i>1</parameter></function></tool_call>"
    for tools in ([{"type": "function"}], [{"function": {"name": "f", "parameters": []}}], ["x"], []):
        assert _summary(TOOL_CALL_PARSERS["qwen3_coder"].parse(text, tools).calls) == [("f", {"i": "1"})]


FRAGMENTS = ["[TOOL_CALLS]", "[ARGS]", "[", "]", "(", ")", "{", "}", '"', "'", "\\", "=", ",", " ", "\n", "f", "x",
             "get_time", '{"name": "f", "arguments": {}}', "<|python_start|>", "<|python_end|>", DS_BEGIN, DS_END,
             "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "```json\n", "```", "<｜tool▁call▁end｜>", "<tool_call>",
             "</tool_call>", "<function=f>", "</function>", "<parameter=i>", "</parameter>", "<|start|>",
             "<|channel|>", "analysis", "final", "commentary to=functions.f", "<|message|>", "<|end|>", "<|call|>",
             "<|return|>", "null", "1e999", "-"]


@pytest.mark.parametrize("parser", sorted(TOOL_CALL_PARSERS))
def test_random_markup_never_raises_and_streams_as_parsed(parser: str) -> None:
    rng = random.Random(parser)
    for _ in range(150):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 14)))
        content, calls = TOOL_CALL_PARSERS[parser].parse(text, TOOLS)
        expected = (content, _summary(calls))
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert _streamed(parser, pieces, TOOLS) == expected, text
