"""A real trained model, SmolLM2-135M-Instruct (the `smollm2` fixture), served in float32 from its
bf16 checkpoint:

* greedy tokens through the Engine are transformers' greedy `generate` tokens for three prompts,
  one of them chat-templated, and the chat answer to "What is the capital of France?" names Paris;
* the quantized KV pool's start-up check on int8 KV passes the default floor
  (KV_QUANT_MIN_AGREEMENT), and a floor above what it measured refuses with KVCalibrationError;
* quality spot checks (--quality-spot-check-rate 1) re-score requests served over that int8 pool
  and report agreement and |dlogprob| in a trained model's range.

Three model loads serve the module: transformers' reference, an Engine for the first part (stopped
once its outputs are in), and one in-process ModelRunner on int8 KV (the worker whose start-up
check ran) with a Scheduler driven here, whose idle-time spot checks this module runs as the
scheduler process does. The Engine and the runner's pool are small so the module takes seconds.
"""

from __future__ import annotations

import pytest
from radixrt.kernels import PagedKVCache
from support.helpers import corpus_prompts, hf_logprobs, tokenizer

import radixrt
from radixrt.config import ServerArgs
from radixrt.settings.kv import KV_QUANT_MIN_AGREEMENT
from radixrt.worker.kv_calibration import (
    KVCalibrationError,
    calibration_prompts,
    check_quantized_pool,
)

MAX_NEW = 16
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}
QUESTION = "What is the capital of France?"
# A reference token that wins by less than this would make the test measure float ties (batching
# changes fp32 reduction order by ~1e-5 in a logit), not the engine.
MIN_TOP2_GAP = 1e-3
# 256 tokens of KV: the start-up check's three prompts (60, 512 and 91 tokens) run side by side in
# it, so each is cut to 5 of its 16 pages (80 tokens; 220 positions in all): seconds, not a minute.
RUNNER_ARGS = {"dtype": "float32", "device": "cpu", "page_size": 16, "max_total_tokens": 256, "context_length": 1024}
# Measured on smollm2 in float32 at this pool (int8 / fp8_e4m3 / fp8_e5m2): start-up check top-1
# agreement 0.986 / 0.968 / 0.932 over the 220 positions, mean |dlogprob| 0.014 / 0.043 / 0.091; with
# the whole prompts (663 positions) 0.989 / 0.952 / 0.926. Spot checks of the three prompts below at
# 12 new tokens (32 emitted) over int8 KV: agreement 1.0, mean |dlogprob| 0.016 (0.986 and 0.017 at 32
# new tokens). Bounds: the default floor for agreement, ~3x the measured mean |dlogprob|.
CHECK_MAX_MEAN_DLOGPROB = 0.05
SPOT_MIN_AGREEMENT = 0.9
SPOT_MAX_NEW = 12
SPOT_MAX_MEAN_DLOGPROB = 0.05


@pytest.fixture(scope="module")
def prompts(smollm2) -> dict[str, list[int]]:
    """Three prompts by name: the chat-templated question and two slices of the shipped corpus."""
    tok = tokenizer(smollm2.hf_dir)
    chat = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
    prose, longer = corpus_prompts(smollm2.hf_dir, [24, 60], seed=5)  # smallest top-2 gap 0.25
    return {"chat": list(chat), "prose": prose, "longer": longer}


@pytest.fixture(scope="module")
def engine_outputs(smollm2, prompts) -> dict[str, dict]:
    """Each prompt's greedy result from one Engine (float32 on the bf16 checkpoint), all in one batch."""
    with radixrt.Engine(model_path=str(smollm2.hf_dir), dtype="float32", page_size=16, max_total_tokens=1024,
                        context_length=1024) as engine:
        results = engine.generate(input_ids=list(prompts.values()), sampling_params=GREEDY)
    return dict(zip(prompts, results))


def transformers_agrees(path, ids: list[int], out: list[int], eos_ids: set[int]) -> None:
    """out is what transformers' greedy `generate` (float32) gives for ids: at every step its argmax
    over the prefix, by a margin no float noise can flip, and out ends at eos or at MAX_NEW tokens.
    One teacher-forced forward computes every step's logits at once, as generate does one by one."""
    rows = hf_logprobs(path, ids + out)[len(ids) - 1 : len(ids) + len(out) - 1]  # [len(out), vocab]: row i -> out[i]
    top2 = rows.topk(2, dim=-1)
    assert top2.indices[:, 0].tolist() == out
    gap = float((top2.values[:, 0] - top2.values[:, 1]).min())
    assert gap >= MIN_TOP2_GAP, f"a near-tie ({gap:.1e}) in the reference; pick other prompts"
    assert len(out) == MAX_NEW or (out and out[-1] in eos_ids), out


@pytest.mark.parametrize("name", ["chat", "prose", "longer"])
def test_greedy_tokens_match_transformers(name, smollm2, prompts, engine_outputs):
    got = engine_outputs[name]
    assert got["meta_info"]["prompt_tokens"] == len(prompts[name])
    eos = {tokenizer(smollm2.hf_dir).eos_token_id}
    transformers_agrees(smollm2.hf_dir, prompts[name], got["output_ids"], eos)


def test_chat_answer_names_paris(engine_outputs):
    text = engine_outputs["chat"]["text"]
    assert "Paris" in text, text


# -- int8 KV: the start-up check and the quality spot checks ------------------------------------


@pytest.fixture(scope="module")
def int8_runner(smollm2):
    """The worker on int8 KV with the default floor and spot checks on: it started, so its check passed."""
    from radixrt.worker.model_runner import ModelRunner

    return ModelRunner(ServerArgs(model_path=str(smollm2.hf_dir), kv_cache_dtype="int8", quality_spot_check_rate=1.0,
                                  **RUNNER_ARGS))


def test_int8_startup_check_passes_the_default_floor(int8_runner):
    report = int8_runner.kv_check
    assert int8_runner.args.kv_quant_min_agreement == KV_QUANT_MIN_AGREEMENT
    assert report is not None and report.positions > 200, report
    assert KV_QUANT_MIN_AGREEMENT <= report.top1_agreement <= 1.0, report
    # int8 does move a real model: its logprobs (on an AVX2-only EPYC every top-1 token stayed: 1.0)
    assert 0 < report.mean_abs_dlogprob < CHECK_MAX_MEAN_DLOGPROB, report


def test_a_floor_above_the_measured_agreement_refuses(int8_runner, smollm2):
    """The same check over another int8 pool of the serving pool's size (the same prompts, cut the
    same way, so the same measurement) with the floor halfway between it and 1 (just above 1 when it
    measured 1) raises, naming both."""
    from radixrt.worker.runner_setup import attention_over

    r, cache = int8_runner, int8_runner.cache
    _, page, kv_heads, head_dim = cache.k[0].shape
    pool = PagedKVCache(len(cache.k), cache.num_pages, page, kv_heads, head_dim, cache.dtype, cache.k[0].device, "int8")

    def over(p: PagedKVCache) -> object:
        return attention_over(r.backend_name, p, r.cfg, r.tp)

    measured = r.kv_check.top1_agreement
    floor = (measured + 1.0) / 2 if measured < 1 else 1.0 + 1e-6  # above even a perfect agreement
    prompts = calibration_prompts(tokenizer(smollm2.hf_dir), None)
    with pytest.raises(KVCalibrationError, match="kv_cache_dtype int8: the start-up check") as refused:
        check_quantized_pool(r.model, over(pool), over, prompts, None, floor)
    message = str(refused.value)
    assert f"top-1 agreement {measured:.4f}" in message and f"kv_quant_min_agreement {floor}" in message


@pytest.fixture(scope="module")
def spot_stats(int8_runner, prompts):
    """Serve the prompts over the int8 pool (greedy, every request spot-checked), then run the
    spot checks as the scheduler process does in idle time -> (the scheduler's stats, tokens emitted)."""
    from radixrt.config_views import SchedulerConfig
    from radixrt.messages import TokenizedRequest
    from radixrt.sampling_params import SamplingParams
    from radixrt.scheduler.scheduler import Scheduler
    from radixrt.scheduler.step import drive

    sched = Scheduler(SchedulerConfig.of(int8_runner.args), int8_runner.ready_message(), tokenizer=None)
    for name, ids in prompts.items():
        sched.add_request(TokenizedRequest(name, ids, SamplingParams(max_new_tokens=SPOT_MAX_NEW, temperature=0)))
    outputs = drive(sched, int8_runner)
    while sched.spot.has_work:
        sched.spot.record(int8_runner.spot_check(sched.spot.next_message()))
    emitted = sum(len(o.new_ids) for o in outputs)
    return sched.stats(), emitted


def test_spot_checks_score_every_served_request(spot_stats, prompts):
    stats, emitted = spot_stats
    assert stats.quality_spot_checks == len(prompts) and stats.quality_spot_checks_skipped == 0
    assert stats.quality_spot_check_tokens == emitted and stats.quality_spot_checks_pending == 0


def test_spot_check_figures_are_in_a_trained_models_range(spot_stats):
    stats, _ = spot_stats
    assert stats.quality_top1_agreement >= SPOT_MIN_AGREEMENT, stats
    assert 0 < stats.quality_mean_abs_dlogprob < SPOT_MAX_MEAN_DLOGPROB, stats
