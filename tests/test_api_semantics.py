"""Where radixrt's API meant something other than SGLang 0.5.9's, it now means what SGLang's does:
max_new_tokens null (and chat without max_tokens) runs to the context; an explicit budget beyond
the context is a 400 unless --allow-auto-truncate; /health* and /metrics need no key; streamed
logprobs come per chunk and continuous_usage_stats puts usage in each; the OpenAI model name is
not checked; spaces_between_special_tokens reaches the tokenizer; cache_salt and extra_key
combine (unambiguously, unlike SGLang's concatenation); /flush_cache while busy is refused;
continue_final_message continues the last message."""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests
from transformers import AutoTokenizer

from radixrt.config import ServerArgs
from radixrt.config_views import HttpConfig
from radixrt.frontend.detokenizer import IncrementalDetokenizer
from radixrt.frontend.generate_input import GenerateInput
from radixrt.namespace import CacheNamespace
from radixrt.sampling_params import SamplingParams
from radixrt.server.http_server import required_key
from support.server_proc import SERVER_ARGS, running_server
from support.http import post

SMALL_CONTEXT = 96
USER = [{"role": "user", "content": "Tell me about the river."}]


@pytest.fixture(scope="module")
def truncating(llama_path):
    """A server with a small context that cuts what does not fit (--allow-auto-truncate)."""
    with running_server(llama_path, *SERVER_ARGS, "--context-length", str(SMALL_CONTEXT), "--allow-auto-truncate") as (url, _):
        yield url


@pytest.fixture(scope="module")
def tok(llama_path):
    return AutoTokenizer.from_pretrained(llama_path)


def events(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with requests.post(url + path, json=body, timeout=120, stream=True) as r:
        assert r.status_code == 200, r.text
        lines = [line[6:] for line in r.iter_lines() if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def ids(n: int) -> list[int]:
    return [5 + i % 700 for i in range(n)]


# -- max_new_tokens null / chat without max_tokens: until a stop or the context limit ----------

def test_max_new_tokens_null_and_chat_without_max_tokens_run_to_the_context(truncating):
    meta = post(truncating, "/generate", {"input_ids": ids(80), "sampling_params": {
        "max_new_tokens": None, "ignore_eos": True, "temperature": 0}}).json()["meta_info"]
    assert meta["completion_tokens"] == SMALL_CONTEXT - 80 and meta["finish_reason"]["type"] == "length"
    chat = post(truncating, "/v1/chat/completions", {"messages": USER, "ignore_eos": True, "temperature": 0}).json()
    usage = chat["usage"]
    assert usage["completion_tokens"] == SMALL_CONTEXT - usage["prompt_tokens"] > 16  # not 16, not 128
    assert chat["choices"][0]["finish_reason"] == "length"
    # absent stays SGLang's default of 128 (cut by the context here); completions keep OpenAI's 16
    absent = post(truncating, "/generate", {"input_ids": ids(8), "sampling_params": {"ignore_eos": True}}).json()
    assert absent["meta_info"]["completion_tokens"] == SMALL_CONTEXT - 8
    done = post(truncating, "/v1/completions", {"prompt": "The river", "ignore_eos": True}).json()
    assert done["usage"]["completion_tokens"] == 16


# -- an explicit budget beyond the context: 400, or cut with --allow-auto-truncate -------------

def test_budget_beyond_the_context_is_a_400_without_auto_truncate(server):
    for path, body in (
        ("/generate", {"input_ids": ids(4000), "sampling_params": {"max_new_tokens": 200}}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 5000}),
        ("/v1/completions", {"prompt": "The river", "max_tokens": 4096}),
    ):
        r = post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_new_tokens", (path, r.text)
        assert "context length" in r.json()["error"]["message"]
    # the default budget is not checked: it ends at the context
    r = post(server, "/generate", {"input_ids": ids(4090), "sampling_params": {"ignore_eos": True}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 6


def test_auto_truncate_cuts_the_budget_and_the_prompt(truncating):
    meta = post(truncating, "/generate", {"input_ids": ids(80), "sampling_params": {
        "max_new_tokens": 50, "ignore_eos": True}}).json()["meta_info"]
    assert meta["completion_tokens"] == SMALL_CONTEXT - 80
    meta = post(truncating, "/generate", {"input_ids": ids(300), "sampling_params": {"max_new_tokens": 4}}).json()["meta_info"]
    assert meta["prompt_tokens"] == SMALL_CONTEXT - 1 and meta["completion_tokens"] == 1


# -- API keys --------------------------------------------------------------------------------

def test_health_routes_metrics_and_preflights_need_no_key():
    args = HttpConfig.of(ServerArgs(model_path="m", api_key="k", admin_api_key="a"))
    for path in ("/health", "/health_generate", "/health/ready", "/metrics", "/metrics/"):
        assert required_key(path, args) is None, path
    assert required_key("/v1/models", args, "OPTIONS") is None
    assert required_key("/v1/models", args) == "k" and required_key("/flush_cache", args) == "a"


# -- streaming: logprobs per chunk, usage per chunk --------------------------------------------

def test_completion_stream_carries_each_chunks_logprobs_and_usage(server):
    body = {"prompt": "The river runs", "max_tokens": 10, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    whole = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    chunks = events(server, "/v1/completions", {**body, "stream": True,
                                                 "stream_options": {"continuous_usage_stats": True, "include_usage": True}})
    content, last = chunks[:-1], chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    streamed = [lp for c in content for lp in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(whole["token_logprobs"], abs=1e-4)
    assert [t for c in content for t in c["choices"][0]["logprobs"]["tokens"]] == whole["tokens"]
    assert all(len(c["choices"][0]["logprobs"]["top_logprobs"]) == len(c["choices"][0]["logprobs"]["tokens"])
               for c in content)
    seen = [c["usage"]["completion_tokens"] for c in content]
    assert seen == sorted(seen) and seen[-1] == 10
    assert all(c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for c in content)


def test_chat_stream_carries_each_chunks_logprobs_and_usage(server):
    body = {"messages": USER, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 1, "ignore_eos": True}
    whole = post(server, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    chunks = events(server, "/v1/chat/completions", {**body, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[0]["usage"]["completion_tokens"] == 0
    streamed = [e for c in chunks[1:] for e in (c["choices"][0]["logprobs"] or {"content": []})["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in whole]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in whole], abs=1e-4)
    assert "usage" in chunks[-1] and chunks[-1]["usage"]["completion_tokens"] == 8
    plain = events(server, "/v1/chat/completions", {**body, "stream": True})
    assert not any("usage" in c for c in plain)


# -- the model name is not checked -------------------------------------------------------------

def test_any_model_name_is_served_and_echoed(server):
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": USER, "max_tokens": 1})):
        r = post(server, path, {**body, "model": "no-such-model"})
        assert r.status_code == 200 and r.json()["model"] == "no-such-model", r.text


# -- spaces_between_special_tokens reaches the tokenizer's decode ------------------------------

class SpacedTokenizer:
    """transformers 4's Python tokenizers: spaces around added tokens unless asked not to."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def decode(self, ids: list[int], spaces_between_special_tokens: bool = True, **kw: Any) -> str:
        added = set(self.inner.get_added_vocab().values())
        parts, run = [], []
        for i in ids:
            if i in added:
                parts += [self.inner.decode(run, **kw)] if run else []
                parts.append(self.inner.decode([i], **kw))
                run = []
            else:
                run.append(i)
        parts += [self.inner.decode(run, **kw)] if run else []
        return (" " if spaces_between_special_tokens else "").join(parts)


def test_spaces_between_special_tokens_is_passed_to_decode_as_sglang_does(tok):
    out = tok.encode("hello<|im_end|><|im_start|>world", add_special_tokens=False)
    texts = {}
    for spaces in (True, False):
        params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
        # the fast tokenizer (as SGLang's detokenizer calls it) ignores the flag: same text either way
        want = tok.decode(out, skip_special_tokens=False, spaces_between_special_tokens=spaces,
                          clean_up_tokenization_spaces=False)
        assert IncrementalDetokenizer(tok, params).final_text(out, None) == want
        texts[spaces] = IncrementalDetokenizer(SpacedTokenizer(tok), params).final_text(out, None)
    assert texts[True] == "hello <|im_end|> <|im_start|> world" and texts[False] == "hello<|im_end|><|im_start|>world"


# -- cache_salt and extra_key: one namespace, never the concatenation (issue 29) ---------------

def test_cache_salt_and_extra_key_combine_into_one_namespace(server):
    pair = CacheNamespace(salt="ten", extra_key="ant")
    assert GenerateInput.build(text="x", cache_salt="ten", extra_key="ant").items[0].namespace == pair
    assert GenerateInput.build(text="x", extra_key="ant").items[0].namespace == CacheNamespace(salt="ant")
    prompt, cached = ids(64), lambda body: post(server, "/generate", body).json()["meta_info"]["cached_tokens"]
    one = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}
    assert cached({**one, "cache_salt": "ten", "extra_key": "ant-1"}) == 0
    assert cached({**one, "cache_salt": "ten", "extra_key": "ant-1"}) > 0  # the same namespace
    assert cached({**one, "cache_salt": "tenant-1"}) == 0  # SGLang's concatenation would read it
    assert cached({**one, "cache_salt": "ten"}) == 0 and cached({**one, "extra_key": "ant-1"}) == 0
    chat = {"messages": [{"role": "user", "content": "salted " * 30}], "max_tokens": 1}
    usage = lambda body: post(server, "/v1/chat/completions", body).json()["usage"]["prompt_tokens_details"]
    assert usage({**chat, "cache_salt": "s", "extra_key": "2"})["cached_tokens"] == 0
    assert usage({**chat, "cache_salt": "s", "extra_key": "2"})["cached_tokens"] > 0
    assert usage({**chat, "extra_key": "s2"})["cached_tokens"] == 0


# -- /flush_cache while busy; health probes stay out of the metrics ----------------------------

def _requests_total(url: str) -> float:
    lines = requests.get(url + "/metrics", timeout=10).text.splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("radixrt:requests_total{"))


def test_flush_cache_while_busy_is_refused_and_probes_are_not_counted(server):
    before = _requests_total(server)
    assert requests.get(server + "/health_generate", timeout=30).status_code == 200
    assert _requests_total(server) == before
    post(server, "/generate", {"input_ids": ids(4), "sampling_params": {"max_new_tokens": 1}})
    assert _requests_total(server) == before + 1  # an ordinary request is counted
    body = {"input_ids": ids(8), "rid": "keeps-busy", "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with requests.post(server + "/generate", json=body, timeout=60, stream=True) as r:
        lines = r.iter_lines()  # NOTE: kept: a dropped iterator closes the stream, which aborts the request
        next(lines)  # it runs
        busy = requests.post(server + "/flush_cache", timeout=30)
        assert busy.status_code == 400 and "running" in busy.json()["error"]["message"]
        requests.post(server + "/abort_request", json={"rid": "keeps-busy"}, timeout=10)


# -- continue_final_message --------------------------------------------------------------------

def test_continue_final_message_continues_the_assistants_text(server, tok):
    convo = USER + [{"role": "assistant", "content": "The river is"}]

    def prompt_tokens(**extra: Any) -> int:
        r = post(server, "/v1/chat/completions", {"messages": convo, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    head = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert prompt_tokens(continue_final_message=True) == len(head) + len(tok.encode("The river is", add_special_tokens=False))
    as_user = USER + [{"role": "user", "content": "The river is"}]  # SGLang's rule without the flag
    assert prompt_tokens() == len(tok.apply_chat_template(as_user, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))


def test_chat_template_kwargs_are_taken_and_wrong_ones_are_named(server):
    ok = {"messages": USER, "max_tokens": 1, "reasoning_effort": "low",
          "chat_template_kwargs": {"enable_thinking": False, "spaces_between_special_tokens": False}}
    assert post(server, "/v1/chat/completions", ok).status_code == 200
    for kwargs in ({"messages": []}, {"add_generation_prompt": False}):
        r = post(server, "/v1/chat/completions", {**ok, "chat_template_kwargs": kwargs})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
