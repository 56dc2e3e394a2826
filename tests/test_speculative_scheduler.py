"""Speculative decoding in the scheduler, over the FakeWorker (whose model reads the real page
contents): outputs identical to plain decoding under drafts from the n-gram index and from a
draft model, page sizes 1 and 16, stops inside accepted drafts, retractions and aborts in
mid-speculation, no page leak, no draft across namespaces, and the cost model turning drafts off."""

from __future__ import annotations

import random

import pytest
from support.fake_worker import reference_generate
from support.scheduling import assert_idle_pool, make, run

from radixrt.messages import TokenizedRequest
from radixrt.namespace import CacheNamespace
from radixrt.sampling_params import SamplingParams
from radixrt.scheduler.step import step

pytestmark = pytest.mark.unit

WEIGHT_BOUND = {"step_seconds": lambda tokens: 0.010 + 0.0001 * tokens}  # a token costs 1% of a step
SOMETIMES_WRONG = {"draft_wrong": lambda seq: sum(seq) % 5 == 0, **WEIGHT_BOUND}


def request(rid: str, prompt: list[int], max_new: int, salt: str | None = None, **sp) -> TokenizedRequest:
    return TokenizedRequest(rid, prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True, temperature=0, **sp),
                            namespace=CacheNamespace(salt=salt))


def prompts(n: int, length: int = 24) -> list[list[int]]:
    return [[(i * 7 + j * 3) % 45 + 1 for j in range(length)] for i in range(n)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_standalone_outputs_equal_plain_decoding_and_drafts_are_mostly_accepted(page_size):
    s, w = make(num_pages=4096 // page_size, page_size=page_size, tiers=SOMETIMES_WRONG,
                speculative_algorithm="STANDALONE", speculative_draft_model_path="unused", speculative_num_steps=4)
    reqs = [request(f"r{i}", p, 40) for i, p in enumerate(prompts(6))]
    outputs, finish = run(s, w, reqs, arrivals={3: 5, 4: 9, 5: 9})
    for r in reqs:
        assert outputs[r.rid] == reference_generate(r.input_ids, 40)
        assert finish[r.rid].type == "length"
    drafted, accepted = sum(d for d, _ in w.verified), sum(a for _, a in w.verified)
    assert drafted > 100 and accepted / drafted > 0.5
    stats = s.stats()
    assert stats.spec_accept_length > 1.5 and stats.spec_draft_tokens == drafted
    assert_idle_pool(s)


def test_ngram_drafts_from_cached_text_of_the_same_namespace_only():
    """A prompt that another request of the namespace already ran to its end: the index drafts its
    continuation. The same text in another namespace changes nothing: acceptance is that of a run
    without it (only the request's own text drafts then)."""
    prompt = [random.Random(2).randrange(1, 49) for _ in range(40)]

    def second_run(first_salt: str | None, with_first: bool) -> list[tuple[int, int]]:
        s, w = make(num_pages=2048, page_size=4, tiers=WEIGHT_BOUND, speculative_algorithm="NGRAM")
        if with_first:
            run(s, w, [request("first", prompt, 48, salt=first_salt)])
        w.verified.clear()
        outputs, _ = run(s, w, [request("second", prompt, 48, salt="b")])
        assert outputs["second"] == reference_generate(prompt, 48)
        assert_idle_pool(s)
        return list(w.verified)

    same = second_run("b", True)
    assert sum(a for _, a in same) >= 40  # nearly its whole output came from the first one's text
    assert second_run("a", True) == second_run(None, False)


def test_a_stop_inside_accepted_drafts_ends_the_output_there():
    prompt = prompts(1, 40)[0]
    expected = reference_generate(prompt, 48)
    stop = expected[20]
    cut = expected.index(stop) + 1
    s, w = make(num_pages=2048, page_size=4, tiers=WEIGHT_BOUND, speculative_algorithm="NGRAM")
    run(s, w, [request("first", prompt, 48)])
    outputs, finish = run(s, w, [request("second", prompt, 48, stop_token_ids=[stop])])
    assert outputs["second"] == expected[:cut]
    assert finish["second"].type == "stop" and finish["second"].matched == stop
    assert any(a > 1 for _, a in w.verified)
    assert_idle_pool(s)


def test_max_new_tokens_bounds_the_drafts():
    prompt = prompts(1, 40)[0]
    s, w = make(num_pages=2048, page_size=4, tiers=WEIGHT_BOUND, speculative_algorithm="NGRAM")
    run(s, w, [request("first", prompt, 48)])
    for n in (1, 2, 5, 17):
        outputs, _ = run(s, w, [request(f"n{n}", prompt, n)])
        assert outputs[f"n{n}"] == reference_generate(prompt, n)
    assert_idle_pool(s)


def test_retractions_in_mid_speculation_lose_nothing():
    """A pool too small for every request's drafts and growth: requests are retracted with
    drafted pages allocated, recomputed, and still decode exactly."""
    rng = random.Random(1)
    s, w = make(num_pages=40, page_size=4, chunked_prefill_size=64, tiers=SOMETIMES_WRONG,
                speculative_algorithm="STANDALONE", speculative_draft_model_path="unused", speculative_num_steps=6)
    reqs = [request(f"r{i}", [rng.randrange(50) for _ in range(rng.randint(30, 70))], 40) for i in range(12)]
    outputs, _ = run(s, w, reqs)
    for r in reqs:
        assert outputs[r.rid] == reference_generate(r.input_ids, 40)
    assert s.stats().retractions > 0 and sum(d for d, _ in w.verified) > 0
    assert_idle_pool(s)


def test_an_abort_in_mid_speculation_frees_every_page():
    s, w = make(num_pages=512, page_size=4, tiers=SOMETIMES_WRONG, speculative_algorithm="STANDALONE",
                speculative_draft_model_path="unused")
    for i, p in enumerate(prompts(3)):
        s.add_request(request(f"r{i}", p, 200))
    while not w.verified:
        step(s, w)
    s.abort("r1")
    while not s.idle:
        step(s, w)
    assert_idle_pool(s)


def test_requests_that_cannot_be_verified_exactly_run_unspeculated_and_are_counted():
    s, w = make(num_pages=1024, page_size=4, tiers=WEIGHT_BOUND, speculative_algorithm="STANDALONE",
                speculative_draft_model_path="unused")
    p = prompts(3)
    reqs = [request("plain", p[0], 20), request("penalized", p[1], 20, frequency_penalty=0.5),
            TokenizedRequest("logprobs", p[2], SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0),
                             return_logprob=True)]
    outputs, _ = run(s, w, reqs)
    assert outputs["plain"] == reference_generate(p[0], 20)
    assert s.stats().spec_unspeculated_requests == {"grammar": 0, "logprobs": 1, "penalties": 1, "retention": 0,
                                                    "spot_check": 0, "draft_kv": 0}
    assert_idle_pool(s)


def test_a_compute_bound_step_turns_drafts_off():
    """Each token costs as much as the rest of the step: no draft pays, at any batch size."""
    s, w = make(num_pages=1024, page_size=4, speculative_algorithm="STANDALONE", speculative_draft_model_path="unused",
                tiers={**SOMETIMES_WRONG, "step_seconds": lambda tokens: 0.001 + 0.01 * tokens})
    reqs = [request(f"r{i}", p, 60) for i, p in enumerate(prompts(8))]
    outputs, _ = run(s, w, reqs)
    assert all(outputs[r.rid] == reference_generate(r.input_ids, 60) for r in reqs)
    stats = s.stats()
    # only the exploring single drafts, every EXPLORE_AFTER steps
    assert stats.spec_drafted_steps <= stats.spec_verify_steps // 10
    assert_idle_pool(s)


def test_stop_strings_end_the_output_where_plain_decoding_ends_it():
    prompt = [random.Random(4).randrange(1, 49) for _ in range(40)]
    text = "".join(chr(97 + t % 26) for t in reference_generate(prompt, 48))
    stop = text[25:28]
    outs = []
    for spec in ({}, {"speculative_algorithm": "NGRAM"}):
        s, w = make(num_pages=2048, page_size=4, tiers=WEIGHT_BOUND, **spec)
        run(s, w, [request("first", prompt, 48)])
        outputs, finish = run(s, w, [request("second", prompt, 48, stop=[stop])])
        assert finish["second"].type == "stop"
        outs.append(outputs["second"])
        assert_idle_pool(s)
    assert outs[0] == outs[1] and len(outs[0]) < 48
    assert any(a > 0 for _, a in w.verified)


def test_pages_from_a_lower_tier_have_no_draft_kv_and_their_readers_run_unspeculated():
    """STANDALONE's draft pool has no tiers: a prefix loaded back from host memory makes its
    readers run unspeculated (counted), while its target KV still serves them."""
    rng = random.Random(8)
    s, w = make(24, 4, {"host_pages": 48, **SOMETIMES_WRONG}, schedule_policy="lpm", enable_hierarchical_cache=True,
                max_running_requests=1, speculative_algorithm="STANDALONE", speculative_draft_model_path="unused")
    doc = [rng.randrange(50) for _ in range(60)]
    run(s, w, [request("doc", doc + [1], 6)])
    run(s, w, [request(f"other{i}", [rng.randrange(50) for _ in range(60)], 6) for i in range(2)])  # doc -> host
    for i, tail in enumerate(([2, 3], [4, 5])):  # loaded back, then read again from the device
        outputs, _ = run(s, w, [request(f"hit{i}", doc + tail, 6)])
        assert outputs[f"hit{i}"] == reference_generate(doc + tail, 6)
    st = s.stats()
    assert st.host_hit_pages > 0 and st.spec_unspeculated_requests["draft_kv"] == 2
    assert st.spec_stale_draft_pages > 0
    assert_idle_pool(s)
