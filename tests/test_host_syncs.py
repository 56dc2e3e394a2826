"""The FlashInfer path of a step reads nothing back from the device before its sampled ids.

A device-to-host copy (`.item()`, `.tolist()`, `.cpu()`, a boolean-mask select, FlashInfer's
plan() copying a device indptr to the CPU) stalls the host until the GPU has drained its
queue, so every one of them before the forward sits in the step's latency; at batch 1 that
is most of it. This runs whole ModelRunner steps (prefill, then decodes, eager and through
the decode-graph runner) on the tiny llama with:
  * the `meta` device standing in for the GPU: tensors with shapes and no data, so anything
    that reads one back is by construction a device-to-host copy;
  * a recording fake of FlashInfer's wrappers whose plan() reads its CSR arrays on the host
    as FlashInfer 0.6.13's does (`indptr.to("cpu")` ...), so a device indptr shows up there;
  * a torch function mode that records every read of a meta tensor and where it came from;
  * a fake sampler that marks where the sampled ids are read (the one copy a step needs).
No GPU is needed; the real kernels are tested in tests/test_cuda.py.
"""

from __future__ import annotations

import math
import random
import types

import pytest
import torch

from radixrt.kernels import AttentionMetadata
from radixrt.kernels import flashinfer_backend as fb

from support.meta_device import DEVICE, DeviceReads, MarkingSampler, PAGE, SAMPLED, make_meta_runner


@pytest.fixture
def meta_runner(llama_path, monkeypatch):
    runner = make_meta_runner(llama_path, monkeypatch, dtype="bfloat16")  # the tiny llama's float32 is CPU-only here
    assert isinstance(runner.attn, fb.FlashInferBackend) and runner.graphs is None  # graphs: CUDA only
    return runner


def eager_graphs(runner, monkeypatch):
    """The decode-graph runner with each 'graph' replayed eagerly from the same buffers."""
    from radixrt.worker.cuda_graph import DecodeGraphRunner

    def capture(self) -> None:  # as DecodeGraphRunner._capture, less CUDA: load each size, run it once
        no_rows = torch.zeros(0, dtype=torch.int64, device=DEVICE)
        padding = AttentionMetadata([], [], torch.zeros(0, 1, dtype=torch.int64, device=DEVICE), no_rows, PAGE)
        for bs in self.sizes:
            self._load(bs, padding, no_rows, no_rows)
            self.outputs[bs] = self._forward(bs)
            self.graphs[bs] = types.SimpleNamespace(replay=lambda bs=bs, g=self: g.outputs[bs].copy_(g._forward(bs)))

    monkeypatch.setattr(DecodeGraphRunner, "_capture", capture)
    graphs = DecodeGraphRunner(runner.model, runner.attn, [1, 2, 4, 8], max_pages_per_req=runner.slots.page_table.shape[1])
    for wrappers in graphs.wrappers.values():
        for w in wrappers:
            w.plans.clear()  # the captures' own plans
    return graphs


def steps(n_decodes: int):
    """A prefill of three requests, then n_decodes decode steps (pages added as they fill)."""
    from radixrt.messages import BatchEntry, ForwardBatch, SlotInit
    from radixrt.sampling_params import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(100) for _ in range(n)] for n in (5, 9, 2)]
    free, lens = list(range(100)), [0, 0, 0]
    entries = []
    for slot, ids in enumerate(prompts):
        pages = [free.pop() for _ in range(math.ceil(len(ids) / PAGE))]
        entries.append(BatchEntry(slot=slot, input_ids=ids, start_pos=0, new_pages=pages, sample=True, init=SlotInit(SamplingParams(temperature=0), [], [])))
        lens[slot] = len(ids)
    yield ForwardBatch(0, entries)
    for step in range(1, n_decodes + 1):
        entries = []
        for slot in range(3):
            pages = [free.pop()] if lens[slot] % PAGE == 0 else []  # the new token starts a page
            entries.append(BatchEntry(slot=slot, input_ids=[rng.randrange(100)], start_pos=lens[slot], new_pages=pages,
                                      sample=True))
            lens[slot] += 1
        yield ForwardBatch(step, entries)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode-graphs"])
def test_no_device_to_host_copy_before_the_sampled_ids(meta_runner, graphs, monkeypatch):
    runner = meta_runner
    if graphs:
        runner.graphs = eager_graphs(runner, monkeypatch)
    seen = []
    for batch in steps(n_decodes=5):
        reads = MarkingSampler.reads = DeviceReads()
        with reads:
            try:
                runner.forward(batch)
            except Exception as e:  # a stand-in value may not fit what follows a read: say which reads came first
                raise AssertionError(f"step {batch.step} failed after these device reads: {reads.events}") from e
        assert SAMPLED in reads.events, "the step never reached its sampler"
        assert reads.before_sample() == [], f"step {batch.step}: device-to-host copies before the sampled ids"
        seen.append(batch.step)
    assert seen == list(range(6))
    # what the wrappers were planned with: the CSR lengths on the host, the page ids on the device
    wrappers = [w for per_size in runner.graphs.wrappers.values() for w in per_size] if graphs else runner.attn._decode
    decodes = [p for w in wrappers for p in w.plans]
    assert len(decodes) == 5 and len(runner.attn._prefill[0].plans) == 1
    for csr in decodes + runner.attn._prefill[0].plans:
        assert all(csr[k].device.type == "cpu" for k in csr if k != "indices") and csr["indices"].device == DEVICE
    last = decodes[-1]  # decode step 5 of prompts 5, 9, 2: 10, 14 and 7 tokens (graphs: a 4th row, padding)
    assert last["indptr"].tolist()[:4] == [0, 3, 7, 9] and last["last_page_len"].tolist()[:3] == [2, 2, 3]


def test_the_recorder_sees_the_copies_it_is_there_for(meta_runner, monkeypatch):
    """The old way, a boolean-mask select for kv_indices and a device indptr for plan(), is caught."""

    def masked_paged_kv(meta: AttentionMetadata) -> fb.PagedKV:
        dev, ps = meta.page_table.device, meta.page_size
        kv_lens = torch.tensor(meta.kv_lens, dtype=torch.int32, device=dev)
        n_pages = (kv_lens + ps - 1) // ps
        indptr = torch.nn.functional.pad(torch.cumsum(n_pages, 0, dtype=torch.int32), (1, 0))
        cols = torch.arange(meta.page_table.shape[1], device=dev)
        indices = meta.page_table[cols[None, :] < n_pages[:, None]].to(torch.int32)
        return fb.PagedKV(indptr, indices, (kv_lens - (n_pages - 1) * ps).to(torch.int32))

    monkeypatch.setattr(fb, "paged_kv", masked_paged_kv)
    batches = steps(n_decodes=1)
    reads = MarkingSampler.reads = DeviceReads()
    with reads:
        meta_runner.forward(next(batches))
    events = reads.before_sample()
    assert sum(e.startswith("__getitem__") and "page_table[cols" in e for e in events) == 1, events  # the mask select
    assert sum(e.startswith("to at") and 'csr[name].to("cpu")' in e for e in events) == 2, events  # plan: indptr, last_page_len


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_kv_lists_each_requests_pages_in_order(page_size):
    """paged_kv's CSR equals the boolean-mask reference on a scattered page table (values, on the CPU)."""
    rng = random.Random(page_size)
    kv_lens = [rng.randint(1, 70) for _ in range(9)]
    max_pages = max(math.ceil(n / page_size) for n in kv_lens) + 2
    table = torch.tensor([rng.sample(range(1000), max_pages) for _ in kv_lens])  # [B, max_pages]
    meta = AttentionMetadata([1] * len(kv_lens), kv_lens, table, torch.zeros(len(kv_lens), dtype=torch.int64), page_size)
    kv = fb.paged_kv(meta)
    n_pages = torch.tensor([math.ceil(n / page_size) for n in kv_lens])
    want = table[torch.arange(max_pages)[None, :] < n_pages[:, None]]
    assert kv.indices.dtype == kv.indptr.dtype == kv.last_page_len.dtype == torch.int32
    assert kv.indices.tolist() == want.tolist()
    assert kv.indptr.tolist() == [0, *torch.cumsum(n_pages, 0).tolist()]
    assert kv.last_page_len.tolist() == [n - (p - 1) * page_size for n, p in zip(kv_lens, n_pages.tolist())]
    assert all(1 <= x <= page_size for x in kv.last_page_len.tolist())
