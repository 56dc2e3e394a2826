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

TorchBackend is the reference this is held to (tests/test_torch_backend.py
runs the same cases against both on a GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixrt.kernels.backend import AttentionBackend, AttentionMetadata
from radixrt.kernels.kv_cache import PagedKVCache

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partials)
TENSOR_CORE_GQA_GROUP = 4  # decode through the MMA kernel once the GQA group is this large (as SGLang)


class FlashInferBackend(AttentionBackend):
    def __init__(self, cache: PagedKVCache, num_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(cache, num_heads, head_dim, scale)
        device = cache.k[0].device
        if device.type != "cuda":
            raise ValueError("attention_backend 'flashinfer' needs a CUDA device; use 'torch' on CPU")
        import flashinfer  # optional: the `cuda` extra

        self.kv_heads = cache.k[0].shape[2]
        # The decode docstring asks for a zeroed workspace on first use.
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=num_heads // self.kv_heads >= TENSOR_CORE_GQA_GROUP
        )
        self._wrapper = self._decode

    def init_forward(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        dev, ps = meta.out_slots.device, meta.page_size
        kv_lens = torch.tensor(meta.kv_lens, dtype=torch.int32, device=dev)  # [B]
        n_pages = (kv_lens + ps - 1) // ps  # [B]
        kv_indptr = F.pad(torch.cumsum(n_pages, 0, dtype=torch.int32), (1, 0))  # [B + 1]
        cols = torch.arange(meta.page_table.shape[1], device=dev)
        kv_indices = meta.page_table[cols[None, :] < n_pages[:, None]].to(torch.int32)  # row-major: request by request
        last_page_len = (kv_lens - (n_pages - 1) * ps).to(torch.int32)  # [B], in [1, page_size]
        dtype = self.cache.k[0].dtype
        common = dict(q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scale)
        if all(n == 1 for n in meta.qo_lens):
            self._decode.plan(
                kv_indptr, kv_indices, last_page_len, self.num_heads, self.kv_heads, self.head_dim, ps, **common
            )
            self._wrapper = self._decode
        else:
            qo = torch.tensor(meta.qo_lens, dtype=torch.int32, device=dev)
            qo_indptr = F.pad(torch.cumsum(qo, 0, dtype=torch.int32), (1, 0))  # [B + 1]
            self._prefill.plan(
                qo_indptr, kv_indptr, kv_indices, last_page_len, self.num_heads, self.kv_heads, self.head_dim, ps,
                causal=True, **common,
            )
            self._wrapper = self._prefill

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        self.cache.write(layer, self.meta.out_slots, k, v)
        return self._wrapper.run(q, (self.cache.k[layer], self.cache.v[layer]))
