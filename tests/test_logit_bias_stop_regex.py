"""logit_bias and stop_regex: the sampler's bias against a naive reference, the regex scan against
re.search over the whole text, the fields' checks, and both through the session server: the
official openai client (chat and completions), SGLang's /generate shapes, and the DSL's gen."""

from __future__ import annotations

import math
import re

import openai
import pytest
import requests
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.helpers import tokenizer

import radixrt as rt
from radixrt.errors import RequestError
from radixrt.sampling_params import SamplingParams
from radixrt.utils.stop_regex import StopRegexScan, max_width
from radixrt.worker.sampler import Sampler

VOCAB = 16


# -- units ------------------------------------------------------------------------------------

def test_biases_are_added_per_row_before_greedy_and_drawn_choices():
    sampler = Sampler(4, VOCAB, torch.device("cpu"))
    logits = torch.randn(3, VOCAB)
    params = [{"temperature": 0, "logit_bias": {"3": 50.0, "7": -1.5}}, {"temperature": 0},
              {"temperature": 0, "logit_bias": {"0": -100, "9": 0.25}}]
    for slot, p in enumerate(params):
        sampler.add(slot, SamplingParams.from_dict(p), [], [])
    want = logits.clone()
    want[0, 3] += 50.0
    want[0, 7] -= 1.5
    want[2, 0] -= 100
    want[2, 9] += 0.25
    processed = sampler.processed_logits(logits, [0, 1, 2])
    torch.testing.assert_close(processed, want)
    assert sampler.sample(logits, [0, 1, 2]).tolist() == want.argmax(-1).tolist()
    assert int(sampler.sample(logits[:1], [0])) == 3


def test_a_bias_never_lifts_a_token_the_grammar_masked():
    sampler = Sampler(1, VOCAB, torch.device("cpu"))
    sampler.add(0, SamplingParams.from_dict({"temperature": 0, "logit_bias": {"2": 100.0}}), [], [])
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = -math.inf  # what mask_disallowed leaves for a token the grammar forbids
    logits[0, 5] = 1.0
    assert int(sampler.sample(logits, [0])) == 5


@pytest.mark.parametrize("bias, field", [
    ({"x": 1.0}, "logit_bias"), ({"-1": 1.0}, "logit_bias"), ({"1.5": 1.0}, "logit_bias"),
    ({"1": math.inf}, "logit_bias"), ({"1": math.nan}, "logit_bias"),
])
def test_bad_biases_are_refused_by_name(bias, field):
    with pytest.raises(RequestError) as e:
        SamplingParams.from_dict({"logit_bias": bias})
    assert e.value.param == field


@pytest.mark.parametrize("stop_regex", ["(", "a" * 2000, ["ok", "[z-a]"], "(a+)+b", r"(\w+\s)*x"])
def test_bad_stop_regex_is_refused_by_name(stop_regex):
    with pytest.raises(RequestError) as e:
        SamplingParams.from_dict({"stop_regex": stop_regex})
    assert e.value.param == "stop_regex"


def test_empty_stop_regex_asks_for_nothing():
    for empty in ("", [], None):
        assert SamplingParams.from_dict({"stop_regex": empty}).stop_regex == []
    assert SamplingParams.from_dict({"stop_regex": "a+"}).stop_regex == ["a+"]


def test_widths_bound_the_search_window():
    assert max_width("abc") == 3 and max_width(r"\d{1,5}x") == 6
    assert max_width("a+") is None and max_width(".*") is None


PATTERNS = [r"ab", r"\d{2}", r"a.b", r"^x", r"(?<=q)z", r"b+a", r"\bza"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet="abqxz1 ", max_size=4), max_size=12), st.sampled_from(PATTERNS))
def test_the_scan_stops_where_searching_the_whole_text_first_matches(pieces, pattern):
    scan, text = StopRegexScan([pattern]), ""
    for piece in pieces:
        hit = scan.feed(piece)
        text += piece
        assert (hit is not None) == (re.search(pattern, text) is not None)
        if hit is not None:
            assert hit == pattern
            return


# -- through the server -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused")


def generate(server: str, text: str, **sampling) -> dict:
    r = requests.post(server + "/generate", json={"text": text, "sampling_params": sampling}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_logit_bias_steers_every_endpoint(server, client, llama_path):
    forced = 300
    text = tokenizer(llama_path).decode([forced])
    body = {"max_tokens": 4, "temperature": 1.0, "logit_bias": {str(forced): 100}}
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                          **body)
    assert [t.token for t in chat.choices[0].logprobs.content] == [text] * 4
    completion = client.completions.create(model="m", prompt="Once", logprobs=0, **body)
    assert completion.choices[0].logprobs.tokens == [text] * 4
    native = generate(server, "Once", max_new_tokens=4, logit_bias={str(forced): 100})
    assert native["output_ids"] == [forced] * 4
    # a grammar's mask wins over the bias
    masked = generate(server, "Once", max_new_tokens=8, regex="[ab]{3}", logit_bias={str(forced): 100})
    assert re.fullmatch("[ab]{3}", masked["text"])


def test_stop_regex_ends_where_the_pattern_first_matches_and_keeps_the_match(server, client, llama_path):
    free = generate(server, "The river", max_new_tokens=24, temperature=0, ignore_eos=True)
    text, ids = free["text"], free["output_ids"]
    piece = text[len(text) // 2:len(text) // 2 + 3]
    pattern = re.escape(piece).replace("\\ ", r"\s")  # a pattern, not a literal string
    got = generate(server, "The river", max_new_tokens=24, temperature=0, ignore_eos=True, stop_regex=[pattern])
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    n = len(got["output_ids"])
    assert got["output_ids"] == ids[:n] and re.search(pattern, got["text"])
    assert not re.search(pattern, tokenizer(llama_path).decode(ids[:n - 1]))  # no earlier token ended it
    chat = client.completions.create(model="m", prompt="The river", max_tokens=24, temperature=0,
                                     extra_body={"stop_regex": pattern, "ignore_eos": True})
    assert chat.choices[0].text == got["text"] and chat.choices[0].finish_reason == "stop"


def test_the_dsl_sends_stop_regex(server):
    @rt.function
    def program(s):
        s += "The river" + rt.gen("rest", max_tokens=24, temperature=0, ignore_eos=True, stop_regex=r"\s\w+\s")

    state = program.run(backend=rt.RuntimeEndpoint(server))
    assert re.search(r"\s\w+\s", state["rest"]), state["rest"]
    with pytest.raises(ValueError, match="does not compile"):
        rt.gen("x", stop_regex="(")


@pytest.mark.parametrize("body, field", [
    ({"logit_bias": {"999999": 1.0}}, "logit_bias"), ({"logit_bias": {"a": 1.0}}, "logit_bias"),
    ({"stop_regex": "("}, "stop_regex"),
])
def test_bad_fields_are_400s_naming_them(server, body, field):
    r = requests.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
