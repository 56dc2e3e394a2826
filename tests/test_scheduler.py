"""The scheduler's bookkeeping, without processes or tensors, against a worker that keeps real page contents."""

from __future__ import annotations

import random

import pytest

from support.fake_worker import reference_generate
from radixrt.messages import TokenizedRequest
from radixrt.namespace import CacheNamespace
from radixrt.sampling_params import SamplingParams
from radixrt.scheduler.step import drive, step
from support.scheduling import (
    CharTokenizer,
    assert_idle_pool,
    make,
    req,
    run,
)


def test_outputs_follow_the_true_sequence_with_chunking_and_late_arrivals():
    rng = random.Random(0)
    for page_size in (1, 4, 16):
        s, w = make(num_pages=4096 // page_size, page_size=page_size, chunked_prefill_size=37)
        reqs = [req(f"r{i}", [rng.randrange(50) for _ in range(rng.randint(1, 120))], rng.randint(1, 30)) for i in range(20)]
        outputs, finish = run(s, w, reqs, arrivals={i: i * 3 for i in range(20)})
        for r in reqs:
            assert outputs[r.rid] == reference_generate(r.input_ids, r.sampling.max_new_tokens)
            assert finish[r.rid].type == "length"
        assert_idle_pool(s)


def test_small_pool_retracts_and_still_completes_every_request():
    rng = random.Random(1)
    s, w = make(num_pages=40, page_size=4, chunked_prefill_size=64)  # 160 tokens for 12 requests of ~100
    reqs = [req(f"r{i}", [rng.randrange(50) for _ in range(rng.randint(30, 70))], 40) for i in range(12)]
    outputs, finish = run(s, w, reqs)
    for r in reqs:
        assert outputs[r.rid] == reference_generate(r.input_ids, 40), r.rid
    assert s.stats().retractions > 0
    assert_idle_pool(s)


def test_a_sequence_larger_than_the_pool_is_aborted_with_a_reason():
    s, w = make(num_pages=4, page_size=4)  # 16 tokens
    outputs, finish = run(s, w, [req("big", list(range(30)), 4), req("ok", [1, 2, 3], 4)])
    assert finish["big"].type == "abort" and "pool" in finish["big"].message
    assert outputs["ok"] == reference_generate([1, 2, 3], 4)
    s, w = make(num_pages=4, page_size=4)
    outputs, finish = run(s, w, [req("grows", [1] * 10, 20)])  # fits at first, outgrows the pool while decoding
    assert finish["grows"].type == "abort"
    assert_idle_pool(s)


def test_stop_token_stop_string_and_prefill_only():
    s, w = make(num_pages=256, page_size=1)
    prompt = [3, 1, 4, 1, 5]
    full = reference_generate(prompt, 20)
    stop_tok = full[5]
    text = CharTokenizer().decode(full)
    stop_str = text[8:10]
    reqs = [
        TokenizedRequest("tok", prompt, SamplingParams(max_new_tokens=20, stop_token_ids=[stop_tok], temperature=0)),
        TokenizedRequest("str", prompt, SamplingParams(max_new_tokens=20, stop=[stop_str], temperature=0)),
        TokenizedRequest("zero", prompt, SamplingParams(max_new_tokens=0)),
    ]
    outputs, finish = run(s, w, reqs)
    assert outputs["tok"] == full[: full.index(stop_tok) + 1]
    assert finish["tok"].matched == stop_tok
    assert finish["str"].matched == stop_str
    assert stop_str in CharTokenizer().decode(outputs["str"]) and stop_str not in CharTokenizer().decode(outputs["str"][:-1])
    assert outputs["zero"] == [] and finish["zero"].type == "length" and finish["zero"].length == 0


def test_abort_returns_pages():
    s, w = make(num_pages=256, page_size=1)
    s.add_request(req("a", [1, 2, 3], 100))
    s.add_request(req("b", [4, 5, 6], 100))
    for _ in range(5):
        step(s, w)
    s.abort("a")
    s.abort("b")
    outs = {o.rid: o for o in s.take_outputs() if o.finish is not None}
    assert outs["a"].finish.type == "abort" and outs["b"].finish.type == "abort"
    assert s.idle
    assert_idle_pool(s)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_shared_document_is_computed_once_and_hit_by_every_question(page_size, policy):
    rng = random.Random(2)
    doc = [rng.randrange(50) for _ in range(300)]
    s, w = make(num_pages=4096 // page_size, page_size=page_size, schedule_policy=policy, chunked_prefill_size=128)
    reqs = [req(f"q{i}", doc + [rng.randrange(50) for _ in range(rng.randint(3, 20))], 8) for i in range(16)]
    computed = []
    orig = w.forward
    w.forward = lambda b: computed.append(sum(len(e.input_ids) for e in b.entries)) or orig(b)
    outputs, _ = run(s, w, reqs)
    for r in reqs:
        assert outputs[r.rid] == reference_generate(r.input_ids, 8)
    prompt_tokens = sum(len(r.input_ids) for r in reqs)
    # the document once, each question's own tokens, and the decodes: nothing recomputed twice
    assert sum(computed) <= len(doc) + (prompt_tokens - 16 * len(doc)) + 16 * 8 + 16 * page_size
    assert s.stats().cache_hit_rate > 0.85
    assert_idle_pool(s)


def test_copy_on_write_reuses_the_partial_last_page():
    s, w = make(num_pages=256, page_size=16)
    prompt = list(range(1, 41))  # 2.5 pages
    out1, _ = run(s, w, [req("a", prompt, 5)])
    # The next turn extends prompt + output: everything computed (all but the last output token) is reused.
    turn2 = prompt + out1["a"] + [7, 8, 9]
    out2, _ = run(s, w, [req("b", turn2, 5)])
    assert out2["b"] == reference_generate(turn2, 5)
    r_cached = s.counters["cached_prompt_tokens"] - 0
    assert r_cached == 0 + (len(prompt) + 5 - 1)  # first request hit nothing; b hit all that a computed
    assert_idle_pool(s)


def test_the_same_prompt_twice_reports_all_but_the_last_token_cached():
    for page_size in (1, 16):
        s, w = make(num_pages=256, page_size=page_size)
        prompt = [i % 50 for i in range(3, 60)]  # in the fake vocabulary
        outs = []
        for rid in ("first", "second"):
            s.add_request(req(rid, prompt, 3))
            outs += [o for o in drive(s, w) if o.finish is not None]
        assert [o.cached_tokens for o in outs] == [0, len(prompt) - 1]


def test_namespaces_never_share():
    s, w = make(num_pages=256, page_size=4)
    prompt, tenant_a, tenant_b = list(range(40)), CacheNamespace(salt="tenant-a"), CacheNamespace(salt="tenant-b")
    a = TokenizedRequest("a", prompt, SamplingParams(max_new_tokens=2, temperature=0), namespace=tenant_a)
    b = TokenizedRequest("b", prompt, SamplingParams(max_new_tokens=2, temperature=0), namespace=tenant_b)
    c = TokenizedRequest("c", prompt, SamplingParams(max_new_tokens=2, temperature=0), namespace=tenant_a)
    run(s, w, [a])
    run(s, w, [b])
    assert s.counters["cached_prompt_tokens"] == 0
    run(s, w, [c])
    assert s.counters["cached_prompt_tokens"] == len(prompt) - 1


def test_disabled_cache_keeps_nothing_and_flush_refuses_while_busy():
    s, w = make(num_pages=256, page_size=4, disable_radix_cache=True)
    run(s, w, [req("a", list(range(40)), 3), req("b", list(range(40)), 3)])
    assert s.mem.cache.total_pages == 0 and s.counters["cached_prompt_tokens"] == 0
    assert_idle_pool(s)
    s, w = make(num_pages=256, page_size=4)
    run(s, w, [req("a", list(range(40)), 3)])
    assert s.mem.cache.total_pages > 0
    s.add_request(req("b", list(range(10)), 3))
    assert "running" in s.flush_cache() or "waiting" in s.flush_cache()
    run(s, w, [])
    assert s.flush_cache() is None and s.mem.cache.total_pages == 0
    assert s.mem.allocator.num_free == 256


def test_pressure_evicts_before_retracting_and_everything_completes():
    rng = random.Random(5)
    s, w = make(num_pages=60, page_size=4, schedule_policy="lpm", chunked_prefill_size=64)
    docs = [[rng.randrange(50) for _ in range(80)] for _ in range(4)]
    reqs = [req(f"r{i}", docs[i % 4] + [i, i + 1], 24) for i in range(24)]
    outputs, finish = run(s, w, reqs, arrivals={i: i for i in range(24)})
    for r in reqs:
        assert outputs[r.rid] == reference_generate(r.input_ids, 24), r.rid
    st = s.stats()
    assert st.evicted_pages > 0
    assert_idle_pool(s)


@pytest.mark.parametrize("page_size", [1, 4])
def test_tiers_bring_back_the_right_pages(page_size, tmp_path):
    """More documents than the pool holds, host smaller still, disk below: every load must put
    the right tokens' KV at the right place, or the fake model's predictions change."""
    rng = random.Random(7)
    pool = 160 // page_size
    tiers = {"host_pages": pool, "disk_dir": str(tmp_path), "disk_pages": 3 * pool}
    s, w = make(pool, page_size, tiers, schedule_policy="lpm", chunked_prefill_size=48, enable_hierarchical_cache=True)
    docs = [[rng.randrange(50) for _ in range(rng.randint(60, 90))] for _ in range(6)]
    reqs = [req(f"r{i}", docs[d] + [i % 50, 7], 6) for i, d in enumerate([0, 1, 2, 3, 4, 5, 5, 3, 1, 0, 2, 4, 0, 5])]
    outputs, _ = run(s, w, reqs, arrivals={i: 40 * i for i in range(len(reqs))})
    for r in reqs:
        assert outputs[r.rid] == reference_generate(r.input_ids, 6), r.rid
    st = s.stats()
    assert st.host_hit_pages > 0 and st.disk_hit_pages > 0, st
    assert len(w.disk) == st.disk_cached_pages and st.host_swap_pages == 0
    assert_idle_pool(s)
    assert s.flush_cache() is None  # the device and host tiers forget; the disk tier persists
    st = s.stats()
    assert st.cached_pages == st.host_cached_pages == 0 and st.disk_cached_pages == len(w.disk) > 0


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swapped_requests_resume_exactly(mode):
    rng = random.Random(3)
    s, w = make(num_pages=40, page_size=4, tiers={"host_pages": 200}, preemption_mode=mode, swap_min_tokens=75,
                chunked_prefill_size=64)
    reqs = [req(f"r{i}", [rng.randrange(50) for _ in range(rng.randint(30, 70))], 40) for i in range(12)]
    outputs, _ = run(s, w, reqs)
    for r in reqs:
        assert outputs[r.rid] == reference_generate(r.input_ids, 40), r.rid
    st = s.stats()
    assert st.swaps_out > 0 and st.swaps_in == st.swaps_out and st.host_swap_pages == 0
    # auto swaps only the victims holding >= 75 tokens; the others recompute (from the radix cache, here)
    assert (st.retractions == st.swaps_out) == (mode == "swap"), st
    assert_idle_pool(s)


def test_aborting_a_swapped_out_request_frees_its_host_slots():
    rng = random.Random(4)
    s, w = make(num_pages=40, page_size=4, tiers={"host_pages": 200}, preemption_mode="swap", chunked_prefill_size=64)
    for i in range(12):
        s.add_request(req(f"r{i}", [rng.randrange(50) for _ in range(60)], 40))
    while not any(r.kv.is_swapped for r in s.waiting):
        step(s, w)
    victim = next(r for r in s.waiting if r.kv.is_swapped)
    assert s.stats().host_swap_pages == len(victim.kv.swap_slots) > 0
    s.abort(victim.rid)
    assert s.stats().host_swap_pages == 0


def test_longest_prefix_first_counts_what_the_lower_tiers_hold(tmp_path):
    rng = random.Random(8)
    s, w = make(24, 4, {"host_pages": 48}, schedule_policy="lpm", enable_hierarchical_cache=True, max_running_requests=1)
    doc = [rng.randrange(50) for _ in range(60)]
    run(s, w, [req("doc", doc + [1], 2)])
    run(s, w, [req(f"other{i}", [rng.randrange(50) for _ in range(60)], 2) for i in range(2)])  # evicts doc to host
    miss, hit = req("miss", [rng.randrange(50) for _ in range(60)], 2), req("hit", doc + [2, 3], 2)
    s.add_request(miss)
    s.add_request(hit)
    assert s.mem.cache.match_prefix(doc).pages == []  # not on the device any more
    scheduled = s.schedule()  # one slot: the policy picks one of the two
    assert [r.rid for r in s.running] == ["hit"] and s.stats().host_hit_pages == 15
    w.move(scheduled.moves)  # what the driver does (step.py), taken apart to look in between
    s.process(w.forward(scheduled.batch))
    first = {o.rid: o.new_ids for o in s.take_outputs()}
    outputs, _ = run(s, w, [])
    for r in (hit, miss):
        assert first.get(r.rid, []) + outputs[r.rid] == reference_generate(r.input_ids, 2), r.rid
    assert_idle_pool(s)


# -- one request's failure fails that request alone ------------------------------------


def test_an_entry_the_worker_fails_finishes_alone_and_its_kv_is_never_reused():
    bad = [7, 7, 3, 9, 1, 4, 2, 8, 5, 6]  # 2.5 pages: the failed decode writes into a page that held good KV
    prompts = {"bad": bad, "ok1": [1, 2, 3, 4, 5], "ok2": [9, 8, 7] * 5}
    fails = lambda seq: "boom" if seq[: len(bad)] == bad and len(seq) == len(bad) + 3 else None  # noqa: E731
    s, w = make(num_pages=64, page_size=4, max_running_requests=1)  # one slot: the next request reuses it
    w.fails = fails
    outputs, finish = run(s, w, [req(rid, p, 6) for rid, p in prompts.items()])
    assert finish["bad"].type == "abort" and finish["bad"].status_code == 500
    assert finish["bad"].message == "internal error: boom"
    assert outputs["bad"] == reference_generate(bad, 6)[:3]  # what came before the failed step
    for rid in ("ok1", "ok2"):
        assert outputs[rid] == reference_generate(prompts[rid], 6) and finish[rid].type == "length"
    assert_idle_pool(s)
    # The failed step wrote POISON; a request extending the same sequence hits the cache only before it.
    w.fails = None
    again = bad + reference_generate(bad, 4)  # its match could reach into the failed step's position
    cached = s.counters["cached_prompt_tokens"]
    outputs, _ = run(s, w, [req("again", again, 4)])
    assert outputs["again"] == reference_generate(again, 4)
    assert s.counters["cached_prompt_tokens"] - cached == len(bad) + 2  # the KV of the steps that ran
    assert_idle_pool(s)


def test_a_failed_prefill_chunk_frees_its_pages_and_others_in_the_batch_go_on():
    rng = random.Random(11)
    bad = [rng.randrange(50) for _ in range(90)]
    s, w = make(num_pages=128, page_size=4, chunked_prefill_size=32)
    w.fails = lambda seq: "chunk" if seq == bad[:64] else None  # the second chunk
    others = [req(f"r{i}", [rng.randrange(50) for _ in range(rng.randint(5, 40))], 8) for i in range(4)]
    outputs, finish = run(s, w, [req("bad", bad, 8), *others], arrivals={i + 1: i for i in range(4)})
    assert finish["bad"].status_code == 500 and outputs["bad"] == []
    for r in others:
        assert outputs[r.rid] == reference_generate(r.input_ids, 8), r.rid
    assert_idle_pool(s)
    assert s.mem.cache.match_prefix(bad).pages == s.mem.cache.match_prefix(bad[:32]).pages  # only chunk 1 cached


def test_a_stop_check_that_raises_fails_its_request_and_the_rest_finish():
    s, w = make(num_pages=64, page_size=4)
    check = s.stop.check
    s.stop.check = lambda r, new=1: 1 / 0 if r.rid == "bad" and r.output_len == 2 else check(r, new)
    outputs, finish = run(s, w, [req("bad", [1, 2, 3], 5), req("ok", [4, 5, 6], 5)])
    assert finish["bad"].type == "abort" and finish["bad"].status_code == 500
    assert "ZeroDivisionError" in finish["bad"].message
    assert outputs["bad"] == reference_generate([1, 2, 3], 5)[:1]  # the token of the failed check is not sent
    assert outputs["ok"] == reference_generate([4, 5, 6], 5)
    assert_idle_pool(s)


def test_requests_the_model_cannot_run_are_refused_with_400():
    s, w = make(num_pages=64, page_size=4)  # the fake model's context: 4096
    bad = {
        "empty": TokenizedRequest("empty", [], SamplingParams()),
        "vocab": TokenizedRequest("vocab", [1, 50], SamplingParams()),
        "negative": TokenizedRequest("negative", [1, -1], SamplingParams()),
        "long": TokenizedRequest("long", [1] * 4096, SamplingParams()),
        "start": TokenizedRequest("start", [1, 2], SamplingParams(), return_logprob=True, logprob_start_len=2),
        "sampling": TokenizedRequest("sampling", [1, 2], SamplingParams(top_p=0.0)),
    }
    for msg in bad.values():
        s.add_request(msg)
    assert s.idle
    outs = {o.rid: o.finish for o in s.take_outputs()}
    assert outs.keys() == bad.keys()
    assert all(f.type == "abort" and f.status_code == 400 for f in outs.values()), outs
    assert "outside the vocabulary" in outs["vocab"].message and "-1" in outs["negative"].message
    assert "top_p" in outs["sampling"].message and "logprob_start_len" in outs["start"].message
    outputs, _ = run(s, w, [req("ok", [1, 2, 3], 3)])
    assert outputs["ok"] == reference_generate([1, 2, 3], 3)


def test_an_undecodable_message_is_answered_by_its_rid_and_drops_a_request_held_under_it():
    import msgspec

    from radixrt.ipc import Undecodable
    from radixrt.messages import FrontendMsg

    def undecodable(payload) -> Undecodable:
        raw = payload if isinstance(payload, bytes) else msgspec.msgpack.encode(payload)
        try:
            msgspec.msgpack.decode(raw, type=FrontendMsg)
        except msgspec.DecodeError as e:
            return Undecodable(raw, e)
        raise AssertionError("decoded")

    s, w = make(num_pages=64, page_size=4)
    for payload in (b"\xc1garbage", {"type": "TokenizedRequest", "rid": 5, "input_ids": [1], "sampling": {}}, [1, 2]):
        e = undecodable(payload)
        s.reject_undecodable(e.raw, e.error)
    assert s.take_outputs() == []  # nobody to answer
    e = undecodable({"type": "TokenizedRequest", "rid": "x", "input_ids": ["a"], "sampling": {}})
    s.reject_undecodable(e.raw, e.error)
    (out,) = s.take_outputs()
    assert out.rid == "x" and out.new_ids == [] and out.finish.status_code == 400
    assert out.finish.message == "malformed request: input_ids[0]: expected `int`, got `str`"
    s.add_request(req("held", [1, 2, 3, 4, 5], 50))
    for _ in range(3):
        step(s, w)
    e = undecodable({"type": "TokenizedRequest", "rid": "held", "input_ids": [1], "sampling": {"temperature": "hot"}})
    s.reject_undecodable(e.raw, e.error)
    (out,) = s.take_outputs()
    assert out.rid == "held" and out.finish.status_code == 400 and "sampling.temperature" in out.finish.message
    assert_idle_pool(s)


def test_a_match_never_counts_its_own_cached_pages_as_room():
    """Admission pins the match before it counts the room: the cached prefix's pages plus the
    free ones would cover the request, but its own prefix cannot be evicted to make room for it."""
    s, w = make(num_pages=8, page_size=4)
    doc = list(range(16))
    run(s, w, [req("doc", doc, 1)])
    assert s.mem.cache.total_pages == 4 and s.mem.allocator.num_free == 4
    outputs, finish = run(s, w, [req("long", doc + [1] * 20, 1), req("short", doc + [2], 3)])
    assert finish["long"].type == "abort" and "pool" in finish["long"].message  # 9 pages > 8, not OutOfPages
    assert outputs["short"] == reference_generate(doc + [2], 3)
    assert_idle_pool(s)
