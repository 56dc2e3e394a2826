"""The radix cache through the whole engine: the same tokens with the cache on and off
(and as transformers), reuse that shows in cached_tokens, and a pool too small for the
workload that still completes everything by evicting and retracting."""

from __future__ import annotations

import asyncio

import pytest
import radixrt
from support.helpers import assert_no_page_leak, corpus_ids, hf_greedy
from support.workloads import chat_turn_user_tokens, forks, interleave, shared_document

MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}


def run_chats(engine, user_turns):
    """Conversations run concurrently; each turn extends the previous prompt and answer."""

    async def conversation(turns):
        history, cached = [], []
        for user in turns:
            prompt = history + user
            res = await engine.async_generate(input_ids=prompt, sampling_params=GREEDY)
            cached.append(res["meta_info"]["cached_tokens"])
            history = prompt + res["output_ids"]
        return history, cached

    async def all_of_them():
        return await asyncio.gather(*(conversation(t) for t in user_turns))

    return asyncio.run(all_of_them())


def run_all(engine, corpus):
    doc = shared_document(corpus, n_questions=64)
    fork = forks(corpus, n_trunks=3, trunk_len=300, branches=4)
    out = {
        "doc": engine.generate(input_ids=doc.prompts, sampling_params=GREEDY),
        "fork": engine.generate(input_ids=fork.prompts, sampling_params=GREEDY),
        "chat": run_chats(engine, chat_turn_user_tokens(corpus, conversations=4, turns=3)),
        "info": engine.get_server_info(),
    }
    assert_no_page_leak(engine)
    return doc, fork, out


@pytest.fixture(scope="module")
def corpus(llama_path):
    return corpus_ids(llama_path)


@pytest.mark.parametrize("page_size", [1, 16])
def test_cache_on_and_off_give_the_same_tokens_and_the_cache_is_hit(page_size, llama_path, corpus):
    args = dict(model_path=str(llama_path), page_size=page_size, max_total_tokens=65536, chunked_prefill_size=2048)
    with radixrt.Engine(**args) as on:
        doc, fork, got = run_all(on, corpus)
    with radixrt.Engine(disable_radix_cache=True, **args) as off:
        _, _, want = run_all(off, corpus)
    for key in ("doc", "fork"):
        assert [r["output_ids"] for r in got[key]] == [r["output_ids"] for r in want[key]], key
    assert [h for h, _ in got["chat"]] == [h for h, _ in want["chat"]]
    # cache off: nothing reused; cache on: the document is computed once
    assert all(r["meta_info"]["cached_tokens"] == 0 for r in want["doc"])
    assert want["info"]["cache_hit_rate"] == 0
    doc_hits = [r["meta_info"]["cached_tokens"] for r in got["doc"]]
    assert sum(h >= 1500 - page_size for h in doc_hits) >= 63, doc_hits
    assert sum(r["meta_info"]["cached_tokens"] >= 300 - page_size for r in got["fork"]) >= 9  # 3 trunks x (4 - 1)
    for _, cached in got["chat"]:  # every later turn reuses the whole previous conversation
        assert cached[0] == 0 and all(c > 0 for c in cached[1:])
    assert got["info"]["cache_hit_rate"] > 0.8
    if page_size == 16:  # and transformers agrees
        for prompt, res in list(zip(doc.prompts, got["doc"]))[:16] + list(zip(fork.prompts, got["fork"])):
            assert res["output_ids"] == hf_greedy(llama_path, prompt, MAX_NEW)


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_same_prompt_twice_reports_it_cached(page_size, llama_path, corpus):
    prompt = corpus[100:357]
    with radixrt.Engine(model_path=str(llama_path), page_size=page_size, max_total_tokens=8192) as e:
        first = e.generate(input_ids=prompt, sampling_params=GREEDY)
        second = e.generate(input_ids=prompt, sampling_params=GREEDY)
        assert first["meta_info"]["cached_tokens"] == 0
        # every full page and, by copy-on-write, the partial one: all but the last token
        assert second["meta_info"]["cached_tokens"] == len(prompt) - 1
        assert second["output_ids"] == first["output_ids"]
        assert e.flush_cache().success
        assert e.generate(input_ids=prompt, sampling_params=GREEDY)["meta_info"]["cached_tokens"] == 0
        stream = e.generate(input_ids=prompt, sampling_params={"max_new_tokens": 50, "ignore_eos": True}, stream=True)
        next(stream)
        busy = e.flush_cache()  # SGLang's answer while requests run: success False, the cache untouched
        assert not busy.success and "running" in busy.message
        stream.close()


def test_a_pool_a_third_of_the_need_evicts_retracts_and_matches(llama_path, corpus):
    docs = [corpus[i * 300 : (i + 1) * 300] for i in range(8)]
    groups = [[d + corpus[5000 + 37 * k + 11 * j : 5000 + 37 * k + 11 * j + 12] for k in range(4)] for j, d in enumerate(docs)]
    prompts = interleave(groups)  # arrivals alternate between documents
    sp = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    need = sum(len(p) + 48 for p in prompts)  # every sequence whole, as without sharing
    args = dict(model_path=str(llama_path), page_size=16, chunked_prefill_size=512)
    with radixrt.Engine(max_total_tokens=need * 4, **args) as big:
        want = big.generate(input_ids=prompts, sampling_params=sp)
    with radixrt.Engine(max_total_tokens=need // 3, **args) as small:
        got = small.generate(input_ids=prompts, sampling_params=sp)
        info = small.get_server_info()
        assert_no_page_leak(small)
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in want]
    assert info["evicted_pages"] > 0 and info["retractions"] > 0, info
