"""The scheduler and worker never die of a request: a request that breaks a step, or a
message that does not decode, fails alone, and the engine keeps serving with no page lost.

These go past the front door's validation on purpose (through the TokenizerManager, or
straight into the scheduler's socket), as a bug there or a foreign client would."""

from __future__ import annotations

import queue
import time

import msgspec
import pytest
import radixrt
import zmq
from support.helpers import assert_no_page_leak
from radixrt.frontend.req_state import ReqState
from radixrt.sampling_params import SamplingParams

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(llama_path):
    with radixrt.Engine(model_path=str(llama_path), page_size=16, max_total_tokens=4096) as e:
        yield e


def submit(engine, ids: list[int], sampling: dict = GREEDY, **kw) -> tuple[ReqState, queue.SimpleQueue]:
    """A request past the door's checks; the queue gets an item at every update."""
    updates: queue.SimpleQueue[None] = queue.SimpleQueue()
    manager = engine._manager
    prepared = manager.intake.unchecked(ids, SamplingParams.from_dict(sampling), **kw)
    return manager.send([prepared], lambda: updates.put(None))[0], updates


def wait(state: ReqState, updates: queue.SimpleQueue, until=lambda s: s.done, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not until(state):
        updates.get(timeout=max(0.0, deadline - time.monotonic()))


def prompts(engine) -> list[list[int]]:
    enc = engine.tokenizer.encode
    return [enc("The old train crossed the river at dawn, and"), enc("Once upon a time"), enc("A list of colours:")]


def test_top_logprobs_past_the_vocabulary_fail_only_that_request(engine):
    vocab = engine._backend.worker.vocab_size
    good, other, bad_ids = prompts(engine)
    alone = [engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] for ids in (good, other)]
    # In one batch: a plain request, one asking for logprobs, and the bad one (topk over vocab + 1 ids).
    plain = submit(engine, good)
    with_lp = submit(engine, other, return_logprob=True, top_logprobs_num=3)
    bad = submit(engine, bad_ids, return_logprob=True, top_logprobs_num=vocab + 1)
    for state, updates in (plain, with_lp, bad):
        wait(state, updates)
    finish = bad[0].finish
    assert finish.type == "abort" and finish.status_code == 500, finish
    assert finish.message.startswith("internal error: logprobs failed"), finish.message
    assert bad[0].output_ids == []
    assert plain[0].output_ids == alone[0] and plain[0].finish.type == "length"
    assert with_lp[0].output_ids == alone[1] and len(with_lp[0].output_top) == len(alone[1])
    assert all(len(top) == 3 for top in with_lp[0].output_top)
    # The engine keeps serving, and the failed request's pages came back.
    assert engine.generate(input_ids=good, sampling_params=GREEDY)["output_ids"] == alone[0]
    assert_no_page_leak(engine)


def test_undecodable_messages_do_not_stop_the_scheduler(engine):
    good = prompts(engine)[0]
    want = engine.generate(input_ids=good, sampling_params=GREEDY)["output_ids"]
    # A long request on the way, to be named by a malformed message.
    held, updates = submit(engine, good, {"temperature": 0, "max_new_tokens": 3000, "ignore_eos": True})
    wait(held, updates, until=lambda s: len(s.output_ids) > 0)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(engine._backend.addrs.scheduler_in)
        enc = msgspec.msgpack.encode
        sock.send(b"\xc1 not msgpack at all")
        sock.send(enc({"type": "TokenizedRequest", "rid": 42, "input_ids": good, "sampling": {}}))
        sock.send(enc({"type": "NoSuchMessage", "rid": "nobody-knows-this-rid"}))
        sock.send(enc({"type": "TokenizedRequest", "rid": held.rid, "input_ids": good, "sampling": {"top_k": "all"}}))
        wait(held, updates)
    finally:
        ctx.destroy(linger=1000)
    assert held.finish.type == "abort" and held.finish.status_code == 400, held.finish
    assert held.finish.message == "malformed request: sampling.top_k: expected `int`, got `str`"
    assert 0 < len(held.output_ids) < 3000
    assert engine.generate(input_ids=good, sampling_params=GREEDY)["output_ids"] == want
    assert_no_page_leak(engine)  # the request held under the malformed message's rid left too


def test_requests_the_model_cannot_run_are_refused_with_400(engine):
    vocab = engine._backend.worker.vocab_size
    state, updates = submit(engine, [1, vocab])
    wait(state, updates)
    assert state.finish.status_code == 400 and "outside the vocabulary" in state.finish.message
    assert_no_page_leak(engine)
