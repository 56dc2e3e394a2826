"""The scheduler's side of monitoring, without a model: which requests a quality spot check
samples, its queue (full, skipped, chunked), its figures and rate-limited warning
(scheduler/spot_checks.py); queueing times riding on outputs and the KV peak
(scheduler/figures.py); and compare_at, the one comparison behind the spot checks and the
quantized pool's start-up check."""

from __future__ import annotations

import logging

import pytest
import torch

from radixrt.messages import FinishReason, ReqOutput, SpotCheckResult, WorkerMemory, WorkerReady
from radixrt.sampling_params import SamplingParams
from radixrt.scheduler.figures import SchedulerFigures
from radixrt.scheduler.req import Req
from radixrt.scheduler.spot_checks import SpotChecks
from radixrt.worker.kv_calibration import compare_at, compare_logits

GREEDY = {"temperature": 0, "max_new_tokens": 8}


def req(rid: str = "r", **sampling) -> Req:
    return Req(rid, [1, 2, 3], SamplingParams.from_dict({**GREEDY, **sampling}))


def finished(checks: SpotChecks, r: Req, outputs: int = 3, kind: str = "length") -> None:
    checks.sample(r)
    r.output_ids = list(range(10, 10 + outputs))
    r.live_logprobs = [-0.5] * outputs
    r.finish = FinishReason(kind)
    checks.on_finish(r)


@pytest.mark.parametrize("sampling, checked", [
    ({}, True), ({"top_k": 1, "temperature": 0.7}, True), ({"temperature": 0.7}, False),
    ({"repetition_penalty": 1.2}, False), ({"min_new_tokens": 2}, False), ({"regex": "[a-z]+"}, False),
])
def test_only_plain_greedy_requests_are_sampled(sampling, checked):
    r = req(**sampling)
    SpotChecks(1.0, 0.9, 4, 0, 1000).sample(r)
    assert r.spot_check is checked


def test_rate_samples_about_that_share_and_zero_samples_none():
    some, none = SpotChecks(0.25, 0.9, 4, 0, 1000), SpotChecks(0.0, 0.9, 4, 0, 1000)
    rs = [req(str(i)) for i in range(2000)]
    for r in rs:
        some.sample(r)
    assert 0.2 < sum(r.spot_check for r in rs) / len(rs) < 0.3
    none.sample(rs[0])
    assert not rs[0].spot_check


def test_queue_takes_finished_requests_and_skips_what_it_cannot_check():
    checks = SpotChecks(1.0, 0.9, 2, 0, max_tokens=10)
    finished(checks, req("aborted"), kind="abort")  # not run to its end: not queued, not skipped
    long = req("long")
    finished(checks, long, outputs=8)  # 3 + 8 > 10 tokens: the reference pool cannot hold it
    short_lp = req("missing")
    checks.sample(short_lp)
    short_lp.output_ids, short_lp.live_logprobs, short_lp.finish = [5, 6], [-1.0], FinishReason("stop")
    checks.on_finish(short_lp)  # a logprob missing: skipped
    assert checks.skipped == 2 and not checks.has_work
    for i in range(3):  # a queue of 2: the oldest of three is dropped
        finished(checks, req(f"ok{i}"))
    assert checks.skipped == 3 and [j.check_id for j in checks.pending] == [1, 2]


def test_a_check_runs_chunk_by_chunk_and_its_figures_are_token_weighted():
    checks = SpotChecks(1.0, 0.9, 4, 0, 1000)
    finished(checks, req("a"), outputs=2)
    finished(checks, req("b"), outputs=6)
    first = checks.next_message()
    assert first.output_ids == [10, 11] and first.live_logprobs == [-0.5, -0.5]
    checks.record(SpotCheckResult(first.check_id, done=False))
    again = checks.next_message()
    assert again.check_id == first.check_id and again.output_ids == []  # later chunks carry only the id
    checks.record(SpotCheckResult(first.check_id, True, 2, top1_agreement=0.5, mean_abs_dlogprob=0.2))
    second = checks.next_message()
    checks.record(SpotCheckResult(second.check_id, True, 6, top1_agreement=1.0, mean_abs_dlogprob=0.1))
    s = checks.stats()
    assert s["quality_spot_checks"] == 2 and s["quality_spot_check_tokens"] == 8
    assert s["quality_top1_agreement"] == pytest.approx((0.5 * 2 + 6) / 8)
    assert s["quality_mean_abs_dlogprob"] == pytest.approx((0.2 * 2 + 0.1 * 6) / 8)
    assert s["quality_last_top1_agreement"] == 1.0 and s["quality_spot_checks_pending"] == 0


def test_low_agreement_warns_once_a_minute_and_a_failed_check_counts_as_skipped(caplog):
    checks = SpotChecks(1.0, 0.9, 4, 0, 1000)
    with caplog.at_level(logging.WARNING, logger="radixrt.scheduler.spot_checks"):
        for i in range(3):
            checks.record(SpotCheckResult(i, True, 4, top1_agreement=0.5))
    assert sum("below 0.900" in r.message for r in caplog.records) == 1
    checks.record(SpotCheckResult(9, True, error="refused"))
    assert checks.stats()["quality_spot_checks_skipped"] == 1 and checks.checks == 3


def test_queue_time_rides_on_the_first_output_after_the_first_schedule():
    fig = SchedulerFigures(WorkerReady(1, 16, 10, 64, [0], 8, page_bytes=128), tp_size=2)
    fig.arrived("a")
    fig.scheduled("a")
    fig.scheduled("a")  # a retracted request scheduled again: its queueing ended the first time
    outs = [ReqOutput("a", [1]), ReqOutput("a", [2], FinishReason("length"))]
    fig.attach(outs[:1])
    fig.attach(outs[1:])
    assert outs[0].queue_time is not None and outs[0].queue_time >= 0 and outs[1].queue_time is None
    fig.arrived("never")  # refused before it ran: no queueing time, and nothing kept once it is answered
    fig.attach([ReqOutput("never", [], FinishReason("abort"))])
    assert not fig._arrived and not fig._queue_times


def test_peak_pages_memory_and_tier_bytes():
    fig = SchedulerFigures(WorkerReady(1, 16, 10, 64, [0], 8, page_bytes=128, memory=WorkerMemory(rss=5)), tp_size=2)
    for used in (3, 9, 4):
        fig.note_used(used)
    fig.note_memory(None)  # a result without figures keeps the last ones
    s = fig.stats({"host_pages": 10, "host_cached_pages": 2, "host_swap_pages": 1})
    assert s["kv_peak_used_pages"] == 9 and s["worker_rss_bytes"] == 5
    assert s["host_tier_used_bytes"] == 3 * 256 and s["host_tier_capacity_bytes"] == 10 * 256  # both ranks' pages
    fig.note_memory(WorkerMemory(rss=7, limit=100))
    assert fig.stats({})["worker_rss_bytes"] == 7 and fig.stats({})["disk_tier_used_bytes"] == 0


def test_compare_logits_is_compare_at_the_reference_top_token():
    torch.manual_seed(0)
    ref, cand = torch.randn(20, 50), torch.randn(20, 50)
    full = compare_logits(ref, cand)
    ref_lp, cand_lp = torch.log_softmax(ref, -1), torch.log_softmax(cand, -1)
    top = ref_lp.argmax(-1)
    at = compare_at(ref_lp[torch.arange(20), top], top, cand_lp[torch.arange(20), top], cand_lp.argmax(-1))
    assert at == full
    with pytest.raises(ValueError):
        compare_at(torch.zeros(2), torch.zeros(3, dtype=torch.long), torch.zeros(2), torch.zeros(2, dtype=torch.long))
