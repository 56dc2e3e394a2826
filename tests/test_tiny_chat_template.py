"""The tiny models' chat template: plain ChatML without tools, Hermes/Qwen2.5-style tool calling with them."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from make_tiny_model import CHAT_TEMPLATE, DEFAULT_SYSTEM_PROMPT, ensure_model  # noqa: E402

# The template before tool support; without tools the new one must render byte-for-byte the same.
OLD_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}},
]

PLAIN_CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "two\nlines"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
    [{"role": "assistant", "content": "starts with the assistant"}],
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tok(request):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_model(request.param))


def render(tok, messages, **kw):
    kw.setdefault("add_generation_prompt", True)
    return tok.apply_chat_template(messages, tokenize=False, **kw)


def test_checkpoint_ships_the_template(tok):
    assert tok.chat_template == CHAT_TEMPLATE


@pytest.mark.parametrize("conv", PLAIN_CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", ["absent", None, []])
def test_without_tools_renders_like_the_old_template(tok, conv, add_generation_prompt, tools):
    kw = {} if tools == "absent" else {"tools": tools}
    new = render(tok, conv, add_generation_prompt=add_generation_prompt, **kw)
    old = render(tok, conv, add_generation_prompt=add_generation_prompt, chat_template=OLD_CHAT_TEMPLATE)
    assert new == old
    new_ids = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=True,
                                      return_dict=False, **kw)
    old_ids = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=True,
                                      return_dict=False, chat_template=OLD_CHAT_TEMPLATE)
    assert list(new_ids) == list(old_ids)


def _tools_block(text: str) -> str:
    m = re.search(r"<tools>\n(.*)\n</tools>", text, re.S)
    assert m, text
    return m.group(1)


def test_tools_are_listed_in_a_system_turn(tok):
    text = render(tok, [{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)
    assert text.startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}\n\n# Tools\n\n")
    lines = _tools_block(text).split("\n")
    assert [json.loads(line) for line in lines] == TOOLS  # one tojson'd tool per line, in order
    for tool in TOOLS:
        assert tool["function"]["name"] in _tools_block(text)
    # the instructions: how to call, in the exact format the server parses
    assert "<tool_call></tool_call>" in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' in text
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    assert text.count("<|im_start|>system\n") == 1


def test_tools_use_the_given_system_message_once(tok):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    text = render(tok, msgs, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n\n")
    assert text.count("You are terse.") == 1
    assert text.count("<|im_start|>system\n") == 1
    assert DEFAULT_SYSTEM_PROMPT not in text
    assert text.endswith("</tool_call><|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_assistant_tool_calls_and_tool_messages(tok):
    msgs = [
        {"role": "user", "content": "Weather in Paris, and 1+2?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21C"},
        {"role": "tool", "tool_call_id": "c2", "content": "3"},
        {"role": "assistant", "content": "Sunny; 3."},
        {"role": "user", "content": "And 2+2?"},
        {"role": "assistant", "content": "Let me add.", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
    ]
    text = render(tok, msgs, tools=TOOLS, add_generation_prompt=False)
    conversation = text[text.index("<|im_start|>user\n"):]
    assert conversation == (
        "<|im_start|>user\nWeather in Paris, and 1+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nSunny; 3.<|im_end|>\n"
        "<|im_start|>user\nAnd 2+2?<|im_end|>\n"
        "<|im_start|>assistant\nLet me add.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>\n'
    )
    # The same turns render the same way without a tools list (no system block then).
    assert render(tok, msgs, add_generation_prompt=False) == conversation


def test_flat_tool_call_and_string_arguments_render_as_is(tok):
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "add", "arguments": '{"a":1,"b":2}'}]}]
    text = render(tok, msgs, add_generation_prompt=False)
    assert text.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a":1,"b":2}}\n'
                         "</tool_call><|im_end|>\n")
