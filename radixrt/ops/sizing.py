"""The arithmetic of `radixrt estimate` (estimate.py): one rank's memory for a tp size, a kv dtype
and a pool, and whether it fits, with the worker's own formulas (radixrt/worker/kv_pool.py,
PagedKVCache.bytes_per_token). The rules and their approximations are in estimate.py's docstring."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from radixrt.kernels import PagedKVCache
from radixrt.models.config import ModelConfig
from radixrt.models.lora import lora_pool_bytes
from radixrt.models.parallel import TPGroup, rank_heads
from radixrt.settings.lora import LoraServing
from radixrt.utils.checkpoint_meta import TensorMeta
from radixrt.worker.kv_pool import page_table_bytes, pages_for_budget, pool_bytes

ACTIVATION_FRACTION = 0.12  # activation reserve: this share of a rank's weights (see estimate.py)
KV_MARGIN = Fraction(6, 5)  # the workload's KV cache is sized 20% above its average (a Fraction: exact pages)
REPLICATED = ("o_proj.bias", "down_proj.bias", ".gate.weight")  # row-parallel biases, MoE routers


@dataclass(frozen=True)
class Workload:
    """What the requests look like: avg_seq_len is prompt + output tokens of an average request;
    reusable_prefix_tokens the prefix tokens worth keeping in a host tier."""

    avg_seq_len: float
    reusable_prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.avg_seq_len > 0:
            raise ValueError(f"avg_seq_len must be > 0, got {self.avg_seq_len}")
        if self.reusable_prefix_tokens < 0:
            raise ValueError(f"reusable_prefix_tokens must be >= 0, got {self.reusable_prefix_tokens}")

    def pages(self, concurrency: int, page_size: int) -> int:
        """Pool pages for `concurrency` average requests, with KV_MARGIN."""
        return math.ceil(concurrency * math.ceil(self.avg_seq_len / page_size) * KV_MARGIN)

    def requests_in(self, num_pages: int, page_size: int) -> int:
        """Average requests a pool of num_pages holds at once (no margin)."""
        return num_pages // math.ceil(self.avg_seq_len / page_size)


@dataclass(frozen=True)
class Breakdown:
    """One rank's memory in bytes for one (tp size, kv dtype, pool) choice."""

    weight_bytes: int
    bytes_per_token: int
    num_pages: int
    kv_pool_bytes: int
    page_table_bytes: int
    activation_bytes: int
    lora_bytes: int = 0  # the LoRA adapter slots (--enable-lora; models/lora.py)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_pool_bytes + self.page_table_bytes + self.activation_bytes + self.lora_bytes


@dataclass(frozen=True)
class Sizer:
    """The model and the server settings that do not vary across the tp sizes and kv dtypes tried."""

    cfg: ModelConfig
    tensors: dict[str, TensorMeta]
    dtype: torch.dtype
    device: str
    page_size: int
    context_length: int
    mem_bytes: int
    lora: LoraServing | None = None

    def breakdown(self, tp_size: int, kv_dtype: str, concurrency: int, num_pages: int) -> Breakdown:
        """Rank 0 with a pool of num_pages beside a page table of `concurrency` rows (max_running_requests).
        Raises ValueError when the model does not split over tp_size."""
        weights = rank_weight_bytes(self.cfg, self.tensors, tp_size, self.dtype.itemsize)
        kv_heads = rank_heads(self.cfg, TPGroup(0, tp_size))[3]
        per_token = PagedKVCache.bytes_per_token(self.cfg.num_layers, kv_heads, self.cfg.head_dim, self.dtype, kv_dtype)
        lora = self.lora
        adapters = lora_pool_bytes(self.cfg, TPGroup(0, tp_size), lora.slots, lora.rank, lora.sites,
                                   self.dtype.itemsize) if lora is not None else 0
        return Breakdown(
            weights, per_token, num_pages, pool_bytes(num_pages, self.page_size, per_token),
            page_table_bytes(concurrency, self.context_length, self.page_size), int(weights * ACTIVATION_FRACTION),
            adapters,
        )  # fmt: skip

    def fits(self, b: Breakdown, tp_size: int) -> bool:
        """The server's sizing rule: the pool's pages fit beside the page table in what the weights
        and the activation reserve leave of this rank's share of the memory."""
        ranks_sharing = tp_size if self.device == "cpu" else 1  # CPU ranks share the host's RAM
        budget = self.mem_bytes / ranks_sharing - b.weight_bytes - b.activation_bytes - b.lora_bytes
        return pages_for_budget(budget, self.page_size, b.bytes_per_token, b.page_table_bytes) >= b.num_pages

    def max_concurrency(self, tp_size: int, kv_dtype: str, workload: Workload) -> int:
        """The largest concurrency whose workload-sized pool fits (0: not even one request)."""

        def holds(c: int) -> bool:
            return self.fits(self.breakdown(tp_size, kv_dtype, c, workload.pages(c, self.page_size)), tp_size)

        # invariant: holds(low), and nothing above high does (a request takes a page of >= page_size bytes)
        low, high = 0, self.mem_bytes // self.page_size
        while low < high:  # holds is monotone in c
            mid = (low + high + 1) // 2
            low, high = (mid, high) if holds(mid) else (low, mid - 1)
        return low

    def min_tp_size(self, kv_dtype: str, concurrency: int, num_pages: int) -> int | None:
        for tp in range(1, self.cfg.num_heads + 1):
            try:
                b = self.breakdown(tp, kv_dtype, concurrency, num_pages)
            except ValueError:  # the heads, vocabulary or MLP do not split over tp
                continue
            if self.fits(b, tp):
                return tp
        return None


def rank_weight_bytes(cfg: ModelConfig, tensors: dict[str, TensorMeta], tp_size: int, itemsize: int) -> int:
    """Bytes of rank 0's parameters at itemsize bytes per element (the sharding rule in the module
    docstring). Raises ValueError when the model does not split over tp_size."""
    tp = TPGroup(0, tp_size)
    _, q_heads, _, kv_heads = rank_heads(cfg, tp)  # raises for heads that do not split
    tp.split(cfg.vocab_size, "vocab_size")
    if cfg.moe is None or len(cfg.moe.layers) < cfg.num_layers:
        tp.split(cfg.intermediate_size, "intermediate_size")
    if cfg.moe is not None:
        tp.split(cfg.moe.intermediate_size, "moe_intermediate_size")
    kv_share = kv_heads / cfg.num_kv_heads
    qkv_share = (q_heads + 2 * kv_heads) / (cfg.num_heads + 2 * cfg.num_kv_heads)
    total = 0.0
    for name, meta in tensors.items():
        if "rotary_emb" in name or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue  # not parameters of the model (the tied head is the embedding)
        if "norm" in name or name.endswith(REPLICATED):
            share = 1.0
        elif ".k_proj." in name or ".v_proj." in name:
            share = kv_share
        elif ".qkv_proj." in name:
            share = qkv_share
        else:
            share = 1 / tp_size
        total += meta.numel * share
    return round(total * itemsize)


