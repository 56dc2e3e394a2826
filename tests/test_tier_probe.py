"""What the worker measures for the load-or-recompute choice: each kind of tier move's pages and
seconds (KVTierStore), the start-up probe of host->device and disk->device copies, the model's
attention share of a token's FLOPs, and, through a ModelRunner on the tiny llama in this process,
the scheduler's estimates fed from all of it."""

from __future__ import annotations

import random

import pytest
import torch
from radixrt.kernels import PagedKVCache

from radixrt.messages import KVMove, MoveKind
from radixrt.models.config import ModelConfig, MoEConfig
from radixrt.worker.disk_tier import PageFiles
from radixrt.worker.kv_tiers import KVTierStore
from radixrt.worker.tier_probe import attention_per_position, probe_transfers


def int8_store(tmp_path, disk: bool = True, files: PageFiles | None = None) -> KVTierStore:
    """A KVTierStore over an int8 pool (values and scales) of 6 pages, every page different."""
    cache = PagedKVCache(2, 6, 2, 1, 4, torch.float32, torch.device("cpu"), "int8")
    for b in cache.buffers:
        b.copy_(torch.arange(b.numel()).reshape(b.shape) % 100)
    return KVTierStore(cache, host_pages=6, disk_dir=tmp_path if disk else None, disk_pages=8, rank=0, files=files)


def snapshot(store: KVTierStore) -> list[torch.Tensor]:
    return [b.clone() for b in store.cache.buffers]


def test_the_worker_store_reports_pages_and_seconds_per_kind_of_move(tmp_path):
    store = int8_store(tmp_path)
    store.run([
        KVMove(MoveKind.D2H, [0, 1], [0, 1]),
        KVMove(MoveKind.H2DISK, [1], keys=["a"]),
        KVMove(MoveKind.D2DISK, [1, 2], keys=["b", "c"]),
        KVMove(MoveKind.DISK2D, [], [3, 4], ["a", "b"]),
        KVMove(MoveKind.H2D, [0], [5]),
        KVMove(MoveKind.DROP, keys=["a"]),
    ])
    store.run([KVMove(MoveKind.H2D, [0, 1], [4, 5])])  # a kind's moves add up until taken
    times = {t.kind: t for t in store.take_times()}
    assert {k: t.pages for k, t in times.items()} == {MoveKind.D2H: 2, MoveKind.H2DISK: 1, MoveKind.D2DISK: 2,
                                                      MoveKind.DISK2D: 2, MoveKind.H2D: 3, MoveKind.DROP: 1}
    assert all(t.seconds > 0 for t in times.values())
    assert store.take_times() == []


def test_the_start_probe_times_both_tiers_and_leaves_the_pool_as_it_was(tmp_path):
    store = int8_store(tmp_path)
    before = snapshot(store)
    probe = probe_transfers(store)
    assert probe.h2d_s_per_page > 0 and probe.disk2d_s_per_page > 0
    assert all(torch.equal(a, b) for a, b in zip(before, store.cache.buffers))
    assert list(tmp_path.iterdir()) == []  # its page files are gone
    assert store.take_times() == [] and store.disk.outcomes() == []  # no tier move, no disk operation to settle
    assert probe_transfers(int8_store(tmp_path / "none", disk=False)).disk2d_s_per_page == 0.0


def test_a_disk_that_fails_the_probe_is_not_measured(tmp_path, caplog):
    class Unreadable(PageFiles):
        def read(self, path):
            raise OSError(5, "Input/output error")

    store = int8_store(tmp_path, files=Unreadable())
    before = snapshot(store)
    probe = probe_transfers(store)
    assert probe.disk2d_s_per_page == 0.0 and probe.h2d_s_per_page > 0
    assert "cannot time the disk KV tier" in caplog.text and "Input/output error" in caplog.text
    assert list(tmp_path.iterdir()) == [] and store.disk.enabled  # a probe is not a page: the tier stays on
    assert all(torch.equal(a, b) for a, b in zip(before, store.cache.buffers))


def test_attention_per_position_is_the_attention_flops_over_the_linear_ones():
    base = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
            "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
            "rope_theta": 1e4}
    dense = ModelConfig(**base)
    linear_per_layer = 64 * (2 * 64 + 2 * 32) + 3 * 64 * 128  # q, o; k, v; the gated MLP
    assert attention_per_position(dense) == pytest.approx(4 * 2 * 64 / (2 * 2 * linear_per_layer))
    moe = ModelConfig(**base, moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=32, renormalize=True,
                                            layers=frozenset({1})))
    sparse_layer = 64 * (2 * 64 + 2 * 32) + 3 * 64 * 32 * 2  # the top-2 experts run
    assert attention_per_position(moe) == pytest.approx(4 * 2 * 64 / (2 * (linear_per_layer + sparse_layer)))


def test_a_model_runner_seeds_and_feeds_the_schedulers_estimates(llama_path, tmp_path):
    """The tiny llama in this process, with host and disk tiers: the probe's figures reach the
    scheduler through WorkerReady, and the steps' and moves' times move them."""
    from radixrt.config import ServerArgs
    from radixrt.config_views import SchedulerConfig
    from radixrt.messages import TokenizedRequest
    from radixrt.sampling_params import SamplingParams
    from radixrt.scheduler.scheduler import Scheduler
    from radixrt.scheduler.step import drive
    from radixrt.worker.model_runner import ModelRunner

    args = ServerArgs(model_path=str(llama_path), device="cpu", attention_backend="torch", page_size=4,
                      chunked_prefill_size=32, max_total_tokens=64, enable_hierarchical_cache=True, hicache_size=0.01,
                      hicache_dir=str(tmp_path), hicache_disk_size=0.01)
    runner = ModelRunner(args)
    ready = runner.ready_message()
    assert ready.h2d_s_per_page > 0 and ready.disk2d_s_per_page > 0
    assert ready.attention_per_position == attention_per_position(runner.cfg) > 0
    sched = Scheduler(SchedulerConfig.of(args), ready, tokenizer=None)
    st = sched.stats()
    assert (st.cost_h2d_s_per_page, st.cost_disk_s_per_page) == (ready.h2d_s_per_page, ready.disk2d_s_per_page)
    rng = random.Random(0)
    docs = [[rng.randrange(1, 500) for _ in range(40)] for _ in range(2)]  # both do not fit the 64-token pool
    greedy = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
    for i, doc in enumerate([0, 1, 0]):  # the third finds the first's pages in host memory
        sched.add_request(TokenizedRequest(f"r{i}", docs[doc] + [i + 1], greedy))
        drive(sched, runner)
    st = sched.stats()
    assert st.pages_d2h > 0 and st.pages_h2d > 0
    assert st.cost_prefill_steps >= 3 and st.cost_prefill_s_per_token > 0
    assert st.cost_h2d_s_per_page != ready.h2d_s_per_page  # the loads' own time moved the seed
    assert st.tier_move_seconds > 0
    assert not list(tmp_path.rglob(".probe-*"))  # the probe's files are gone from the tier's directory
