"""Fuzzing the HTTP door: hypothesis builds request bodies for /generate, /v1/completions and
/v1/chat/completions from their fields (right and wrong types, extreme numbers, odd Unicode,
deep nesting), and schemathesis generates payloads from /openapi.json. No response may be a
5xx; the server stays up; afterwards nothing runs and every page is free or cached."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.server_proc import assert_healthy_and_idle, running_server

# A small context and n cap keep every valid example cheap (a few dozen tokens at most).
ARGS = ("--page-size", "4", "--max-total-tokens", "4096", "--context-length", "64", "--max-n", "4",
        "--max-request-bytes", "1000000")
EXAMPLES = 60  # per endpoint (hypothesis), bounded for CI


@pytest.fixture(scope="module")
def server(llama_path):
    with running_server(llama_path, *ARGS) as (url, proc):
        yield url, proc


def big_ints() -> st.SearchStrategy[int]:
    return st.sampled_from([-1, 0, 1, 2**31, 2**63 - 1, 2**63, 2**64, 10**24, -(2**63) - 1])


def odd_text() -> st.SearchStrategy[str]:
    lone = st.sampled_from(["\ud800", "a\udfffb", "\x00", "\u202e", "\U0010ffff", "é" * 300, ""])
    return st.one_of(st.text(max_size=40), lone)


def junk(depth: int = 3) -> st.SearchStrategy:
    """Any JSON value, including deep nesting (built as a string later) and wrong types."""
    leaves = st.one_of(st.none(), st.booleans(), big_ints(), st.floats(allow_nan=False, allow_infinity=False),
                       odd_text())
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(odd_text(), inner, max_size=3),
                        max_leaves=8)


def field(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly valid values, sometimes junk."""
    return st.one_of(valid, valid, valid, junk())


small = st.integers(0, 4)
sampling = st.fixed_dictionaries({}, optional={
    "max_new_tokens": field(small), "temperature": field(st.floats(0, 3)), "top_p": field(st.floats(0, 1.5)),
    "top_k": field(st.integers(-2, 2000)), "min_p": field(st.floats(0, 1)), "n": field(st.integers(0, 6)),
    "stop": field(st.lists(odd_text(), max_size=2)), "stop_token_ids": field(st.lists(st.integers(0, 2000), max_size=2)),
    "seed": field(big_ints()), "repetition_penalty": field(st.floats(0, 3)), "ignore_eos": field(st.booleans()),
    "min_new_tokens": field(small), "frequency_penalty": field(st.floats(-3, 3)), "regex": field(st.none()),
})
ids = st.lists(st.integers(-1, 1100), max_size=70)
generate_body = st.fixed_dictionaries({}, optional={
    "text": field(st.one_of(odd_text(), st.lists(odd_text(), max_size=3))),
    "input_ids": field(st.one_of(ids, st.lists(ids, max_size=2))),
    "sampling_params": field(sampling), "rid": field(odd_text()), "stream": field(st.booleans()),
    "return_logprob": field(st.booleans()), "top_logprobs_num": field(st.integers(-1, 1100)),
    "logprob_start_len": field(st.integers(-2, 80)), "cache_salt": field(odd_text()), "bogus": junk(),
})
openai_common = {
    "max_tokens": field(small), "temperature": field(st.floats(0, 3)), "n": field(st.integers(0, 6)),
    "stream": field(st.booleans()), "stop": field(st.one_of(odd_text(), st.lists(odd_text(), max_size=2))),
    "seed": field(big_ints()), "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "logit_bias": field(st.dictionaries(st.integers(-1, 2000).map(str), st.floats(-100, 100), max_size=3)),
    "stop_regex": field(st.one_of(odd_text(), st.lists(odd_text(), max_size=2))), "user": field(odd_text()),
}
completion_body = st.fixed_dictionaries(
    {"prompt": field(st.one_of(odd_text(), st.lists(odd_text(), max_size=2), ids))},
    optional={**openai_common, "logprobs": field(st.integers(-1, 25)), "echo": field(st.booleans())},
)
message = st.fixed_dictionaries({"role": field(st.sampled_from(["user", "system", "assistant", "tool"])),
                                 "content": field(st.one_of(odd_text(), st.lists(
                                     st.fixed_dictionaries({"type": st.just("text"), "text": field(odd_text())}),
                                     max_size=2)))})
chat_body = st.fixed_dictionaries(
    {"messages": field(st.lists(message, max_size=3))},
    optional={**openai_common, "logprobs": field(st.booleans()), "top_logprobs": field(st.integers(-1, 25)),
              "response_format": field(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}))},
)


def deepen(body: dict, depth: int) -> str:
    """The body as JSON, with a very deep array spliced in when depth > 0."""
    text = json.dumps(body, ensure_ascii=True)
    if depth and text.endswith("}"):
        sep = ", " if len(body) else ""
        text = text[:-1] + sep + '"deep": ' + "[" * depth + "]" * depth + "}"
    return text


def check(url: str, path: str, body: dict, depth: int) -> None:
    data = deepen(body, depth)
    r = requests.post(url + path, data=data, headers={"Content-Type": "application/json"}, timeout=120)
    assert r.status_code < 500, f"{path} {data[:300]!r} -> {r.status_code} {r.text[:300]}"
    if body.get("stream") is True:
        r.content  # read a stream to its end


FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@FUZZ
@given(body=generate_body, depth=st.sampled_from([0, 0, 0, 100_000]))
def test_fuzz_generate(server, body, depth):
    check(server[0], "/generate", body, depth)


@FUZZ
@given(body=completion_body, depth=st.sampled_from([0, 0, 0, 100_000]))
def test_fuzz_completions(server, body, depth):
    check(server[0], "/v1/completions", body, depth)


@FUZZ
@given(body=chat_body, depth=st.sampled_from([0, 0, 0, 100_000]))
def test_fuzz_chat(server, body, depth):
    check(server[0], "/v1/chat/completions", body, depth)


def test_schemathesis_finds_no_server_error(server, tmp_path):
    url, proc = server
    st_bin = Path(sys.executable).parent / "st"
    cmd = [str(st_bin), "run", f"{url}/openapi.json", "--checks", "not_a_server_error", "--max-examples", "30",
           "--seed", "1", "--workers", "1", "--request-timeout", "60", "--phases", "fuzzing",
           "--include-path-regex", "^/(generate|v1/completions|v1/chat/completions|abort_request)$"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    report = out.stdout[-6000:] + out.stderr[-2000:]
    assert out.returncode == 0, report
    tested = re.search(r"Tested: (\d+)", out.stdout)
    cases = re.search(r"(\d+) generated, (\d+) passed", out.stdout)
    assert tested and int(tested.group(1)) == 4, report
    assert cases and int(cases.group(1)) >= 60 and cases.group(1) == cases.group(2), report


def test_after_fuzzing_the_server_is_alive_and_idle(server):
    url, proc = server
    assert proc.poll() is None
    assert_healthy_and_idle(url)
