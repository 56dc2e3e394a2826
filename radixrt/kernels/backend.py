"""The attention backend contract: plan once per step, attend once per layer.

The model runner builds an `AttentionMetadata` for the step (which tokens are
new, where their KV goes, each request's page table row) and calls
`init_forward` once; every layer then calls `forward(q, k, v, layer)`, which
writes the new K/V into the paged cache and attends each new token over its
request's cached prefix plus the new tokens up to itself (causal, aligned to
the *end* of the sequence: new token i of a request with kv_len L sits at
position L - qo_len + i), or, for a request verifying a draft tree, over its
prefix plus the new tokens its tree mask names (AttentionMetadata.trees).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

import torch

from radixrt.kernels.kv_cache import PagedKVCache


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends, as its model family's config says.

    The score of query q against key k is `scale * (q . k)`; with `softcap`, it becomes
    `softcap * tanh(score / softcap)` (scale first, then the cap: transformers' Gemma 2
    order, and FlashInfer's `logits_soft_cap`); then the mask, then the softmax.

    `window` is the sliding window as Hugging Face configs give it (`sliding_window`):
    the query at position p sees KV positions p - window + 1 .. p, itself included, i.e.
    transformers 5's `sliding_window_overlay` (masking_utils.py: `kv_idx > q_idx -
    sliding_window`) ANDed with the causal mask. FlashInfer's `window_left` is window - 1.
    The window only narrows what a query reads: every page still holds the full KV.
    """

    scale: float  # multiplies q . k (head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5)
    window: int | None = None  # sliding window: a query sees the last `window` positions, itself included
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap) before the softmax

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"LayerAttention.scale must be > 0, got {self.scale}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"LayerAttention.window must be >= 1 (or None: no window), got {self.window}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"LayerAttention.softcap must be > 0 (or None: no cap), got {self.softcap}")

    def sees_all(self, kv_len: int) -> bool:
        """Whether a query at the end of a kv_len-token sequence reads all of it (no window cuts it)."""
        return self.window is None or kv_len <= self.window


def layer_kinds(layers: Sequence[LayerAttention]) -> tuple[list[LayerAttention], list[int]]:
    """The distinct LayerAttentions in first-seen order, and each layer's index into them:
    backends plan once per kind (usually two: sliding and full), not once per layer."""
    kinds: list[LayerAttention] = []
    for la in layers:
        if la not in kinds:
            kinds.append(la)
    return kinds, [kinds.index(la) for la in layers]


@dataclass
class AttentionMetadata:
    """One step's batch, requests in batch order (host lists, device tensors)."""

    qo_lens: list[int]  # new tokens per request
    kv_lens: list[int]  # tokens in the cache after this step (prefix + new)
    page_table: torch.Tensor  # [num_reqs, max_pages] int64 page ids of each request
    out_slots: torch.Tensor  # [num_tokens] int64 cache slot of each new token
    page_size: int
    # requests (indices into this batch) whose per-page attention mass take_page_mass reports
    mass_reqs: list[int] = field(default_factory=list)
    # requests verifying a draft tree: [qo_len, qo_len] bool, new row r sees new row c iff mask[r, c]
    # (every row sees the whole cached prefix). A row's position is the prefix length plus its row
    # count minus one (a draft's: the root's plus its depth). The others: causal, as above.
    trees: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.qo_lens)


class AttentionBackend(ABC):
    """Attention over a PagedKVCache. Not thread-safe; one per worker."""

    reports_attention_mass: bool = False  # whether take_page_mass is implemented (heavy-hitter retention)

    def __init__(self, cache: PagedKVCache, num_heads: int, head_dim: int, layers: Sequence[LayerAttention]) -> None:
        self.cache = cache
        self.num_heads = num_heads
        self.head_dim = head_dim
        if not isinstance(layers, Sequence) or not layers or not all(isinstance(la, LayerAttention) for la in layers):
            raise TypeError(f"layers must be a non-empty sequence of LayerAttention (one per model layer), got {layers!r:.200}")
        if len(layers) != len(cache.k):
            raise ValueError(f"{len(layers)} LayerAttentions for a KV cache of {len(cache.k)} layers: give one per layer")
        self.layers = tuple(layers)  # one per model layer

    @abstractmethod
    def init_forward(self, meta: AttentionMetadata) -> None:
        """Plan the step. `meta` stays valid until the next init_forward."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, heads, head_dim].

        Writes k, v into the cache at meta.out_slots first (mutates the cache).
        """

    def kernels_info(self) -> tuple[dict[str, str], str]:
        """Which kernel serves each shape class (decode, extend, cascade) and why, for the log and
        /get_server_info; ({}, why) where one path serves all."""
        return {}, f"{type(self).__name__}'s own kernels"

    def take_page_mass(self) -> list[torch.Tensor]:
        """The attention mass each KV page of the step's mass requests received.

        Call after the step's forward has run through all layers. One float32 tensor per
        entry of meta.mass_reqs, in that order, of shape [ceil(meta.kv_lens[i] / page_size)]
        (the KV after this step): element j sums, over this step's query rows of request i,
        over all query heads of this rank and over all layers, the softmax probability those
        queries put on the keys in page-table column j. A request's total is therefore
        qo_len * heads * num_layers. The tensors are the caller's; the next init_forward
        restarts the count. Raises NotImplementedError where reports_attention_mass is False.
        """
        raise NotImplementedError(f"{type(self).__name__} does not report attention mass (reports_attention_mass is False)")
