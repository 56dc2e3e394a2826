"""Embeddings, scores and reranking (/v1/embeddings, /encode, /v1/score, /v1/rerank) through real
servers, against transformers on the same weights in float32:

- the session's server (tiny llama, default pooling: the last token, normalized): embeddings,
  the openai client in float and base64, label-token scores, and a chatted prefix reused;
- a sentence-transformers checkpoint (mean pooling, Normalize, Matryoshka dimensions) served with
  a Qwen3-Reranker-style chat template and 32-token prefill chunks: mean pooling over chunks,
  `dimensions`, and reranking by p(yes) / (p(yes) + p(no));
- a sequence classifier served --is-embedding with CLS pooling (--pooler-config): CLS vectors,
  the generating routes refused, and reranking by its cross-encoder head.

After each server's workload no KV page is lost."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import openai
import pytest
import requests
import torch
from support.embedding_models import (
    MATRYOSHKA_DIMENSIONS,
    classifier_checkpoint,
    mean_pooling_checkpoint,
)
from support.helpers import (
    assert_pool_idle,
    corpus_prompts,
    hf_model,
    tokenizer,
    wait_idle,
)
from support.server_proc import SERVER_ARGS, SERVER_PAGE_SIZE, running_server

TOL = 1e-5
TEXTS = ["The cat sat on the mat.", ("A much longer sentence about the weather, the sea and the hills beyond them, "
         "which runs past one page of sixteen tokens."), "hi"]


def post(url: str, path: str, body: dict[str, Any], status: int = 200) -> Any:
    r = requests.post(url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def hidden(path: Path, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden states (after the last norm): [len(ids), hidden]."""
    with torch.no_grad():
        return hf_model(path).model(torch.tensor([ids])).last_hidden_state[0]


def normalized(v: torch.Tensor) -> np.ndarray:
    return torch.nn.functional.normalize(v, dim=-1).numpy()


def label_probs(path: Path, ids: list[int], labels: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([ids])).logits[0, -1].float()
    return torch.softmax(logits, -1)[labels].numpy()


def pool_is_idle(url: str) -> None:
    assert_pool_idle(wait_idle(lambda: requests.get(url + "/get_server_info", timeout=30).json()))


# -- the session's server: last-token pooling --------------------------------------------------


def test_last_token_embeddings_equal_transformers(server, llama_path):
    tok = tokenizer(llama_path)
    got = post(server, "/v1/embeddings", {"input": TEXTS})
    assert [d["index"] for d in got["data"]] == [0, 1, 2] and got["object"] == "list"
    for text, d in zip(TEXTS, got["data"]):
        ids = tok.encode(text)
        np.testing.assert_allclose(d["embedding"], normalized(hidden(llama_path, ids)[-1]), atol=TOL)
    assert got["usage"]["prompt_tokens"] == sum(len(tok.encode(t)) for t in TEXTS)
    ids = [tok.encode(t) for t in TEXTS[:2]]
    one = post(server, "/encode", {"input_ids": ids[0]})  # one id list: one answer; a list of them: a list
    np.testing.assert_allclose(one["embedding"], got["data"][0]["embedding"], atol=TOL)
    assert one["meta_info"]["prompt_tokens"] == len(ids[0]) and one["meta_info"]["finish_reason"]["type"] == "length"
    both = post(server, "/encode", {"input_ids": ids, "rid": ["e-a", "e-b"]})
    assert [b["meta_info"]["id"] for b in both] == ["e-a", "e-b"]
    np.testing.assert_allclose(both[1]["embedding"], got["data"][1]["embedding"], atol=TOL)


def test_openai_client_float_and_base64(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    as_float = client.embeddings.create(model="m", input=TEXTS[:2], encoding_format="float")
    as_b64 = client.embeddings.create(model="m", input=TEXTS[:2])  # the client asks for base64 and decodes it
    for f, b in zip(as_float.data, as_b64.data):
        np.testing.assert_allclose(f.embedding, b.embedding, atol=1e-7)
    raw = post(server, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"})["data"][0]["embedding"]
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(raw), "<f4"), as_float.data[0].embedding, atol=1e-7)
    assert as_float.usage.prompt_tokens > 0


def test_scores_equal_transformers_label_probabilities(server, llama_path):
    tok, labels = tokenizer(llama_path), [5, 17, 300]
    query, items = "The weather today is", [" sunny", " cold and wet", " a mystery"]
    got = post(server, "/v1/score", {"query": query, "items": items, "label_token_ids": labels})
    assert got["object"] == "scoring" and len(got["scores"]) == 3
    for item, scores in zip(items, got["scores"]):
        np.testing.assert_allclose(scores, label_probs(llama_path, tok.encode(query + item), labels), rtol=1e-4, atol=1e-9)
    soft = post(server, "/v1/score", {"query": query, "items": items[:1], "label_token_ids": labels, "apply_softmax": True,
                                      "item_first": True})["scores"][0]
    p = label_probs(llama_path, tok.encode(items[0] + query), labels)
    np.testing.assert_allclose(soft, p / p.sum(), rtol=1e-4)
    q_ids, i_ids = tok.encode(query), [tok.encode(i) for i in items]
    by_ids = post(server, "/v1/score", {"query": q_ids, "items": i_ids, "label_token_ids": labels})
    np.testing.assert_allclose(by_ids["scores"][1], label_probs(llama_path, q_ids + i_ids[1], labels), rtol=1e-4, atol=1e-9)


def test_the_items_of_one_score_call_share_the_querys_prefix(server, llama_path):
    query, items = corpus_prompts(llama_path, [48, 5, 6, 7], seed=391)[0], corpus_prompts(llama_path, [5, 6, 7], seed=392)
    got = post(server, "/v1/score", {"query": query, "items": items, "label_token_ids": [3]})
    # prefilled once before the items (they would all compute it in one step otherwise): each item reuses it
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(items) * (len(query) - SERVER_PAGE_SIZE)
    for item, scores in zip(items, got["scores"]):
        np.testing.assert_allclose(scores, label_probs(llama_path, query + item, [3]), rtol=1e-4, atol=1e-9)


def test_an_embedding_reuses_the_prefix_a_chat_computed(server, llama_path):
    tok = tokenizer(llama_path)
    document = tok.decode(corpus_prompts(llama_path, [120], seed=39)[0])
    messages = [{"role": "user", "content": document}]
    chat = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat["usage"]["prompt_tokens"] == len(ids)
    got = post(server, "/v1/embeddings", {"input": ids})
    cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert len(ids) - SERVER_PAGE_SIZE <= cached < len(ids), cached  # all but the last token (and a partial page)
    np.testing.assert_allclose(got["data"][0]["embedding"], normalized(hidden(llama_path, ids)[-1]), atol=TOL)
    again = post(server, "/encode", {"input_ids": ids})
    assert again["meta_info"]["cached_tokens"] == len(ids) - 1
    pool_is_idle(server)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/embeddings", {"input": "x", "dimensions": 8}, "dimensions"),  # not a Matryoshka model
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ["x", [1, 2]]}, "input"),
    ("/encode", {"text": "x", "image_data": "y.png"}, "image_data"),
    ("/encode", {"text": [["q", "d"]], "is_cross_encoder_request": True}, "is_cross_encoder_request"),
    ("/v1/score", {"query": "x", "items": ["y"]}, "label_token_ids"),
    ("/v1/score", {"query": "x", "items": ["y"], "label_token_ids": [10**6]}, "label_token_ids"),
    ("/v1/score", {"query": "x", "items": [[1]], "label_token_ids": [1]}, "items"),
    ("/v1/rerank", {"query": "x", "documents": ["y"]}, "query"),  # no reranker template, no head
    ("/v1/rerank", {"query": "x", "documents": ["y"], "top_n": 0}, "top_n"),
])
def test_bad_calls_are_400s_naming_the_field(server, path, body, param):
    assert post(server, path, body, 400)["error"]["param"] == param


# -- mean pooling, Matryoshka dimensions and a decoder reranker ---------------------------------


@pytest.fixture(scope="module")
def st_model(llama_path, tmp_path_factory) -> Path:
    return mean_pooling_checkpoint(llama_path, tmp_path_factory.mktemp("st-mean"))


@pytest.fixture(scope="module")
def st_server(st_model) -> Iterator[str]:
    with running_server(st_model, *SERVER_ARGS, "--chunked-prefill-size", "32", "--chat-template",
                        str(st_model / "reranker.jinja")) as (url, _):
        yield url


def test_mean_pooling_over_chunks_equals_transformers(st_server, st_model):
    prompts = corpus_prompts(st_model, [90, 7], seed=5)  # 90 tokens: three 32-token chunks
    got = post(st_server, "/v1/embeddings", {"input": prompts})
    for ids, d in zip(prompts, got["data"]):
        np.testing.assert_allclose(d["embedding"], normalized(hidden(st_model, ids).mean(0)), atol=TOL)
    again = post(st_server, "/v1/embeddings", {"input": prompts[0]})  # every row's hidden state: nothing reused
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cut = post(st_server, "/v1/embeddings", {"input": prompts[0], "dimensions": MATRYOSHKA_DIMENSIONS[0]})
    want = normalized(hidden(st_model, prompts[0]).mean(0)[: MATRYOSHKA_DIMENSIONS[0]])
    np.testing.assert_allclose(cut["data"][0]["embedding"], want, atol=TOL)
    assert post(st_server, "/v1/embeddings", {"input": "x", "dimensions": 20}, 400)["error"]["param"] == "dimensions"


def test_rerank_orders_documents_as_transformers_scores(st_server, st_model):
    tok = tokenizer(st_model)
    query, docs = "what do cats eat", ["cats eat fish", "the sea is deep", "a cat eats mice at night", "hills"]
    template = jinja2.Environment().from_string((st_model / "reranker.jinja").read_text())
    yes, no = tok.encode("yes", add_special_tokens=False)[0], tok.encode("no", add_special_tokens=False)[0]
    want = []
    for d in docs:
        ids = tok.encode(template.render(messages=[{"role": "user", "content": query}, {"role": "user", "content": d}]))
        p_yes, p_no = label_probs(st_model, ids, [yes, no])
        want.append(p_yes / (p_yes + p_no))
    got = post(st_server, "/v1/rerank", {"query": query, "documents": docs})
    assert [g["index"] for g in got] == list(np.argsort(want)[::-1])
    for g in got:
        assert g["document"] == docs[g["index"]] and abs(g["score"] - want[g["index"]]) < TOL
    top = post(st_server, "/v1/rerank", {"query": query, "documents": docs, "top_n": 2, "return_documents": False})
    assert [t["index"] for t in top] == [g["index"] for g in got[:2]] and "document" not in top[0]
    pool_is_idle(st_server)


# -- an --is-embedding sequence classifier: CLS pooling and a cross-encoder head ----------------


@pytest.fixture(scope="module")
def classifier(llama_path, tmp_path_factory) -> Path:
    return classifier_checkpoint(llama_path, tmp_path_factory.mktemp("classifier"))


@pytest.fixture(scope="module")
def ce_server(classifier) -> Iterator[str]:
    pooler = '{"pooling_type": "CLS", "normalize": false}'
    with running_server(classifier, "--is-embedding", "--pooler-config", pooler) as (url, _):
        yield url


def test_cls_embeddings_and_the_generating_routes_refused(ce_server, classifier):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(classifier, dtype=torch.float32).eval()
    ids = tokenizer(classifier).encode(TEXTS[1])
    got = post(ce_server, "/encode", {"text": TEXTS[1]})
    with torch.no_grad():
        want = model.model(torch.tensor([ids])).last_hidden_state[0, 0].numpy()
    np.testing.assert_allclose(got["embedding"], want, atol=TOL)
    for path, body in [("/generate", {"text": "x"}), ("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/score", {"query": "x", "items": ["y"], "label_token_ids": [1]})]:
        assert "--is-embedding" in post(ce_server, path, body, 400)["error"]["message"]


def test_cross_encoder_rerank_equals_the_transformers_head(ce_server, classifier):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(classifier, dtype=torch.float32).eval()
    tok = tokenizer(classifier)
    query, docs = "what do cats eat", ["cats eat fish", "the sea is deep", "a cat eats mice at night"]
    with torch.no_grad():
        want = [float(model(torch.tensor([tok(query, d)["input_ids"]])).logits[0, 0]) for d in docs]
    got = post(ce_server, "/v1/rerank", {"query": query, "documents": docs})
    assert [g["index"] for g in got] == list(np.argsort(want)[::-1])
    for g in got:
        assert abs(g["score"] - want[g["index"]]) < TOL and g["meta_info"]["prompt_tokens"] > 0
    pairs = post(ce_server, "/encode", {"text": [[query, d] for d in docs], "is_cross_encoder_request": True})
    np.testing.assert_allclose([p["embedding"][0] for p in pairs], want, atol=TOL)
    pool_is_idle(ce_server)
