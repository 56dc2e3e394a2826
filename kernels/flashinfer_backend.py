"""FlashInferBackend: FlashInfer's paged attention kernels on CUDA, over our pool in place.

Targets flashinfer-python 0.6.13 (the version that fits the GPU machine's
carry; its wrapper signatures were checked with inspect), all arguments
after page_size passed by keyword as 0.7.x requires.

Per step, `init_forward` turns the batch's page tables into FlashInfer's CSR
form (int32 kv_indptr / kv_indices / kv_last_page_len; every index array must
be int32) and plans once: the decode wrapper when every request has one new
token, the paged prefill wrapper otherwise (prefill chunks mixed with
decodes). Every layer then writes its new K/V into the pool first and runs
the planned kernel over the pool's own tensors, layout NHD =
[num_pages, page_size, kv_heads, head_dim]. FlashInfer's `causal=True` is
aligned bottom-right, which is exactly a chunk over a cached prefix.

Per-layer options (LayerAttention) are plan() arguments: `sm_scale`,
`window_left` (= window - 1: FlashInfer counts the keys left of the query's
own, HF counts the query's too) and `logits_soft_cap` (FlashInfer caps
scale * q.k, the Gemma 2 order). FlashInfer compiles a kernel per
window/soft-cap variant and a wrapper holds one plan, so there is one wrapper
(prefill and decode) per distinct LayerAttention, a "kind" (usually one; two
for Gemma's sliding and full layers, as SGLang does), all planned each step
from the same page table (the window narrows what is read, not the pages
listed), all sharing one float workspace (layers run one after another on one
stream); each layer runs its kind's wrapper.

For CUDA graphs (radixrt/worker/cuda_graph.py), `graph_decode_wrappers` makes
one decode wrapper per kind over the graph's fixed buffers and
`init_forward_with` plans them before each replay; the eager path is
`init_forward`, which plans our own wrappers.

TorchBackend is the reference this is held to (tests/test_torch_backend.py
runs the same cases against both on a GPU).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from radixrt.kernels.backend import AttentionBackend, AttentionMetadata, LayerAttention, layer_kinds
from radixrt.kernels.kv_cache import PagedKVCache

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partials)
TENSOR_CORE_GQA_GROUP = 4  # decode through the MMA kernel once the GQA group is this large (as SGLang)


def plan_options(la: LayerAttention) -> dict[str, Any]:
    """A kind's plan() keywords: its scale, window (FlashInfer's window_left = window - 1; -1: none) and cap (0: none)."""
    return dict(
        sm_scale=la.scale,
        window_left=-1 if la.window is None else la.window - 1,
        logits_soft_cap=0.0 if la.softcap is None else la.softcap,
    )


class FlashInferBackend(AttentionBackend):
    def __init__(self, cache: PagedKVCache, num_heads: int, head_dim: int, layers: Sequence[LayerAttention]) -> None:
        super().__init__(cache, num_heads, head_dim, layers)
        if cache.storage_dtype == torch.int8:  # FlashInfer's paged kernels read fp8 or the model's dtype
            raise ValueError(
                "kv_cache_dtype 'int8' is not supported by attention_backend 'flashinfer'; "
                "use attention_backend 'torch', or kv_cache_dtype fp8_e4m3 / fp8_e5m2"
            )
        device = cache.k[0].device
        if device.type != "cuda":
            raise ValueError("attention_backend 'flashinfer' needs a CUDA device; use 'torch' on CPU")
        import flashinfer  # optional: the `cuda` extra

        self.kv_heads = cache.k[0].shape[2]
        self.kinds, self._kind_of = layer_kinds(self.layers)  # distinct LayerAttentions; each layer's index into them
        self.use_tensor_cores = num_heads // self.kv_heads >= TENSOR_CORE_GQA_GROUP
        # The decode docstring asks for a zeroed workspace on first use.
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # one wrapper per kind (a wrapper holds one plan: one scale, window and cap)
        self._prefill = [flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD") for _ in self.kinds]
        self._decode = [
            flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=self.use_tensor_cores)
            for _ in self.kinds
        ]
        self._layer_wrappers: list[Any] = [self._decode[i] for i in self._kind_of]

    def init_forward(self, meta: AttentionMetadata) -> None:
        decode = all(n == 1 for n in meta.qo_lens)
        self.init_forward_with(meta, self._decode if decode else self._prefill)

    def init_forward_with(self, meta: AttentionMetadata, wrappers: Sequence[Any]) -> None:
        """init_forward through chosen wrappers, one per kind (`self.kinds`, in order): our prefill
        or decode ones, or a graph's from `graph_decode_wrappers` (planned here, outside its
        graph, before every replay).

        NOTE: plan() is host work (it reads indptr back to the CPU and schedules the
        split-KV partition), so it must never run inside a CUDA graph capture.
        """
        if len(wrappers) != len(self.kinds):
            raise ValueError(f"{len(wrappers)} wrappers for {len(self.kinds)} attention kinds: give one per kind")
        self.meta = meta
        dev, ps = meta.out_slots.device, meta.page_size
        kv_lens = torch.tensor(meta.kv_lens, dtype=torch.int32, device=dev)  # [B]
        n_pages = (kv_lens + ps - 1) // ps  # [B]
        kv_indptr = F.pad(torch.cumsum(n_pages, 0, dtype=torch.int32), (1, 0))  # [B + 1]
        cols = torch.arange(meta.page_table.shape[1], device=dev)
        kv_indices = meta.page_table[cols[None, :] < n_pages[:, None]].to(torch.int32)  # row-major: request by request
        last_page_len = (kv_lens - (n_pages - 1) * ps).to(torch.int32)  # [B], in [1, page_size]
        # q stays in the model's dtype; an fp8 pool is read as fp8 (k_scale / v_scale passed to run)
        dtypes = dict(q_data_type=self.cache.dtype, kv_data_type=self.cache.storage_dtype)
        if wrappers is not self._prefill:  # decode wrappers, ours or a graph's
            for kind, w in zip(self.kinds, wrappers):
                w.plan(kv_indptr, kv_indices, last_page_len, self.num_heads, self.kv_heads, self.head_dim, ps,
                       **dtypes, **plan_options(kind))
        else:
            qo = torch.tensor(meta.qo_lens, dtype=torch.int32, device=dev)
            qo_indptr = F.pad(torch.cumsum(qo, 0, dtype=torch.int32), (1, 0))  # [B + 1]
            for kind, w in zip(self.kinds, wrappers):
                w.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, self.num_heads, self.kv_heads, self.head_dim, ps,
                       causal=True, **dtypes, **plan_options(kind))
        self._layer_wrappers = [wrappers[i] for i in self._kind_of]

    def graph_decode_wrappers(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last_page_len: torch.Tensor) -> list[Any]:
        """Decode wrappers for one CUDA graph, one per kind, its batch size B fixed at len(last_page_len).

        The int32 buffers are the caller's and must outlive the graph: kv_indptr [B + 1],
        kv_indices [at least the pages one step may list], last_page_len [B]. The kinds share
        them: each plan (`init_forward_with`) copies the same page table into them; the
        captured kernels read them there. Same kernel choice (tensor cores or not) as the eager
        decode wrappers.
        """
        import flashinfer

        return [
            flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=kv_indptr, paged_kv_indices_buffer=kv_indices,
                paged_kv_last_page_len_buffer=last_page_len,
            )
            for _ in self.kinds
        ]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        self.cache.write(layer, self.meta.out_slots, k, v)
        return self._layer_wrappers[layer].run(
            q, (self.cache.k[layer], self.cache.v[layer]), k_scale=self.cache.k_scale[layer], v_scale=self.cache.v_scale[layer]
        )
