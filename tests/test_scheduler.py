"""The scheduler's bookkeeping, without processes or tensors, against a worker that keeps real page contents."""

from __future__ import annotations

import random

from fake_worker import FakeWorker, reference_generate
from radixrt.config import ServerArgs
from radixrt.messages import TokenizedRequest
from radixrt.sampling_params import SamplingParams
from radixrt.scheduler.scheduler import Scheduler


class CharTokenizer:
    def decode(self, ids, **_):
        return "".join(chr(97 + i % 26) for i in ids)


def make(num_pages: int, page_size: int, **args) -> tuple[Scheduler, FakeWorker]:
    worker = FakeWorker(num_pages, page_size)
    server_args = ServerArgs(model_path="unused", page_size=page_size, **args)
    return Scheduler(server_args, worker.ready, CharTokenizer()), worker


def assert_pages_consistent(s: Scheduler) -> None:
    owned = [p for r in s.running for p in r.pages]
    assert len(owned) == len(set(owned)), "a page is owned twice"
    assert s.allocator.num_free + len(owned) == s.allocator.num_pages


def run(s: Scheduler, w: FakeWorker, requests: list[TokenizedRequest], arrivals: dict[int, int] | None = None):
    """Drive the scheduler to completion; requests arrive at the step given in arrivals (default 0)."""
    arrivals = arrivals or {}
    outputs: dict[str, list[int]] = {r.rid: [] for r in requests}
    finish = {}
    step = 0
    pending = list(enumerate(requests))
    while pending or not s.idle:
        for i, r in [p for p in pending if arrivals.get(p[0], 0) <= step]:
            s.add_request(r)
            pending.remove((i, r))
        batch = s.schedule()
        if batch is not None:
            s.process(w.forward(batch))
        assert_pages_consistent(s)
        for out in s.take_outputs():
            outputs[out.rid] += out.new_ids
            if out.finish is not None:
                finish[out.rid] = out.finish
        step += 1
        assert step < 100_000
    return outputs, finish


def req(rid: str, prompt: list[int], max_new: int, **sp) -> TokenizedRequest:
    return TokenizedRequest(rid, prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True, temperature=0, **sp))


def test_outputs_follow_the_true_sequence_with_chunking_and_late_arrivals():
    rng = random.Random(0)
    for page_size in (1, 4, 16):
        s, w = make(num_pages=4096 // page_size, page_size=page_size, chunked_prefill_size=37)
        reqs = [req(f"r{i}", [rng.randrange(50) for _ in range(rng.randint(1, 120))], rng.randint(1, 30)) for i in range(20)]
        outputs, finish = run(s, w, reqs, arrivals={i: i * 3 for i in range(20)})
        for r in reqs:
            assert outputs[r.rid] == reference_generate(r.input_ids, r.sampling.max_new_tokens)
            assert finish[r.rid].type == "length"
        assert s.allocator.num_free == s.allocator.num_pages


def test_small_pool_retracts_and_still_completes_every_request():
    rng = random.Random(1)
    s, w = make(num_pages=40, page_size=4, chunked_prefill_size=64)  # 160 tokens for 12 requests of ~100
    reqs = [req(f"r{i}", [rng.randrange(50) for _ in range(rng.randint(30, 70))], 40) for i in range(12)]
    outputs, finish = run(s, w, reqs)
    for r in reqs:
        assert outputs[r.rid] == reference_generate(r.input_ids, 40), r.rid
    assert s.retractions > 0
    assert s.allocator.num_free == s.allocator.num_pages


def test_a_sequence_larger_than_the_pool_is_aborted_with_a_reason():
    s, w = make(num_pages=4, page_size=4)  # 16 tokens
    outputs, finish = run(s, w, [req("big", list(range(30)), 4), req("ok", [1, 2, 3], 4)])
    assert finish["big"].type == "abort" and "pool" in finish["big"].message
    assert outputs["ok"] == reference_generate([1, 2, 3], 4)
    s, w = make(num_pages=4, page_size=4)
    outputs, finish = run(s, w, [req("grows", [1] * 10, 20)])  # fits at first, outgrows the pool while decoding
    assert finish["grows"].type == "abort"
    assert s.allocator.num_free == s.allocator.num_pages


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
        s.process(w.forward(s.schedule()))
    s.abort("a")
    s.abort("b")
    outs = {o.rid: o for o in s.take_outputs() if o.finish is not None}
    assert outs["a"].finish.type == "abort" and outs["b"].finish.type == "abort"
    assert s.idle and s.allocator.num_free == 256
