"""Bounded-KV retention in the scheduler's page accounting, against a worker that keeps real page contents."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.fake_worker import FakeWorker, reference_generate
from support.scheduling import CharTokenizer, assert_idle_pool, make, run, tree_pages

from radixrt.config import ServerArgs
from radixrt.config_views import SchedulerConfig
from radixrt.errors import RequestError
from radixrt.messages import TokenizedRequest
from radixrt.retention.policies import budget_for
from radixrt.retention.rules import RetentionRules
from radixrt.settings.retention import (
    Retention,
    RetentionIn,
    RetentionPolicy,
    parse_override,
)
from radixrt.sampling_params import SamplingParams
from radixrt.scheduler.scheduler import Scheduler

SINK_WINDOW = {"policy": "sink_window", "sink_tokens": 4, "window_tokens": 32}
# the door of a worker that runs every policy at any budget: what the tokenizer manager resolves a request's override
# into, under the server's default settings
OPEN_DOOR = RetentionRules(ServerArgs(model_path="unused").retention, page_size=1, context_length=1 << 40, refusals={},
                           longrope=False)


def req(rid: str, prompt: list[int], max_new: int, retention: dict | str | None = None) -> TokenizedRequest:
    sp = SamplingParams.from_dict({"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0,
                                   **({"kv_retention": retention} if retention is not None else {})})
    return TokenizedRequest(rid, prompt, sp, retention=OPEN_DOOR.resolve(sp.kv_retention))


def budget(page_size: int, policy: str, sink_tokens: int = 4, window_tokens: int = 1024, heavy_ratio: float = 0.2):
    return budget_for(Retention(RetentionPolicy(policy), sink_tokens, window_tokens, heavy_ratio), page_size)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7 + i * 3) % 40 + 1 for i in range(n)]


# -- which pages go ------------------------------------------------------------------


def test_budgets_round_sinks_up_to_pages_and_size_heavy_hitters_from_the_window():
    sw = budget(16, "sink_window", 4, 256, 0.2)
    assert (sw.sink_pages, sw.window_pages, sw.heavy_pages, sw.max_pages) == (1, 16, 0, 18)
    hh = budget(16, "heavy_hitter", 4, 256, 0.2)
    assert (hh.sink_pages, hh.window_pages, hh.heavy_pages, hh.max_pages) == (0, 16, 4, 21)
    assert sw.chunk_tokens == 4 * 16 and hh.chunk_tokens == 5 * 16


def test_sink_window_drops_the_oldest_pages_after_the_sinks():
    b = budget(4, "sink_window", 8, 32, 0.2)  # 2 sink pages, 8 window pages, max 11
    assert b.drops(40, 4, []) == []  # 11 pages after the step: within the budget
    assert b.drops(44, 1, []) == [2]
    assert b.drops(44, 8, []) == [2, 3]


def test_heavy_hitter_drops_the_least_attended_pages_outside_the_recent_window():
    b = budget(4, "heavy_hitter", 0, 16, 0.5)  # 4 recent pages, 2 heavy, max 7
    mass = [9.0, 1.0, 5.0, 0.5, 7.0, 0.0, 0.0]  # pages 3..6 are the recent window
    assert b.drops(28, 1, mass) == [1]
    assert b.drops(28, 5, mass) == [1, 2]
    # a step that needs more than the old pages gives up the oldest recent ones, never the page being filled
    assert b.drops(26, 12, mass) == [1, 0, 2]  # pages 2..5 are recent now


@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(["sink_window", "heavy_hitter"]), page_size=st.sampled_from([1, 4, 16]),
       sink=st.integers(0, 40), window=st.integers(1, 120), steps=st.lists(st.integers(1, 400), min_size=1, max_size=60))
def test_any_schedule_of_chunks_stays_within_the_budget_and_keeps_the_sinks(policy, page_size, sink, window, steps):
    b = budget(page_size, policy, sink, window, 0.3)
    kv_len, pages, mass = 0, [], []  # pages: the first token position of each kept page
    for n in steps:
        n = min(n, b.chunk_tokens)
        drop = b.drops(kv_len, n, mass)
        assert len(drop) == len(set(drop)) and all(j < kv_len // page_size for j in drop), "only full pages go"
        keep = [j for j in range(len(pages)) if j not in drop]
        pages, mass = [pages[j] for j in keep], [mass[j] for j in keep]
        kv_len -= len(drop) * page_size
        start = (pages[-1] + page_size) if pages and kv_len % page_size == 0 else None
        kv_len += n
        while len(pages) < math.ceil(kv_len / page_size):
            pages.append(start if start is not None else len(pages) * page_size)
            start = None
            mass.append(float(len(pages) % 5))
        assert len(pages) <= b.max_pages
        if policy == "sink_window" and pages:
            assert pages[: min(b.sink_pages, len(pages))] == [j * page_size for j in range(min(b.sink_pages, len(pages)))]


# -- through the scheduler ------------------------------------------------------------


def make_bounded(num_pages: int, page_size: int, context_length: int = 4096, **args) -> tuple[Scheduler, FakeWorker]:
    worker = FakeWorker(num_pages, page_size, context_length=context_length)
    server_args = ServerArgs(model_path="unused", page_size=page_size, schedule_policy="fcfs", **args)
    return Scheduler(SchedulerConfig.of(server_args), worker.ready, CharTokenizer()), worker


@pytest.mark.parametrize("page_size", [1, 4])
def test_sink_window_generates_past_the_context_from_a_small_pool_with_sinks_and_a_recent_window(page_size):
    s, w = make_bounded(16 * 4 // page_size, page_size, context_length=96)  # a 64-token pool, a 96-token context
    p = prompt(10)
    outs, finish = run(s, w, [req("a", p, 300, SINK_WINDOW)])
    assert outs["a"] == reference_generate(p, 300)  # the fake model reads the last 8 tokens: always kept
    assert finish["a"].type == "length" and len(p) + 300 > 96
    b = budget(page_size, **SINK_WINDOW)
    assert s.stats().kv_retention_peak_pages <= b.max_pages
    seq = p + outs["a"]
    for length, view in w.views:  # the sinks, then a contiguous recent stretch of the sequence
        assert view[: b.sink_tokens] == seq[: b.sink_tokens]
        tail = view[b.sink_tokens :]
        assert tail == seq[length - len(tail) : length]
    stats = s.stats()
    assert stats.kv_retention_dropped_pages > 0 and stats.kv_retention_requests["sink_window"] == 1
    assert_idle_pool(s)


def test_a_budget_larger_than_the_sequence_changes_nothing():
    runs = {}
    for name, retention in (("none", None), ("roomy", {"policy": "sink_window", "window_tokens": 512})):
        s, w = make(40, 4)
        p = prompt(30)
        outs, _ = run(s, w, [req("a", p, 60, retention), req("b", p + [3], 20, retention)])
        runs[name] = (outs, sorted(tree_pages(s.mem.cache)), s.stats().cached_prompt_tokens, w.views)
        assert_idle_pool(s)
    assert runs["roomy"][:3] == runs["none"][:3]
    assert runs["roomy"][3] == [], "no drop, no offset: the worker sees ordinary entries"


def test_kv_computed_after_a_drop_never_reaches_the_cache_and_the_prompt_before_it_does():
    s, w = make(64, 4)
    p = prompt(20)
    outs, _ = run(s, w, [req("bounded", p, 100, SINK_WINDOW)])  # drops after about 40 tokens
    assert s.stats().kv_retention_dropped_pages > 0
    # a full-attention request over the same prompt and output reuses the prompt's pages, nothing after
    outs2, _ = run(s, w, [req("full", p + outs["bounded"], 4)])
    assert outs2["full"] == reference_generate(p + outs["bounded"], 4)
    assert s.counters["cached_prompt_tokens"] == 20 // 4 * 4
    assert_idle_pool(s)


def test_a_bounded_request_reuses_ordinary_prompt_pages_up_to_its_budget():
    s, w = make(64, 4)
    p = prompt(100)
    run(s, w, [req("full", p, 2)])
    before = s.counters["cached_prompt_tokens"]
    outs, _ = run(s, w, [req("bounded", p, 30, SINK_WINDOW)])
    b = budget(4, **SINK_WINDOW)
    assert s.counters["cached_prompt_tokens"] - before == b.max_tokens - 4  # the match stops a page short of the budget
    assert len(outs["bounded"]) == 30
    assert_idle_pool(s)


def test_heavy_hitter_keeps_the_recent_window_and_drops_the_least_attended_pages():
    s, w = make_bounded(40, 4, context_length=80)
    p = prompt(12)
    retention = {"policy": "heavy_hitter", "window_tokens": 16, "heavy_ratio": 0.5}
    outs, _ = run(s, w, [req("a", p, 120, retention)])
    assert outs["a"] == reference_generate(p, 120)  # the recent window always holds the last 8 tokens
    b = budget(4, "heavy_hitter", 4, 16, 0.5)
    assert s.stats().kv_retention_peak_pages <= b.max_pages
    assert s.stats().kv_retention_requests["heavy_hitter"] == 1
    assert_idle_pool(s)


def test_bounded_requests_under_pressure_are_retracted_and_still_complete():
    # three budgets of 10 pages in a pool of 22: a first drop copies the cached pages it keeps, so one needs 2x its budget
    s, w = make_bounded(22, 4, context_length=64, preemption_mode="auto", swap_min_tokens=0)
    reqs = [req(f"r{i}", prompt(9, i), 90, SINK_WINDOW) for i in range(3)]
    outs, _ = run(s, w, reqs)
    for i in range(3):
        assert outs[f"r{i}"] == reference_generate(prompt(9, i), 90)
    assert s.stats().retractions > 0
    assert_idle_pool(s)


def refusal(door: RetentionRules, retention: dict | str) -> RequestError:
    """What the door (Intake.prepare) raises for a request with this kv_retention."""
    with pytest.raises(RequestError) as e:
        door.resolve(parse_override(retention))
    return e.value


def test_bad_retention_values_are_refused_naming_the_field():
    _, w = make_bounded(64, 4, context_length=64)
    door = RetentionRules.for_worker(ServerArgs(model_path="unused", page_size=4).retention, w.ready)
    for retention, field in ((SINK_WINDOW | {"window_tokens": 100}, "sampling_params.kv_retention.window_tokens"),):
        e = refusal(door, retention)
        assert e.status == 400 and field in e.message
    assert door.resolve(parse_override(SINK_WINDOW)) == Retention().with_override(RetentionIn(**SINK_WINDOW))
    with pytest.raises(ValueError, match="kv_window_tokens"):
        make_bounded(64, 4, context_length=64, kv_retention="sink_window", kv_window_tokens=200)


def test_heavy_hitter_is_refused_where_the_worker_cannot_report_attention_mass():
    worker = FakeWorker(64, 4)
    worker.ready.retention_refusals = {"heavy_hitter": "no mass here"}
    door = RetentionRules.for_worker(ServerArgs(model_path="unused", page_size=4).retention, worker.ready)
    e = refusal(door, "heavy_hitter")
    assert e.status == 400 and "sampling_params.kv_retention.policy heavy_hitter: no mass here" in e.message
    with pytest.raises(ValueError, match="kv_retention heavy_hitter: no mass here"):
        Scheduler(SchedulerConfig.of(ServerArgs(model_path="unused", page_size=4, kv_retention="heavy_hitter")), worker.ready, CharTokenizer())
