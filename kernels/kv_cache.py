"""The paged KV storage: per layer one K and one V tensor of fixed-size pages.

A token's KV lives at a *slot*: `page_id * page_size + offset`. The scheduler
decides which pages a request owns; this class only stores bytes. One extra,
zeroed page past the pool (`pad_slot`) is what padded reads point at: the
pool itself is uninitialized memory, and a masked position still multiplies
its value by 0, which is NaN if the garbage was NaN.
"""

from __future__ import annotations

import torch


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_pages = num_pages  # usable pages; page `num_pages` is the zeroed padding page
        self.page_size = page_size
        self.pad_slot = num_pages * page_size
        shape = (num_pages + 1, page_size, num_kv_heads, head_dim)
        # NOTE: torch.empty, not zeros: a large pool is then committed by the OS
        # page by page as it is written. Only the padding page is zeroed.
        # k[layer], v[layer]: [num_pages + 1, page_size, kv_heads, head_dim]
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for buf in self.k + self.v:
            buf[num_pages].zero_()

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' K/V. slots: [T] int64; k, v: [T, kv_heads, head_dim]."""
        self.k[layer].view(-1, *k.shape[1:])[slots] = k.to(self.k[layer].dtype)
        self.v[layer].view(-1, *v.shape[1:])[slots] = v.to(self.v[layer].dtype)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather K/V at slots (any shape S) -> two tensors [*S, kv_heads, head_dim]."""
        k_flat = self.k[layer].view(-1, *self.k[layer].shape[2:])
        v_flat = self.v[layer].view(-1, *self.v[layer].shape[2:])
        return k_flat[slots], v_flat[slots]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V from slots src to slots dst (copy-on-write of a page)."""
        for layer in range(len(self.k)):
            for buf in (self.k[layer], self.v[layer]):
                flat = buf.view(-1, *buf.shape[2:])
                flat[dst] = flat[src]
