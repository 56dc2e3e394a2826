"""DecodeGraphRunner: decode steps replayed from CUDA graphs, one graph per captured batch size.

Owns, for each captured batch size bs, a CUDA graph of the model forward from
token ids to final hidden states (every layer's projections, RoPE, KV write,
FlashInfer decode attention, MLP, and the NCCL all-reduces under tensor
parallelism), and the FlashInfer decode wrappers its attention kernels were
captured with (`use_cuda_graph=True`, batch size fixed; one per attention kind
of the backend, e.g. Gemma's sliding and full layers, each layer's kernels
captured from its kind's wrapper). It also owns the
fixed-address tensors those graphs read, allocated once at the largest size:
input_ids, positions, out_slots, and FlashInfer's int32 page table
(kv_indptr, kv_indices, last_page_len). A size-bs graph reads their first rows.

A step runs from a graph when it is pure decode (one new token per request)
with at most `max_bs` requests. Prefill, mixed batches and larger decodes run
eagerly, as does everything on the torch backend.

Per replay: pad the batch to the next captured size, copy the step's inputs
into the buffers, plan the size's wrappers for this step's page table (host
work, outside the graph: it rewrites the wrappers' buffers in place, from
lengths the host already holds, so nothing is read back from the device before
the replay; tests/test_host_syncs.py checks it), replay, and return the first n
rows of the graph's output.

Logits are computed outside the graph, by the caller: which rows need them
(sampled rows, prompt-logprob rows) changes per step, the LM head over padding
rows would be wasted work at vocabulary width, and a [max_bs, vocab] float32
output would be the largest tensor in the graph pool. The norm and LM head are
a handful of kernels; a layer is about fifteen.
"""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.kernels import AttentionMetadata
from radixrt.kernels.flashinfer_backend import FlashInferBackend

WARMUP_RUNS = 2  # eager runs on the capture stream first: lazy inits (cuBLAS workspace, FlashInfer buffers) stay out of the graph


def capture_sizes(max_bs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, every 8 up to 128, every 16 beyond, and max_bs itself,
    so every decode batch up to max_bs has a graph, padded by at most 7 rows (15 above 128)."""
    ladder = [1, 2, 4, 8, *range(16, 129, 8), *range(144, max_bs + 1, 16)]
    return sorted({bs for bs in ladder if bs < max_bs} | {max_bs})


class DecodeGraphRunner:
    """Captures at construction (CUDA only). Not thread-safe; one per worker, beside its backend."""

    def __init__(self, model: nn.Module, attn: FlashInferBackend, sizes: list[int], max_pages_per_req: int) -> None:
        self.model, self.attn, self.cache = model, attn, attn.cache
        self.sizes = sorted(sizes)
        self.max_bs = max_bs = self.sizes[-1]
        dev = self.cache.k[0].device
        # Padding rows run token 0 at position 0 and write their K/V to the cache's pad slot.
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)  # [max_bs]
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)  # [max_bs]
        self.out_slots = torch.full((max_bs,), self.cache.pad_slot, dtype=torch.int64, device=dev)  # [max_bs]
        # FlashInfer's CSR page table, shared by every size's wrappers (one step plans one size's) and
        # by the kinds of a size (each plans the same page table into it; a window only narrows the read).
        # kv_indices: [max_bs * max_pages_per_req], room for every page a step of max_bs requests lists.
        self.kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)  # [max_bs + 1]
        self.kv_indices = torch.zeros(max_bs * max_pages_per_req, dtype=torch.int32, device=dev)
        self.last_page_len = torch.ones(max_bs, dtype=torch.int32, device=dev)  # [max_bs]
        self.wrappers = {  # bs -> one decode wrapper per attention kind (attn.kinds)
            bs: attn.graph_decode_wrappers(self.kv_indptr[: bs + 1], self.kv_indices, self.last_page_len[:bs])
            for bs in self.sizes
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bs -> [bs, hidden], rewritten by each replay of bs
        self._capture()

    def can_run(self, meta: AttentionMetadata) -> bool:
        return meta.num_reqs <= self.max_bs and all(n == 1 for n in meta.qo_lens)

    def replay(self, meta: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step (`can_run(meta)`): input_ids, positions [n] -> hidden states [n, hidden].

        NOTE: the result is a view of the graph's output; the next replay of this size overwrites it.
        """
        bs = self.sizes[bisect.bisect_left(self.sizes, meta.num_reqs)]
        self._load(bs, meta, input_ids, positions)
        self.graphs[bs].replay()
        return self.outputs[bs][: meta.num_reqs]

    @torch.inference_mode()
    def _capture(self) -> None:
        dev = self.input_ids.device
        no_rows = torch.zeros(0, dtype=torch.int64, device=dev)
        all_padding = AttentionMetadata([], [], torch.zeros(0, 1, dtype=torch.int64, device=dev), no_rows, self.cache.page_size)
        pool = torch.cuda.graph_pool_handle()  # one pool for all sizes; only one graph runs at a time
        stream = torch.cuda.Stream(dev)
        # Largest first: each smaller graph then reuses memory the pool already holds.
        for bs in reversed(self.sizes):
            self._load(bs, all_padding, no_rows, no_rows)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_RUNS):
                    self._forward(bs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[bs] = self._forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize(dev)

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], self.attn)  # [bs, hidden]

    def _load(self, bs: int, meta: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Put a step of n <= bs decodes into the buffers as a batch of bs and plan bs's wrappers for it.

        Padding rows n..bs write their K/V to the pad slot and attend over that one slot (a
        1-token sequence on the pad page), so they never read or write a real page.
        NOTE: the pad page then holds padding rows' (finite) K/V rather than zeros. Only
        FlashInfer runs with graphs, and it reads the pad page for padding rows alone.
        """
        n = meta.num_reqs
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.out_slots[:n].copy_(meta.out_slots)
        # NOTE: reset on every step: rows n..bs may still hold an earlier, larger batch's real slots.
        self.input_ids[n:bs].zero_()
        self.positions[n:bs].zero_()
        self.out_slots[n:bs].fill_(self.cache.pad_slot)
        padded = AttentionMetadata(
            qo_lens=[1] * bs,
            kv_lens=meta.kv_lens + [1] * (bs - n),
            page_table=F.pad(meta.page_table, (0, 0, 0, bs - n), value=self.cache.num_pages),  # [bs, max_pages]
            out_slots=self.out_slots[:bs],  # the captured address: every layer's KV write reads it
            page_size=meta.page_size,
        )
        self.attn.init_forward_with(padded, self.wrappers[bs])
