"""No request can hurt the server, part two (issue 29 #3, #4, #6): a client that leaves a
non-streaming call is noticed while its tokens flow; chat text is held to /generate's character
bound before any template or tokenizer sees it; a call makes at most --max-requests-per-call
requests; stop lists are capped, and stop strings are found in O(new text) per step."""

from __future__ import annotations

import json
import random
import socket
import time

import pytest
from support.helpers import tokenizer
from support.server_proc import assert_healthy_and_idle, server_info

from radixrt.config import ServerArgs
from radixrt.errors import RequestError
from radixrt.frontend.generate_input import GenerateInput, GenerateRequest
from radixrt.frontend.text_bound import NORMALIZE_SLACK, TextBound
from radixrt.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParamsIn
from radixrt.utils.stop_strings import StopScan, StopStrings
from support.http import post

# The session's server (conftest.server): the tiny llama's context, and the default limits.
CONTEXT = 4096  # room for an OpenAI call that decodes for seconds; the chat bound is ~200k characters
MAX_PER_CALL = ServerArgs.max_requests_per_call  # the default, 1024
ENDLESS = {"max_new_tokens": 10**15, "ignore_eos": True, "kv_retention": {"policy": "sink_window", "window_tokens": 64}}


def assert_served_meanwhile(url: str) -> None:
    r = post(url, "/generate", {"text": "meanwhile", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text


def assert_rid_free(url: str, rid: str) -> None:
    r = post(url, "/generate", {"text": "reuse", "rid": rid, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == rid, r.text


# --- #3: a client that leaves is noticed while tokens flow ---------------------------------------

LEAVERS = [
    ("/generate", {"text": "hold the line", "sampling_params": ENDLESS}),
    ("/v1/completions", {"prompt": "hold the line", "max_tokens": CONTEXT - 16, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hold"}], "max_tokens": CONTEXT - 64,
                              "ignore_eos": True}),
]


@pytest.mark.parametrize("path,body", LEAVERS, ids=[p for p, _ in LEAVERS])
def test_a_client_that_leaves_is_noticed_while_tokens_flow(server, path, body):
    rid = f"leaver{path.replace('/', '-')}"
    data = json.dumps({**body, "rid": rid}).encode()
    port = int(server.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    time.sleep(0.5)
    assert server_info(server)["running"] == 1  # it runs, and its tokens flow
    assert_served_meanwhile(server)
    sock.close()
    left = time.monotonic()
    while (info := server_info(server))["running"] or info["waiting"]:
        assert time.monotonic() - left < 1.5, f"{path}: still running 1.5 s after its client left"
        time.sleep(0.05)
    assert_healthy_and_idle(server)
    assert_rid_free(server, rid)


# --- #4: chat text is bounded before the template and the tokenizer -------------------------------


def chars_bound(llama_path) -> int:
    tok = tokenizer(llama_path)
    longest = max(len(t.encode("utf-8", "replace")) for t in tok.get_vocab())
    return CONTEXT * longest * NORMALIZE_SLACK


def test_chat_text_over_the_generate_bound_is_refused_before_tokenizing(server, llama_path):
    cap = chars_bound(llama_path)
    half = "word " * (cap // 10)
    over = [{"role": "system", "content": half}, {"role": "user", "content": half + "x" * (cap - 2 * len(half) + 1)}]
    for path, body, param in (("/v1/chat/completions", {"messages": over, "rid": "long-chat"}, "messages"),
                              ("/generate", {"text": "a" * (cap + 1), "rid": "long-chat"}, "text")):
        start = time.monotonic()
        r = post(server, path, body)
        took = time.monotonic() - start
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert err["param"] == param and f"at most {cap} can fit" in err["message"], err
        assert took < 1.0, f"{path} took {took:.2f} s to refuse {cap + 1} characters"
    assert_served_meanwhile(server)
    assert_healthy_and_idle(server)
    assert_rid_free(server, "long-chat")


def test_text_bound_cuts_chat_messages_to_the_head():
    bound = TextBound(context_length=4, max_token_bytes=2)  # 4 * 2 * NORMALIZE_SLACK characters
    cap = bound.most_chars(False)
    messages = [{"role": "system", "content": "s" * (cap - 3)}, {"role": "user", "content": "u" * 10},
                {"role": "user", "content": "late", "reasoning_content": "r"}]
    bound.fit_messages(messages, None, bounded=False, truncate=True)
    assert [m["content"] for m in messages] == ["s" * (cap - 3), "uuu", ""] and messages[2]["reasoning_content"] == ""
    assert bound.most_chars(True) is None  # a bounded-KV request has no context to fit
    with pytest.raises(ValueError, match="tools"):
        bound.fit_messages([], [{"name": "x" * cap}], bounded=False, truncate=True)


# --- #6: work per call is bounded -------------------------------------------------------------


def test_a_call_of_more_requests_than_the_limit_is_refused(server):
    prompts = MAX_PER_CALL // 128 + 1  # times n=128 (--max-n): just over the limit
    many = {"text": [f"p{i}" for i in range(prompts)], "rid": [f"many-{i}" for i in range(prompts)],
            "sampling_params": {"n": 128, "max_new_tokens": 1}}
    for path, body, param in (("/generate", many, "n"),
                              ("/v1/completions", {"prompt": ["p"] * (MAX_PER_CALL + 1), "max_tokens": 1}, "text")):
        start = time.monotonic()
        r = post(server, path, body)
        assert r.status_code == 400 and time.monotonic() - start < 1.0, r.text[:300]
        err = r.json()["error"]
        assert err["param"] == param and f"at most {MAX_PER_CALL} per call (--max-requests-per-call)" in err["message"]
    assert_served_meanwhile(server)
    assert_healthy_and_idle(server)
    assert_rid_free(server, "many-0-0")


def test_the_call_limit_counts_prompts_times_n():
    def call(prompts: int, n: int) -> GenerateInput:
        return GenerateInput.from_request(GenerateRequest(text=["x"] * prompts, sampling_params=SamplingParamsIn(n=n)),
                                          max_requests=8)

    assert len(call(2, 4).items) == 8 and len(call(8, 1).items) == 8
    for prompts, n, field in ((3, 3, "n"), (9, 1, "text")):
        with pytest.raises(RequestError, match="at most 8 per call") as e:
            call(prompts, n)
        assert e.value.param == field
    with pytest.raises(ValueError, match="max_requests_per_call"):
        ServerArgs(model_path="m", max_requests_per_call=0)


def test_stop_lists_over_the_caps_are_refused(server):
    def generate(**sp) -> dict:
        return {"text": "hi", "rid": "stops", "sampling_params": sp}

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stop": ["z"] * (MAX_STOP_STRINGS + 1)}
    cases = [
        ("/generate", generate(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop", f"at most {MAX_STOP_STRINGS}"),
        ("/generate", generate(stop=["y" * (MAX_STOP_STRING_CHARS + 1)]), "stop", f"at most {MAX_STOP_STRING_CHARS}"),
        ("/generate", generate(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids",
         f"at most {MAX_STOP_TOKEN_IDS}"),
        ("/v1/chat/completions", chat, "stop", f"at most {MAX_STOP_STRINGS}"),
    ]
    for path, body, param, words in cases:
        r = post(server, path, body)
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
    # the largest lists allowed run; none of their strings can occur, so it runs to its length
    rng = random.Random(0)
    stop = ["Q" + "".join(rng.choice("qz") for _ in range(MAX_STOP_STRING_CHARS - 1)) for _ in range(MAX_STOP_STRINGS)]
    sp = {"stop": stop, "stop_token_ids": list(range(1000, 1024)) * (MAX_STOP_TOKEN_IDS // 24), "max_new_tokens": 8,
          "ignore_eos": True, "temperature": 0}
    r = post(server, "/generate", {"text": "hi", "rid": "stops", "sampling_params": sp})
    assert r.status_code == 200, r.text
    assert_healthy_and_idle(server)


def reference_first(text: str, stops: list[str]) -> int | None:
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(cuts) if cuts else None


def reference_held(text: str, stops: list[str]) -> int:
    """The longest suffix of text that is a proper prefix of a stop string (the old per-update check)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_the_stop_automaton_agrees_with_searching_every_string():
    rng = random.Random(0)
    for trial in range(1500):
        alphabet = "ab" if trial % 2 else "abc"
        stops = sorted({"".join(rng.choices(alphabet, k=rng.randint(1, 5))) for _ in range(rng.randint(1, 6))})
        automaton = StopStrings(stops)
        text = "".join(rng.choices(alphabet + "x", k=rng.randint(0, 30)))
        assert automaton.first_start(text) == reference_first(text, stops), (stops, text)
        assert automaton.held_after(text) == reference_held(text, stops), (stops, text)
        scan, i = StopScan(automaton), 0
        while i < len(text):  # fed in pieces, as steps add text
            j = i + rng.randint(1, 4)
            found = scan.feed(text[i:j])
            seen = text[:j]
            assert scan.first == reference_first(seen, stops) and scan.held == reference_held(seen, stops)
            ended = [s for s in stops if any(seen.endswith(s, 0, e) for e in range(i + 1, len(seen) + 1))]
            assert (found is None) == (not ended), (stops, seen, found)
            i = j
