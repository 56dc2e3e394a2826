"""Engine start, failure and stop: no orphans, clear errors, and a tiny pool that still completes everything."""

from __future__ import annotations

import os
import signal
import time

import pytest
import radixrt
from support.helpers import all_gone, assert_no_page_leak, corpus_prompts, hf_greedy, process_alive
from radixrt.frontend.tokenizer_manager import BackendDied


def test_unknown_server_argument_is_an_error(llama_path):
    with pytest.raises(ValueError, match="no_such_arg"):
        radixrt.Engine(model_path=str(llama_path), no_such_arg=1)
    with pytest.raises(ValueError, match="page_size"):
        radixrt.Engine(model_path=str(llama_path), page_size=0)


def test_bad_model_path_fails_at_start_with_the_reason(tmp_path):
    # checked before any process starts
    with pytest.raises(ValueError, match="model_path 'Qwen/Qwen2.5-0.5B-Instruct' is not a local directory"):
        radixrt.Engine(model_path="Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(ValueError, match="model_path .* has no config.json"):
        radixrt.Engine(model_path=str(tmp_path))
    # found by the worker, which says why
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(RuntimeError, match="worker 0 failed to start: ValueError: .*'gpt2'"):
        radixrt.Engine(model_path=str(tmp_path))


def test_shutdown_leaves_no_child_process(llama_path):
    engine = radixrt.Engine(model_path=str(llama_path), max_total_tokens=2048)
    pids = engine.pids
    assert len(pids) == 2 and all(process_alive(p) for p in pids)
    engine.generate("hello", {"max_new_tokens": 2})
    engine.shutdown()
    assert all_gone(pids)
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate("hello")


def test_a_killed_worker_fails_pending_requests_and_the_engine_says_so(llama_path):
    engine = radixrt.Engine(model_path=str(llama_path), max_total_tokens=2048)
    pids = engine.pids
    try:
        stream = engine.generate("hello", {"max_new_tokens": 100000 // 100, "ignore_eos": True}, stream=True)
        next(stream)
        os.kill(pids[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(BackendDied, match="exited"):
            for _ in stream:
                pass
        assert time.monotonic() - start < 15
        with pytest.raises(BackendDied):
            engine.generate("again")
    finally:
        engine.shutdown()
    assert all_gone(pids)


def test_a_pool_a_third_of_the_need_retracts_and_matches_transformers(llama_path):
    prompts = corpus_prompts(llama_path, [120, 160, 200, 140, 180, 100, 150, 170], seed=7)
    max_new = 40
    need = sum(len(p) + max_new for p in prompts)
    with radixrt.Engine(model_path=str(llama_path), page_size=4, max_total_tokens=need // 3, chunked_prefill_size=256) as e:
        res = e.generate(input_ids=prompts, sampling_params={"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True})
        info = e.get_server_info()
        assert info["retractions"] > 0
        # which compiled attention variant serves each shape class, and why (kernels/kernel_choice.py)
        assert set(info["attention_kernels"]) == {"decode", "extend", "cascade"}, info["attention_kernels_reason"]
        assert info["attention_kernels_reason"]
        assert_no_page_leak(e)
    for ids, r in zip(prompts, res):
        assert r["output_ids"] == hf_greedy(llama_path, ids, max_new)[: len(r["output_ids"])]
        assert len(r["output_ids"]) == max_new
