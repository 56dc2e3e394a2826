"""The Engine's generate contract: sampling semantics, finish reasons, bad input, streaming."""

from __future__ import annotations

import asyncio

import pytest
import radixrt
from support.helpers import assert_no_page_leak, corpus_prompts, wait_for

GREEDY = {"temperature": 0, "max_new_tokens": 32}


@pytest.fixture(scope="module")
def engine(llama_path):
    with radixrt.Engine(model_path=str(llama_path), page_size=16, max_total_tokens=8192, chunked_prefill_size=128) as e:
        yield e


@pytest.fixture(scope="module")
def prompt(llama_path):
    return "The old train crossed the river at dawn, and"


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(engine, prompt):
    sp = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 16, "seed": 1234}
    alone = engine.generate(prompt, sp)["output_ids"]
    assert engine.generate(prompt, sp)["output_ids"] == alone
    batch = engine.generate(["Other text first", prompt, "A third one"], [{"temperature": 1.0}, sp, {"temperature": 0.7}])
    assert batch[1]["output_ids"] == alone
    other_seed = engine.generate(prompt, dict(sp, seed=99))["output_ids"]
    assert other_seed != alone


def test_top_k_1_equals_greedy(engine, prompt):
    greedy = engine.generate(prompt, GREEDY)["output_ids"]
    assert engine.generate(prompt, {"temperature": 0.8, "top_k": 1, "max_new_tokens": 32})["output_ids"] == greedy


def test_finish_reasons_stop_token_stop_string_length(engine, prompt):
    base = engine.generate(prompt, GREEDY)
    ids, text = base["output_ids"], base["text"]
    assert base["meta_info"]["finish_reason"] == {"type": "length", "length": 32}
    assert base["meta_info"]["completion_tokens"] == 32
    stop_tok = ids[6]
    res = engine.generate(prompt, dict(GREEDY, stop_token_ids=[stop_tok]))
    assert res["output_ids"] == ids[: ids.index(stop_tok) + 1]
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    res = engine.generate(prompt, dict(GREEDY, stop=[stop, "never-appears"]))
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in res["text"]
    assert res["text"] == text[: text.index(stop)]
    kept = engine.generate(prompt, dict(GREEDY, stop=stop, no_stop_trim=True))
    assert kept["text"].endswith(stop) or stop in kept["text"]


def test_min_new_tokens_defers_stop_ids(engine, prompt):
    first = engine.generate(prompt, GREEDY)["output_ids"][0]
    res = engine.generate(prompt, dict(GREEDY, stop_token_ids=[first], min_new_tokens=4))
    assert res["meta_info"]["completion_tokens"] >= 4
    assert first not in res["output_ids"][:4]


def test_n_parallel_samples_and_per_prompt_params(engine, prompt):
    res = engine.generate(prompt, {"temperature": 1.0, "max_new_tokens": 8, "n": 3, "seed": 5})
    assert isinstance(res, list) and len(res) == 3
    assert len({r["meta_info"]["id"] for r in res}) == 3
    assert len({tuple(r["output_ids"]) for r in res}) > 1
    two = engine.generate([prompt, prompt], [{"max_new_tokens": 2, "temperature": 0}, {"max_new_tokens": 5, "temperature": 0}])
    assert [r["meta_info"]["completion_tokens"] for r in two] == [2, 5]


def test_prefill_only_request(engine, prompt):
    res = engine.generate(prompt, {"max_new_tokens": 0})
    assert res["text"] == "" and res["output_ids"] == []
    assert res["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert res["meta_info"]["prompt_tokens"] > 0


def test_encode_and_score_as_sglangs_engine(engine, prompt, llama_path):
    import torch

    from support.helpers import hf_model, tokenizer

    ids = tokenizer(llama_path).encode(prompt)
    with torch.no_grad():
        last = hf_model(llama_path).model(torch.tensor([ids])).last_hidden_state[0, -1]
        probs = torch.softmax(hf_model(llama_path)(torch.tensor([ids])).logits[0, -1], -1)
    one = engine.encode(prompt)
    assert one["meta_info"]["prompt_tokens"] == len(ids)
    assert torch.allclose(torch.tensor(one["embedding"]), torch.nn.functional.normalize(last, dim=0), atol=1e-5)
    for r in engine.encode([ids, ids[:5]]):  # a list: a list of answers
        assert len(r["embedding"]) == len(one["embedding"])
    assert torch.allclose(torch.tensor(engine.encode([ids])[0]["embedding"]), torch.tensor(one["embedding"]), atol=1e-5)
    scores = engine.score(ids[:3], [ids[3:]], label_token_ids=[7, 8])
    assert torch.allclose(torch.tensor(scores[0]), probs[[7, 8]], rtol=1e-4, atol=1e-9)
    with pytest.raises(ValueError, match="dimensions"):
        engine.encode(prompt, dimensions=4)
    assert_no_page_leak(engine)


def test_input_ids_and_text_agree(engine, prompt):
    ids = engine.tokenizer.encode(prompt)
    assert engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] == engine.generate(prompt, GREEDY)["output_ids"]


BAD = [
    (dict(prompt=""), "empty"),
    (dict(input_ids=[]), "empty"),
    (dict(prompt="hi", sampling_params={"max_new_tokens": -1}), "max_new_tokens"),
    (dict(prompt="hi", sampling_params={"temperature": -1}), "temperature"),
    (dict(prompt="hi", sampling_params={"top_p": 0}), "top_p"),
    (dict(prompt="hi", sampling_params={"top_p": 1.01}), "top_p"),
    (dict(prompt="hi", sampling_params={"not_a_field": 1}), "not_a_field"),
    (dict(prompt="hi", sampling_params={"temperature": "warm"}), "temperature"),
    (dict(input_ids=[1] * 5000), "context length"),
    (dict(input_ids=[10**7]), "vocabulary"),
    (dict(prompt="hi", return_logprob=True, logprob_start_len=99), "logprob_start_len"),
    (dict(prompt=["ok", ""]), "empty"),
    (dict(prompt=["a", "b"], sampling_params=[{}]), "sampling_params"),
]


@pytest.mark.parametrize("kwargs,field", BAD, ids=[f for _, f in BAD])
def test_bad_input_raises_naming_the_field_and_the_engine_serves_on(engine, kwargs, field):
    with pytest.raises(ValueError, match=field):
        engine.generate(**kwargs)
    assert engine.generate("still serving", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_stream_chunks_are_cumulative_and_end_at_the_full_text(engine, prompt):
    sp = dict(GREEDY, stop=["zq"])  # a stop string that forces hold-back logic to run
    full = engine.generate(prompt, sp)
    chunks = list(engine.generate(prompt, sp, stream=True))
    assert len(chunks) > 1
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] is not None


def test_async_generate_and_async_stream(engine, prompt):
    async def go():
        many = await asyncio.gather(*(engine.async_generate(prompt, GREEDY) for _ in range(4)))
        stream = await engine.async_generate(prompt, GREEDY, stream=True)
        last = None
        async for chunk in stream:
            last = chunk
        return many, last

    many, last = asyncio.run(go())
    assert len({tuple(r["output_ids"]) for r in many}) == 1
    assert last["output_ids"] == many[0]["output_ids"]


def test_closing_a_stream_early_aborts_and_returns_pages(engine, prompt):
    stream = engine.generate(prompt, {"max_new_tokens": 500, "ignore_eos": True, "temperature": 0}, stream=True)
    for i, chunk in enumerate(stream):
        if i == 3:
            break
    # A closed stream yields nothing more, but the frontend's state for the request (private; no
    # public handle exists) still receives the scheduler's final output.
    state = engine._manager._states[chunk["meta_info"]["id"]]
    stream.close()
    assert wait_for(lambda: state.done, bool), "the stream was closed but its request never finished"
    # aborted at the client's request (no error status), not finished: fewer tokens than asked
    assert state.finish.type == "abort" and state.error is None, state.finish
    assert len(state.output_ids) < 500
    assert_no_page_leak(engine)


def test_long_list_completes_in_order_without_leaks(engine, llama_path):
    prompts = corpus_prompts(llama_path, [20 + 7 * i for i in range(40)], seed=3)
    res = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert [r["meta_info"]["prompt_tokens"] for r in res] == [len(p) for p in prompts]
    assert_no_page_leak(engine)


def test_a_repo_id_the_cache_lacks_fails_before_anything_starts(tmp_path, monkeypatch):
    """model_path may be a Hugging Face repo id (tests/test_model_source.py serves one); offline and
    not cached, the Engine refuses it at once, naming the repo, the revision and the cache."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=f"'radixrt-test/absent'.*revision v3.*{tmp_path}.*HF_HUB_OFFLINE"):
        radixrt.Engine(model_path="radixrt-test/absent", revision="v3")
