"""Greedy tokens and logprobs through the whole engine equal transformers' on the same weights.

Sixteen prompts of 5 to 500 tokens arrive at different times (continuous
batching), for both model families, at page_size 1 and 16, with and without
chunked prefill forced small (a cached prefix inside a request).
"""

from __future__ import annotations

import asyncio

import pytest
import radixrt
from support.helpers import assert_no_page_leak, corpus_prompts, hf_greedy, hf_logprobs

LENGTHS = [5, 9, 17, 30, 45, 64, 65, 100, 128, 150, 200, 257, 300, 380, 450, 500]
MAX_NEW = 24
CONFIGS = {  # name -> engine arguments
    "page1": dict(page_size=1),
    "page16-chunk64": dict(page_size=16, chunked_prefill_size=64),
    "page1-chunk64": dict(page_size=1, chunked_prefill_size=64),
}


# Batch composition changes fp32 reduction order (about 1e-5 in a logit), so a reference token
# that wins by less than this would make the test measure float ties, not the engine. Seed 1
# had a 6e-4 tie for qwen2 that flipped under one arrival timing; seed 3's closest call is 2e-3.
MIN_TOP2_GAP = 1e-3
PROMPT_SEED = 3


@pytest.fixture(scope="module")
def references(model_paths):
    out = {}
    for family, path in model_paths.items():
        prompts = corpus_prompts(path, LENGTHS, seed=PROMPT_SEED)
        outputs = [hf_greedy(path, p, MAX_NEW) for p in prompts]
        for p, o in zip(prompts, outputs):
            lp = hf_logprobs(path, p + o)[len(p) - 1 : len(p) + len(o) - 1]  # rows predicting each output token
            top2 = lp.topk(2, dim=-1).values
            gap = float((top2[:, 0] - top2[:, 1]).min())
            assert gap >= MIN_TOP2_GAP, f"{family}: a near-tie ({gap:.1e}) in the reference; pick another PROMPT_SEED"
        out[family] = (prompts, outputs)
    return out


async def _staggered(engine, prompts):
    async def one(i, ids):
        await asyncio.sleep(0.03 * (i % 8))
        return await engine.async_generate(input_ids=ids, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0})

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_tokens_match_transformers(family, config, model_paths, references):
    prompts, expected = references[family]
    with radixrt.Engine(model_path=str(model_paths[family]), max_total_tokens=16384, **CONFIGS[config]) as engine:
        results = asyncio.run(_staggered(engine, prompts))
        for ids, want, got in zip(prompts, expected, results):
            assert got["output_ids"] == want, f"prompt of {len(ids)} tokens"
            assert got["meta_info"]["prompt_tokens"] == len(ids)
        assert_no_page_leak(engine)
        if family == "llama" and config == "page16-chunk64":
            _check_logprobs(engine, model_paths[family], prompts)


def _check_logprobs(engine, path, prompts):
    """Prompt logprobs (from position 0, across prefill chunks) and output logprobs within 1e-4."""
    for ids in (prompts[3], prompts[10]):  # 30 tokens; 200 tokens = four chunks of 64
        res = engine.generate(
            input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0},
            return_logprob=True, logprob_start_len=0, top_logprobs_num=3,
        )
        meta, out = res["meta_info"], res["output_ids"]
        ref = hf_logprobs(path, ids + out)  # ref[j]: distribution of token j + 1
        inp = meta["input_token_logprobs"]
        assert len(inp) == len(ids) and inp[0][0] is None and [t[1] for t in inp] == ids
        for j in range(1, len(ids)):
            assert inp[j][0] == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-4)
        outp = meta["output_token_logprobs"]
        assert [t[1] for t in outp] == out
        for k, (lp, tid, _) in enumerate(outp):
            assert lp == pytest.approx(ref[len(ids) - 1 + k, tid].item(), abs=1e-4)
        top = meta["output_top_logprobs"][0]
        want = ref[len(ids) - 1].topk(3)
        assert [t[1] for t in top] == want.indices.tolist()
        assert [t[0] for t in top] == pytest.approx(want.values.tolist(), abs=1e-4)
    # Without logprob_start_len exactly one prompt logprob comes back: the last prompt token's.
    ids = prompts[5]
    res = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0}, return_logprob=True)
    inp = res["meta_info"]["input_token_logprobs"]
    assert len(inp) == 1 and inp[0][1] == ids[-1]
    assert inp[0][0] == pytest.approx(hf_logprobs(path, ids)[-2, ids[-1]].item(), abs=1e-4)
