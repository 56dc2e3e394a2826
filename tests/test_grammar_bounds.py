"""Issue 29 #1, #8 (a grammar that accepts no string) and #11, through the shared server:
jump-forward is bounded by the request's budget, so an endless or very long forced text
finishes by max_new_tokens in well under 2 s while an unrelated request is served; a grammar
with no string is a 400; degenerate top_p and repetition penalties keep the most likely token."""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest
import requests
from support.server_proc import assert_healthy_and_idle, server_info

N = 64  # max_new_tokens of every forced request
CHAT = [{"role": "user", "content": "x"}]
ENDLESS_ARRAY = {"type": "array", "minItems": 1, "items": {"$ref": "#"}}  # [[[[...: endless under compact JSON

# (path, body): each forced text is endless or ten million bytes; before the bound the first
# three grew the scheduler until it was killed and the last blocked every request for 11 s.
FORCED = [
    ("/generate", {"text": "x", "rid": "endless", "sampling_params": {"max_new_tokens": N, "ebnf": 'root ::= "a" root'}}),
    ("/v1/completions", {"prompt": "x", "max_tokens": N, "ebnf": 'root ::= "a" root'}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": N,
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "a", "schema": ENDLESS_ARRAY}}}),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": N, "regex": "a{10000000}"}}),
]


def completion_tokens(path: str, body: dict) -> int:
    return body["meta_info"]["completion_tokens"] if path == "/generate" else body["usage"]["completion_tokens"]


def test_endless_and_long_forced_texts_finish_by_max_new_tokens(server):
    """The server's shared flags include --constrained-json-disable-any-whitespace, which the
    chat case needs (with free whitespace its text is not forced)."""
    jumped = server_info(server)["jump_forward_tokens"]

    def send(path: str, body: dict) -> tuple[float, requests.Response]:
        t = time.monotonic()
        r = requests.post(server + path, json=body, timeout=60)
        return time.monotonic() - t, r

    with concurrent.futures.ThreadPoolExecutor(len(FORCED) + 1) as pool:
        forced = [pool.submit(send, path, body) for path, body in FORCED]
        # ignore_eos: at the default temperature an early EOS (3 tokens) is a fair answer too.
        unrelated = pool.submit(send, "/generate", {"text": "hello",
                                                    "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
        for (path, _), f in zip(FORCED, forced):
            seconds, r = f.result()
            assert r.status_code == 200, (path, r.text)
            assert completion_tokens(path, r.json()) == N and seconds < 2, (path, seconds)
        seconds, r = unrelated.result()
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4 and seconds < 2
    assert server_info(server)["jump_forward_tokens"] - jumped > len(FORCED) * N // 2  # they did jump
    again = requests.post(server + FORCED[0][0], json=FORCED[0][1], timeout=60).json()  # its rid is free again
    text = again["text"]
    assert again["meta_info"]["id"] == "endless" and text == "a" * len(text) and len(text) >= N
    assert_healthy_and_idle(server)


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= root"}}),
    ("/v1/completions", {"prompt": "x", "ebnf": "root ::= root"}),
])
def test_a_grammar_that_accepts_no_string_is_a_400(server, path, body):
    r = requests.post(server + path, json=body, timeout=30)
    assert r.status_code == 400 and "accepts no string" in r.text and r.json()["error"]["param"] == "ebnf", r.text
    assert_healthy_and_idle(server)


def test_degenerate_top_p_and_penalties_keep_the_most_likely_token(server):
    """top_p 1e-320 (0 in float32) and a repetition penalty of 1e-38 (a logit / 1e-38 overflows)
    emitted token 0 over and over. top_p that small keeps exactly the greedy token; a repetition
    penalty near 0 makes the prompt's best positive-logit token win every time, never token 0."""
    def ids(sampling: dict) -> list[int]:
        body = {"input_ids": [5, 17, 33, 60], "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, **sampling}}
        r = requests.post(server + "/generate", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    assert ids({"temperature": 1.0, "top_p": 1e-320}) == ids({"temperature": 0})
    penalized = ids({"temperature": 1.0, "repetition_penalty": 1e-38})
    assert 0 not in penalized and penalized == ids({"temperature": 0, "repetition_penalty": 1e-38})
    assert_healthy_and_idle(server)


def test_the_bounded_walk_is_what_the_server_reports(server):
    """A chat answer under an endless schema is exactly its forced text, cut by max_tokens."""
    r = requests.post(server + "/v1/chat/completions", json=FORCED[2][1], timeout=60).json()
    content = r["choices"][0]["message"]["content"]
    assert content == "[" * len(content) and r["choices"][0]["finish_reason"] == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(content)  # cut by max_tokens, as any length finish
