"""scripts/gen_tenant_trace.py: the multi-tenant trace bench/kv_tiers.py runs is deterministic, outgrows
a device pool of a quarter of its working set, marks its pins, and interleaves its tenants."""

from __future__ import annotations

import collections
import itertools
from pathlib import Path

import pytest
from gen_tenant_trace import PIN, SAMPLE, TraceSpec, make_trace, prefix_pages, to_jsonl, working_set_pages

PAGE = 16


@pytest.fixture(scope="module")
def trace() -> list[dict]:
    return make_trace(TraceSpec(requests=240))


def test_the_same_seed_gives_the_same_trace_and_another_seed_another():
    spec = TraceSpec(requests=60)
    assert to_jsonl(make_trace(spec)) == to_jsonl(make_trace(spec))
    assert make_trace(TraceSpec(requests=60, seed=34)) != make_trace(spec)


def test_the_shipped_sample_is_its_generators_output():
    assert Path(SAMPLE).read_text() == to_jsonl(make_trace(TraceSpec(requests=120)))


def test_its_distinct_prefixes_outgrow_a_pool_of_a_quarter_of_its_working_set(trace):
    pool = working_set_pages(trace, PAGE) // 4
    sizes = sorted(prefix_pages(trace, PAGE).values())
    assert sum(sizes) > 2 * pool
    fit = next(i for i in range(len(sizes) + 1) if sum(sizes[: i + 1]) > pool)  # even the smallest first
    assert fit < len(sizes) / 2
    assert len(sizes) >= 30


def test_pinned_requests_carry_cache_control_and_pin_only_their_shared_prefix(trace):
    pinned = [r for r in trace if r["pinned"]]
    assert len(pinned) >= 10 and len(pinned) < len(trace) / 4
    assert all(r["cache_control"] == PIN == {"type": "ephemeral", "ttl": "5m"} for r in pinned)
    assert not any("cache_control" in r for r in trace if not r["pinned"])
    assert {r["tenant"] for r in pinned} == {"t0", "t1", "t2"}
    for r in pinned:  # a whole-prompt pin holds exactly the prefix's full pages
        assert r["kind"] == "doc" and r["prefix_len"] % PAGE == 0
        assert len(r["input_ids"]) // PAGE == r["prefix_len"] // PAGE


def test_every_request_starts_with_its_shared_prefix_and_popularity_falls_with_rank(trace):
    by_prefix = collections.defaultdict(list)
    for r in trace:
        if r["kind"] != "chat":
            by_prefix[r["prefix"]].append(r["input_ids"][: r["prefix_len"]])
    assert all(all(p == ps[0] for p in ps) for ps in by_prefix.values())
    docs = collections.Counter(int(r["prefix"].split("/d")[1]) for r in trace if r["kind"] == "doc")
    assert docs[0] > docs[2] > docs[9]
    uploads = collections.Counter(r["prefix"] for r in trace if r["kind"] == "upload")
    assert max(uploads.values()) <= 3  # one-off documents: a short burst, never again


def test_arrivals_interleave_tenants_and_chat_turns_extend_their_history(trace):
    assert [r["arrival"] for r in trace] == sorted(r["arrival"] for r in trace)
    assert [r["id"] for r in trace] == list(range(len(trace)))
    switches = sum(a["tenant"] != b["tenant"] for a, b in itertools.pairwise(trace))
    assert switches > len(trace) / 2
    turns = collections.defaultdict(list)
    for r in trace:
        if r["kind"] == "chat":
            turns[r["conversation"]].append(r)
    assert sum(len(t) > 1 for t in turns.values()) >= 5
    for conv in turns.values():
        assert [r["turn"] for r in conv] == list(range(len(conv)))
        for prev, nxt in itertools.pairwise(conv):
            assert nxt["input_ids"][: len(prev["input_ids"])] == prev["input_ids"]
            assert nxt["prefix_len"] > len(prev["input_ids"])  # its history holds the previous turn and a reply


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="question_len"):
        TraceSpec(question_len=(4, 16))
    with pytest.raises(ValueError, match="pin_ranks"):
        TraceSpec(pin_ranks=(10,))
    with pytest.raises(ValueError, match="doc_share"):
        TraceSpec(doc_share=0.9, upload_share=0.2)
