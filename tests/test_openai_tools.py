"""OpenAI tools on /v1/chat/completions through the official client: tool_choice required and a
named function constrain the output to calls whose arguments validate against the tool's
schema; auto parses calls written in the --tool-call-parser format (the shared server runs
qwen25) and leaves plain text as content; streams send the same calls as deltas; a wrong
tool_choice is a 400 naming it."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import openai
import pytest

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo for three days?"}]


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    """The official client; every create() names the served model."""
    c = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    model = c.models.list().data[0].id
    create = c.chat.completions.create
    c.chat.completions.create = lambda **kw: create(model=model, **kw)
    return c


def _valid_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments, strict=False), SCHEMAS[c.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_required_and_named_tool_choice_return_valid_calls(client, choice):
    names = ("get_time",) if isinstance(choice, dict) else tuple(SCHEMAS)
    for temperature in (0, 1):
        r = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=200,
                                           temperature=temperature, seed=3, parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        assert not c.message.content
        _valid_calls(c.message.tool_calls, names)
    streamed = _stream(client, tool_choice=choice, temperature=0, parallel_tool_calls=False)
    r = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=200,
                                       temperature=0, parallel_tool_calls=False)
    assert streamed["finish"] == "tool_calls"
    assert streamed["calls"] == [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]


def _stream(client, **kw) -> dict:
    """Content, (name, arguments) calls and finish reason, gathered from a stream's deltas."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(messages=MESSAGES, tools=TOOLS, max_tokens=200, stream=True,
                                                **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            name, args = calls.get(t.index, ("", ""))
            calls[t.index] = (name + (t.function.name or ""), args + (t.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finish}


CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "oslo", "days": 3}}\n</tool_call>'


def test_auto_parses_calls_in_the_parser_format_and_keeps_plain_text(client):
    # The random model writes the parser's format only when told to: a regex (SGLang's extra field) makes it.
    forced = {"regex": "Sure\\. " + CALL_TEXT.replace("{", "\\{").replace("}", "\\}")}
    r = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0,
                                       extra_body=forced)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == \
        [("get_weather", {"city": "oslo", "days": 3})]
    streamed = _stream(client, temperature=0, extra_body=forced)
    assert streamed["finish"] == "tool_calls" and streamed["content"].strip() == "Sure."
    assert [(n, json.loads(a)) for n, a in streamed["calls"]] == [("get_weather", {"city": "oslo", "days": 3})]
    plain = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, max_tokens=12, temperature=0,
                                           extra_body={"regex": "[a-z ]{1,20}"})
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    assert plain.choices[0].finish_reason in ("stop", "length")
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "oslo", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    after = client.chat.completions.create(messages=history, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert after.choices[0].message.tool_calls is None
    # the chat template renders the tools (auto) and the call history into the prompt
    bare = client.chat.completions.create(messages=MESSAGES, max_tokens=1).usage.prompt_tokens
    with_tools = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, max_tokens=1).usage.prompt_tokens
    assert with_tools > bare + 20 and after.usage.prompt_tokens > bare


@pytest.mark.parametrize("choice,words", [
    ({"type": "function", "function": {"name": "no_such_tool"}}, "no_such_tool"),
    ("sometimes", "tool_choice"),
])
def test_a_wrong_tool_choice_is_a_400_naming_it(client, choice, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=4)
    assert words in str(e.value) and e.value.body["param"] == "tool_choice"
    assert client.chat.completions.create(messages=MESSAGES, max_tokens=2).choices[0].message.content is not None


def test_chat_template_override_and_parser_names_are_checked_at_start(tmp_path, llama_path):
    from types import SimpleNamespace

    from support.helpers import tokenizer
    from radixrt.config import ServerArgs
    from radixrt.frontend.text_bound import TextBound
    from radixrt.server.openai_api import _chat_ids
    from radixrt.server.schemas import ChatCompletionRequest

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    args = ServerArgs(model_path=str(llama_path), chat_template=str(template))
    intake = SimpleNamespace(tokenizer=tokenizer(llama_path), text_bound=TextBound(4096, 16))
    ctx = SimpleNamespace(args=args, intake=intake)
    body = msgspec.convert({"messages": [{"role": "user", "content": "hi there"}]}, ChatCompletionRequest)
    assert tokenizer(llama_path).decode(_chat_ids(ctx, body, None)) == "[user]hi there"
    with pytest.raises(ValueError, match="chat_template"):
        ServerArgs(model_path=str(llama_path), chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerArgs(model_path=str(llama_path), tool_call_parser="mystery")


def test_with_tools_the_answer_keeps_special_tokens(client, llama_path):
    """SGLang's rule: tools offered (tool_choice not "none") turn skip_special_tokens off, since
    some formats' call markers are special tokens; without tools they are skipped as usual."""
    from support.helpers import tokenizer

    special = tokenizer(llama_path).convert_tokens_to_ids("<|im_start|>")
    forced = {"logit_bias": {str(special): 100}, "ignore_eos": True}
    kw = {"messages": MESSAGES, "max_tokens": 2, "temperature": 0, "extra_body": forced}
    assert client.chat.completions.create(tools=TOOLS, **kw).choices[0].message.content == "<|im_start|>" * 2
    assert client.chat.completions.create(tools=TOOLS, tool_choice="none", **kw).choices[0].message.content == ""
    assert client.chat.completions.create(**kw).choices[0].message.content == ""
