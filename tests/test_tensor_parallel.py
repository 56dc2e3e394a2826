"""Tensor parallelism on CPU (gloo): sharded loading, greedy tokens equal to tp 1 and to
transformers through the Engine and the server, and a dead or hung rank ending the server."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import radixrt
import requests
import torch
from support.helpers import all_gone, corpus_prompts, half_written_copy, hf_greedy
from make_tiny_model import ensure_model
from radixrt.models import ModelConfig, load_model
from radixrt.models.llama import rank_heads
from radixrt.models.parallel import TPGroup
from support.server_proc import child_pids, free_port_run, running_server, spawned_children, stop

GREEDY = {"max_new_tokens": 16, "temperature": 0}


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_loads_exactly_its_slices(model_paths, size):
    """No collectives needed: every rank's parameters are the right pieces of the full model
    (Phi-3's checkpoint fuses q/k/v and gate/up already: each rank reads its rows of those)."""
    from make_family_models import ensure_family_model

    for family, path in {**model_paths, "phi3": ensure_family_model("phi3")}.items():
        cfg = ModelConfig.from_dir(path)
        full = load_model(path, cfg, torch.float32, torch.device("cpu")).state_dict()
        d, inter, vocab = cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
        for rank in range(size):
            tp = TPGroup(rank, size)
            part = load_model(path, cfg, torch.float32, torch.device("cpu"), tp).state_dict()
            q0, qn, kv0, kvn = rank_heads(cfg, tp)
            assert qn == cfg.num_heads // size and kvn == max(1, cfg.num_kv_heads // size)
            q_rows = slice(q0 * d, (q0 + qn) * d)
            k_rows = slice(cfg.num_heads * d + kv0 * d, cfg.num_heads * d + (kv0 + kvn) * d)
            v_rows = slice(k_rows.start + cfg.num_kv_heads * d, k_rows.stop + cfg.num_kv_heads * d)
            for layer in range(cfg.num_layers):
                pre = f"layers.{layer}."
                qkv = full[pre + "self_attn.qkv_proj.weight"]
                want = torch.cat([qkv[q_rows], qkv[k_rows], qkv[v_rows]])
                torch.testing.assert_close(part[pre + "self_attn.qkv_proj.weight"], want, rtol=0, atol=0)
                o = full[pre + "self_attn.o_proj.weight"][:, q0 * d : (q0 + qn) * d]
                torch.testing.assert_close(part[pre + "self_attn.o_proj.weight"], o, rtol=0, atol=0)
                lo, n = rank * inter // size, inter // size
                gu = full[pre + "mlp.gate_up_proj.weight"]
                torch.testing.assert_close(part[pre + "mlp.gate_up_proj.weight"],
                                           torch.cat([gu[lo : lo + n], gu[inter + lo : inter + lo + n]]), rtol=0, atol=0)
                torch.testing.assert_close(part[pre + "mlp.down_proj.weight"], full[pre + "mlp.down_proj.weight"][:, lo : lo + n],
                                           rtol=0, atol=0)
            vlo, vn = rank * vocab // size, vocab // size
            torch.testing.assert_close(part["embed_tokens.weight"], full["embed_tokens.weight"][vlo : vlo + vn], rtol=0, atol=0)
            torch.testing.assert_close(part["lm_head.weight"], full["lm_head.weight"][vlo : vlo + vn], rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tp2_engine_gives_the_tokens_of_tp1_and_transformers(family, model_paths):
    path = model_paths[family]
    prompts = corpus_prompts(path, [6, 33, 90, 210], seed=21)
    args = dict(model_path=str(path), page_size=16, max_total_tokens=8192, chunked_prefill_size=64)
    with radixrt.Engine(tp_size=2, **args) as e:
        got = e.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
        assert e.get_server_info()["tp_size"] == 2 and len(e.pids) == 3
    for ids, res in zip(prompts, got):
        assert res["output_ids"] == hf_greedy(path, ids, GREEDY["max_new_tokens"])
    with radixrt.Engine(**args) as e:
        want = e.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    for g, w in zip(got, want):
        gl = [t[0] for t in g["meta_info"]["input_token_logprobs"][1:]] + [t[0] for t in g["meta_info"]["output_token_logprobs"]]
        wl = [t[0] for t in w["meta_info"]["input_token_logprobs"][1:]] + [t[0] for t in w["meta_info"]["output_token_logprobs"]]
        assert gl == pytest.approx(wl, abs=1e-4)


def test_more_ranks_than_kv_heads_replicates_them(llama_path):
    prompts = corpus_prompts(llama_path, [12, 70], seed=22)
    with radixrt.Engine(model_path=str(llama_path), tp_size=4, max_total_tokens=2048) as e:  # 2 KV heads, 4 ranks
        got = e.generate(input_ids=prompts, sampling_params=GREEDY)
    for ids, res in zip(prompts, got):
        assert res["output_ids"] == hf_greedy(llama_path, ids, GREEDY["max_new_tokens"])


def test_tp2_server_matches_updates_both_ranks_and_a_killed_rank_ends_it(llama_path, tmp_path):
    prompts = corpus_prompts(llama_path, [15, 120], seed=23)
    with running_server(llama_path, "--tp-size", "2", "--page-size", "16", "--max-total-tokens", "4096") as (url, proc):
        got = requests.post(url + "/generate", json={"input_ids": prompts, "sampling_params": GREEDY}, timeout=60).json()
        assert [r["output_ids"] for r in got] == [hf_greedy(llama_path, p, GREEDY["max_new_tokens"]) for p in prompts]
        # a weight update reaches both ranks: each holds half the heads, so one stale rank changes the tokens
        retrained = ensure_model("llama", seed=99)
        r = requests.post(url + "/update_weights_from_disk", json={"model_path": str(retrained)}, timeout=60)
        assert r.status_code == 200 and r.json()["success"], r.text
        got = requests.post(url + "/generate", json={"input_ids": prompts, "sampling_params": GREEDY}, timeout=60).json()
        assert [r["meta_info"]["cached_tokens"] for r in got] == [0, 0]
        want = [hf_greedy(retrained, p, GREEDY["max_new_tokens"]) for p in prompts]
        assert [r["output_ids"] for r in got] == want
        # a checkpoint whose loading fails midway: every rank goes back to the weights it had
        broken = half_written_copy(llama_path, tmp_path / "broken")
        r = requests.post(url + "/update_weights_from_disk", json={"model_path": str(broken)}, timeout=60)
        assert r.status_code == 400 and "keep serving" in r.json()["message"], r.text
        got = requests.post(url + "/generate", json={"input_ids": prompts, "sampling_params": GREEDY}, timeout=60).json()
        assert [r["output_ids"] for r in got] == want
        children = child_pids(proc.pid)
        rank0, rank1, scheduler = spawned_children(proc.pid)
        os.kill(rank1, signal.SIGKILL)
        start = time.monotonic()
        assert proc.wait(15) != 0 and time.monotonic() - start < 15
        assert all_gone(children)


def test_a_hung_rank_trips_the_watchdog(llama_path):
    args = ("--tp-size", "2", "--max-total-tokens", "2048", "--watchdog-timeout", "3")
    with running_server(llama_path, *args) as (url, proc):
        children = child_pids(proc.pid)
        rank1 = spawned_children(proc.pid)[1]
        os.kill(rank1, signal.SIGSTOP)  # rank 1 stops answering, without dying
        try:
            requests.post(url + "/generate", json={"text": "hello", "sampling_params": GREEDY}, timeout=30)
        except requests.RequestException:
            pass
        assert proc.wait(30) != 0
        log = proc.stdout.read()
        assert "no answer from the workers" in log
        assert all_gone(children)


@contextlib.contextmanager
def second_node(path, *common: str):
    """Node 1 of a two-node server on this machine: `launch_server --node-rank 1`."""
    cmd = [sys.executable, "-m", "radixrt.launch_server", "--model-path", str(path), *common,
           "--node-rank", "1", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield proc
    finally:
        stop(proc)


def two_node_args() -> tuple[str, ...]:
    dist = f"127.0.0.1:{free_port_run(4)}"  # node 0 binds the two ranks' channels on the ports above it
    return ("--tp-size", "2", "--nnodes", "2", "--dist-init-addr", dist, "--page-size", "16", "--max-total-tokens", "4096")


def test_two_nodes_on_loopback_give_the_tokens_of_one(llama_path):
    """Rank 1 in another `launch_server --node-rank 1`, meeting node 0 over tcp only; node 0's
    graceful stop ends node 1 cleanly."""
    prompts = corpus_prompts(llama_path, [15, 120], seed=24)
    common = two_node_args()
    with second_node(llama_path, *common) as node1:
        with running_server(llama_path, *common) as (url, proc):
            got = requests.post(url + "/generate", json={"input_ids": prompts, "sampling_params": GREEDY}, timeout=60).json()
            info = requests.get(url + "/get_server_info", timeout=10).json()
            workers = spawned_children(node1.pid)
        assert node1.wait(30) == 0, node1.stdout.read()
        assert all_gone(workers)
    assert info["nnodes"] == 2 and info["tp_size"] == 2 and len(workers) == 1
    assert [r["output_ids"] for r in got] == [hf_greedy(llama_path, p, GREEDY["max_new_tokens"]) for p in prompts]


def test_a_killed_node0_ends_node1(llama_path):
    common = two_node_args()
    with second_node(llama_path, *common) as node1:
        with running_server(llama_path, *common) as (url, proc):
            workers = spawned_children(node1.pid)
            os.kill(proc.pid, signal.SIGKILL)  # its children die with it; node 1's rank loses its link
            assert node1.wait(30) == 1
            assert "lost the scheduler" in node1.stdout.read()
            assert all_gone(workers)


def test_node_rank_above_zero_is_not_an_engine(llama_path):
    with pytest.raises(ValueError, match="launch_server"):
        radixrt.Engine(model_path=str(llama_path), tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:29500")
