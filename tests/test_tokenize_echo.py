"""SGLang's /tokenize and /detokenize (and their /v1/ names), and `echo` on /v1/completions:
the prompt before each choice's text, its logprobs first when asked, in streams the first chunk.
Unit tests hold the tokenizer routes' rules; the rest talk to the session server with few tokens,
through plain requests (SGLang's shapes) and the official openai client."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import requests
from support.http import post
from transformers import AutoTokenizer

from radixrt.errors import RequestError
from radixrt.frontend.text_bound import TextBound
from radixrt.server.schemas import DetokenizeBody, TokenizeBody, decode_body
from radixrt.server.tokenize_api import TokenizerLimits, detokenize, tokenize

PROMPT = "The river runs"


class BosTokenizer:
    """Characters as ids, with a BOS (id 1) that add_special_tokens adds and skip_special_tokens drops."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join("" if i == 1 and skip_special_tokens else "<s>" if i == 1 else chr(i) for i in ids)


LIMITS = TokenizerLimits(TextBound(context_length=8, max_token_bytes=1), bounded_kv=False, max_items=3, vocab_size=200)


def body(kind: type, **fields: Any) -> Any:
    return decode_body(json.dumps(fields).encode(), kind)


def test_tokenize_shapes_and_add_special_tokens():
    tok = BosTokenizer()
    assert tokenize(tok, body(TokenizeBody, prompt="ab"), LIMITS) == {"tokens": [1, 97, 98], "count": 3}
    assert tokenize(tok, body(TokenizeBody, prompt="ab", add_special_tokens=False), LIMITS) == {"tokens": [97, 98], "count": 2}
    assert tokenize(tok, body(TokenizeBody, prompt=["a", ""], add_special_tokens=False), LIMITS) == {
        "tokens": [[97], []], "count": [1, 0]}


def test_tokenize_bounds_and_strict_body():
    tok = BosTokenizer()
    with pytest.raises(RequestError) as e:  # 8 tokens * 1 byte * NORMALIZE_SLACK 4 = 32 characters could fit
        tokenize(tok, body(TokenizeBody, prompt="x" * 33), LIMITS)
    assert e.value.param == "prompt" and "33 characters" in e.value.message
    assert tokenize(tok, body(TokenizeBody, prompt="x" * 33), TokenizerLimits(LIMITS.bound, True, 3, 200))["count"] == 34
    with pytest.raises(RequestError, match="--max-requests-per-call") as e:
        tokenize(tok, body(TokenizeBody, prompt=["a"] * 4), LIMITS)
    assert e.value.param == "prompt"
    for bad in ({"prompt": 3}, {"prompt": "a", "bogus": 1}, {"prompt": "a", "add_special_tokens": 1}, {}):
        with pytest.raises(RequestError):
            body(TokenizeBody, **bad)


def test_detokenize_shapes_vocabulary_and_mixes():
    tok = BosTokenizer()
    assert detokenize(tok, body(DetokenizeBody, tokens=[1, 97, 98]), LIMITS) == {"text": "ab"}
    assert detokenize(tok, body(DetokenizeBody, tokens=[1, 97], skip_special_tokens=False), LIMITS) == {"text": "<s>a"}
    assert detokenize(tok, body(DetokenizeBody, tokens=[[97], [], [98, 98]]), LIMITS) == {"text": ["a", "", "bb"]}
    assert detokenize(tok, body(DetokenizeBody, tokens=[]), LIMITS) == {"text": ""}
    for tokens in ([97, 200], [[97], [-1]], [97, [98]], [[97]] * 4):
        with pytest.raises(RequestError) as e:
            detokenize(tok, body(DetokenizeBody, tokens=tokens), LIMITS)
        assert e.value.param == "tokens"
    with pytest.raises(RequestError) as e:
        body(DetokenizeBody, tokens=[2**64])
    assert e.value.param == "tokens"


# -- through the server ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok(llama_path):
    return AutoTokenizer.from_pretrained(llama_path)


def test_tokenize_and_detokenize_routes(server, tok):
    context = requests.get(server + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    for path in ("/tokenize", "/v1/tokenize"):
        r = post(server, path, {"prompt": PROMPT})
        assert r.status_code == 200, r.text
        assert r.json() == {"tokens": tok.encode(PROMPT), "count": len(tok.encode(PROMPT)), "max_model_len": context}
    r = post(server, "/tokenize", {"model": "x", "prompt": [PROMPT, "a"], "add_special_tokens": False}).json()
    assert r["tokens"] == [tok.encode(PROMPT, add_special_tokens=False), tok.encode("a", add_special_tokens=False)]
    assert r["count"] == [len(x) for x in r["tokens"]]
    for path in ("/detokenize", "/v1/detokenize"):  # round trips
        assert post(server, path, {"tokens": r["tokens"][0]}).json() == {"text": PROMPT}
        assert post(server, path, {"tokens": r["tokens"]}).json() == {"text": [PROMPT, "a"]}
    for path, bad in (("/detokenize", {"tokens": [5, 10**6]}), ("/v1/detokenize", {"tokens": [[5], [-3]]}),
                      ("/tokenize", {"prompt": 5}), ("/tokenize", {"prompt": "x" * 10**6})):
        r = post(server, path, bad)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("tokens", "prompt"), r.text
    names = requests.get(server + "/openapi.json", timeout=10).json()["components"]["schemas"]
    assert {"TokenizeBody", "DetokenizeBody"} <= set(names)


def completions(server: str, **fields: Any) -> dict[str, Any]:
    r = post(server, "/v1/completions", {"max_tokens": 2, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_puts_the_prompt_before_each_choice(server, tok):
    plain = completions(server, prompt=PROMPT)["choices"][0]["text"]
    out = completions(server, prompt=PROMPT, echo=True, n=2)
    assert [c["text"] for c in out["choices"]] == [PROMPT + plain] * 2
    out = completions(server, prompt=[PROMPT, "A"], echo=True)
    assert [c["text"][: len(p)] for c, p in zip(out["choices"], [PROMPT, "A"])] == [PROMPT, "A"]
    ids = tok.encode(PROMPT)
    assert completions(server, prompt=ids, echo=True)["choices"][0]["text"] == PROMPT + plain  # token ids: decoded
    out = completions(server, prompt=[ids, ids[:1]], echo=True, max_tokens=0)  # just the prompts
    assert [c["text"] for c in out["choices"]] == [PROMPT, tok.decode(ids[:1])]
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 0


def test_echo_with_logprobs_puts_the_prompts_first(server, tok):
    ids = tok.encode(PROMPT)
    out = completions(server, prompt=PROMPT, echo=True, logprobs=2, n=2)
    for c in out["choices"]:
        lp = c["logprobs"]
        assert lp["tokens"][: len(ids)] == [tok.decode([i]) for i in ids] and len(lp["tokens"]) == len(ids) + 2
        assert lp["token_logprobs"][0] is None and all(isinstance(x, float) for x in lp["token_logprobs"][1:])
        assert lp["top_logprobs"][0] is None and all(len(row) >= 1 for row in lp["top_logprobs"][1:])
        assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
        assert "".join(lp["tokens"]) == c["text"]  # byte-level BPE: the token texts spell the answer
    only = completions(server, prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)["choices"][0]
    assert only["text"] == PROMPT and len(only["logprobs"]["tokens"]) == len(ids)
    assert only["logprobs"]["top_logprobs"] == [None] + [{}] * (len(ids) - 1)


def stream(server: str, **fields: Any) -> list[dict[str, Any]]:
    with requests.post(server + "/v1/completions", json={"max_tokens": 3, "temperature": 0, "stream": True, **fields},
                       timeout=120, stream=True) as r:
        assert r.status_code == 200, r.text
        lines = [line[6:] for line in r.iter_lines() if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_streamed_echo_sends_the_prompt_first(server, tok):
    whole = completions(server, prompt=PROMPT, echo=True, logprobs=1, max_tokens=3)["choices"][0]
    for n in (1, 2):
        chunks = stream(server, prompt=PROMPT, echo=True, logprobs=1, n=n)
        for i in range(n):
            mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
            assert mine[0]["text"].startswith(PROMPT) and "".join(c["text"] for c in mine) == whole["text"]
            lps = [c["logprobs"] for c in mine if c["logprobs"]]
            joined = {k: [x for lp in lps for x in lp[k]] for k in ("tokens", "token_logprobs", "text_offset")}
            assert joined["tokens"] == whole["logprobs"]["tokens"]
            assert joined["text_offset"] == whole["logprobs"]["text_offset"]
            assert joined["token_logprobs"][0] is None
    chunks = stream(server, prompt=tok.encode(PROMPT), echo=True, max_tokens=0)
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT


def test_echo_through_the_openai_client(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    out = client.completions.create(model="m", prompt=PROMPT, echo=True, logprobs=1, max_tokens=2, temperature=0)
    c = out.choices[0]
    assert c.text.startswith(PROMPT) and c.logprobs.token_logprobs[0] is None
    assert len(c.logprobs.tokens) == out.usage.prompt_tokens + out.usage.completion_tokens
    chunks = list(client.completions.create(model="m", prompt=PROMPT, echo=True, max_tokens=2, temperature=0,
                                            stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
    # the client has no tokenize method; its raw post reaches /v1/tokenize and /v1/detokenize
    ids = client.post("/tokenize", body={"prompt": PROMPT}, cast_to=object)["tokens"]
    assert client.post("/detokenize", body={"tokens": ids}, cast_to=object) == {"text": PROMPT}
