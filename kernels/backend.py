"""The attention backend contract: plan once per step, attend once per layer.

The model runner builds an `AttentionMetadata` for the step (which tokens are
new, where their KV goes, each request's page table row) and calls
`init_forward` once; every layer then calls `forward(q, k, v, layer)`, which
writes the new K/V into the paged cache and attends each new token over its
request's cached prefix plus the new tokens up to itself (causal, aligned to
the *end* of the sequence: new token i of a request with kv_len L sits at
position L - qo_len + i).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from radixrt.kernels.kv_cache import PagedKVCache


@dataclass
class AttentionMetadata:
    """One step's batch, requests in batch order (host lists, device tensors)."""

    qo_lens: list[int]  # new tokens per request
    kv_lens: list[int]  # tokens in the cache after this step (prefix + new)
    page_table: torch.Tensor  # [num_reqs, max_pages] int64 page ids of each request
    out_slots: torch.Tensor  # [num_tokens] int64 cache slot of each new token
    page_size: int

    @property
    def num_reqs(self) -> int:
        return len(self.qo_lens)


class AttentionBackend(ABC):
    """Attention over a PagedKVCache. Not thread-safe; one per worker."""

    def __init__(self, cache: PagedKVCache, num_heads: int, head_dim: int, scale: float) -> None:
        self.cache = cache
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def init_forward(self, meta: AttentionMetadata) -> None:
        """Plan the step. `meta` stays valid until the next init_forward."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, heads, head_dim].

        Writes k, v into the cache at meta.out_slots first (mutates the cache).
        """
