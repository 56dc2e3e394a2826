"""Reasoning output through a server run with --reasoning-parser qwen3 (this module's own: the
shared server has no parser, as its chat tests expect whole-text content): chat through the
official openai client, whole and streamed, /separate_reasoning, usage.reasoning_tokens, the
DSL's separate_reasoning, a grammar that waits for the reasoning's end, and qwen3_coder tool
calls found in the content after the reasoning.

A regex constraint forces the tiny model to write the markers; its tokenizer splits `<think>`
and `</think>` into several tokens, so every stream here sees a marker arrive across tokens.
A chat request that thinks (qwen3: unless enable_thinking is false) requires reasoning, as in
SGLang: its grammar holds only what follows `</think>`; so the forcing requests turn thinking
off, and the output's own `<think>` opens the reasoning.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import requests

import radixrt as rt

FORCED = "<think>abc</think>def"
MESSAGES = [{"role": "user", "content": "Think, then answer."}]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def server(llama_path) -> Iterator[str]:
    from support.server_proc import SERVER_ARGS, running_server

    # qwen3_coder (the last --tool-call-parser wins): one of the parsers through a server
    with running_server(llama_path, *SERVER_ARGS, "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder") as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused")


NOT_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # the regex holds from the first token


def chat(client: openai.OpenAI, regex: str, **extra: Any) -> Any:
    body = {"regex": regex, **NOT_THINKING, **extra.pop("extra_body", {})}
    return client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body=body, **extra)


def reasoning_token_count(logprobs: Any, end: str = "</think>") -> int:
    """The output tokens up to the one that completes the end marker (from the tokens' own texts)."""
    text = ""
    for k, t in enumerate(logprobs.content, 1):
        text += t.token
        if end in text:
            return k
    raise AssertionError(f"no {end} in {text!r}")


def test_separate_reasoning_route(server):
    post = lambda body: requests.post(server + "/separate_reasoning", json=body, timeout=30)
    assert post({"text": "<think>a b</think>c", "reasoning_parser": "qwen3"}).json() == {"reasoning_text": "a b", "text": "c"}
    # outside chat a parser is forced as its SGLang detector defaults: deepseek-r1 is, qwen3 is not
    assert post({"text": "a</think>c", "reasoning_parser": "deepseek-r1"}).json() == {"reasoning_text": "a", "text": "c"}
    assert post({"text": "a</think>c", "reasoning_parser": "qwen3"}).json() == {"reasoning_text": "", "text": "a</think>c"}
    bad = post({"text": "x", "reasoning_parser": "qwen4"})
    assert bad.status_code == 400 and "qwen4" in bad.json()["error"]["message"]
    assert post({"text": "x"}).status_code == 400


def test_chat_message_and_usage_reasoning(client):
    r = chat(client, FORCED, logprobs=True)
    message = r.choices[0].message
    assert (message.reasoning_content, message.content) == ("abc", "def")
    n = reasoning_token_count(r.choices[0].logprobs)
    assert n > 6  # '<think>' and '</think>' are several tokens each
    assert r.usage.reasoning_tokens == n == r.usage.completion_tokens_details.reasoning_tokens
    # not thinking, an answer without the start marker is all content
    off = chat(client, "abc</think>def")
    assert (off.choices[0].message.reasoning_content, off.choices[0].message.content) == (None, "abc</think>def")
    assert off.usage.reasoning_tokens == 0
    whole = chat(client, FORCED, extra_body={"separate_reasoning": False}).choices[0].message
    assert (whole.reasoning_content, whole.content) == (None, FORCED)


@pytest.mark.parametrize("stream_reasoning", [True, False])
def test_chat_stream_splits_at_the_marker(client, stream_reasoning):
    expected = chat(client, FORCED).usage.reasoning_tokens
    chunks = list(chat(client, FORCED, stream=True, stream_options={"include_usage": True},
                       extra_body={"stream_reasoning": stream_reasoning}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
    assert "".join(reasoning) == "abc" and "".join(d.content or "" for d in deltas) == "def"
    if not stream_reasoning:
        assert reasoning == ["abc"]
    assert chunks[-1].usage.reasoning_tokens == expected > 0


@pytest.mark.parametrize("stream", [False, True])
def test_tools_are_parsed_after_the_reasoning(client, stream):
    """qwen3_coder's calls, their values typed by the tool's schema, found in the content only."""
    params = {"type": "object", "properties": {"zone": {"type": "string"}, "days": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": params}}]
    call = "<tool_call>\n<function=get_time>\n<parameter=zone>\nutc\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    r = client.chat.completions.create(model="default", messages=MESSAGES, tools=tools, max_tokens=128, temperature=0,
                                       stream=stream,
                                       extra_body={"regex": re.escape("<think>hm</think>" + call), **NOT_THINKING})
    if stream:
        deltas = [c.choices[0].delta for c in r if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        calls = [c for d in deltas for c in d.tool_calls or []]
    else:
        message = r.choices[0].message
        reasoning, content, calls = message.reasoning_content, message.content, message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
    assert reasoning == "hm" and not content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_time", {"zone": "utc", "days": 3})]


def test_dsl_separate_reasoning(server):
    @rt.function
    def think(s):
        s += rt.user("Think first.")
        s += rt.assistant(rt.separate_reasoning(rt.gen("answer", max_tokens=MAX_TOKENS, regex=FORCED),
                                                model_type="qwen3"))

    state = think.run(backend=rt.RuntimeEndpoint(server))
    assert (state["answer"], state["answer_reasoning_content"]) == ("def", "abc")
    assert state.messages()[-1] == {"role": "assistant", "content": "def"} and "<think>" not in state.text()
    with pytest.raises(ValueError, match="choices: deepseek-r1"):
        rt.separate_reasoning(rt.gen("x"), model_type="qwen4")
    with pytest.raises(ValueError, match="named gen"):
        rt.separate_reasoning(rt.gen(), model_type="qwen3")


@pytest.mark.parametrize("route", ["generate", "chat"])
def test_a_grammar_waits_for_the_end_of_the_reasoning(server, client, route):
    """require_reasoning (native) or a thinking chat request: a random model never writes
    "</think>" in 8 tokens, so the grammar never starts and the output is free; not reasoning, the
    same request is held to the grammar from its first token."""
    def text(require: bool) -> str:
        if route == "chat":
            kwargs = {"chat_template_kwargs": {"enable_thinking": require}}
            r = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=8, temperature=1.0,
                                               seed=7, extra_body={"regex": "[ab]{3}", **kwargs})
            message = r.choices[0].message
            return (message.reasoning_content or "") + (message.content or "")
        body = {"text": "Say", "require_reasoning": require,
                "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "regex": "[ab]{3}", "seed": 7}}
        r = requests.post(server + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["text"]

    assert re.fullmatch("[ab]{3}", text(False))
    assert not re.fullmatch("[ab]{3}", text(True))

