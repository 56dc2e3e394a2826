"""Sizing the KV pool once at start, from the real free memory or an explicit token count.

The functions here are the one formula for KV memory: the worker sizes its pool and page
table with them, and `radixrt estimate` (radixrt/ops/estimate.py) predicts both with them.
"""

from __future__ import annotations

import math

import torch

from radixrt.config_views import PoolConfig

CUDA_DEFAULT_FRACTION = 0.88
CPU_DEFAULT_FRACTION = 0.3
PAGE_TABLE_DTYPE = torch.int64


def available_host_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def page_table_shape(max_running_requests: int, context_length: int, page_size: int) -> tuple[int, int]:
    """The worker's page table: one row per request slot, one column per page of the longest sequence
    (plus one: a row is read one page past a sequence's end)."""
    return max_running_requests, math.ceil(context_length / page_size) + 1


def page_table_bytes(max_running_requests: int, context_length: int, page_size: int) -> int:
    """Device bytes of the page table: small pages and long contexts make it a visible share of the pool."""
    rows, cols = page_table_shape(max_running_requests, context_length, page_size)
    return rows * cols * PAGE_TABLE_DTYPE.itemsize


def pool_bytes(num_pages: int, page_size: int, bytes_per_token: int) -> int:
    """Bytes of a pool of num_pages (one rank): its pages plus the zeroed padding page (radixrt/kernels/kv_cache.py)."""
    return (num_pages + 1) * page_size * bytes_per_token


def pages_for_budget(budget: float, page_size: int, bytes_per_token: int, table_bytes: int) -> int:
    """The most pages whose pool (padding page included) and the page table fit in budget bytes."""
    return int((budget - table_bytes) // (bytes_per_token * page_size)) - 1


def plan_num_pages(
    pool: PoolConfig, bytes_per_token: int, device: torch.device, context_length: int, ranks_sharing: int = 1
) -> int:
    """Pages for the pool: max_total_tokens if given, else what a fraction of free memory holds beside
    the page table. ranks_sharing: ranks whose pools and tables share this memory (CPU ranks share RAM)."""
    if pool.max_total_tokens is not None:
        return pool.max_total_tokens // pool.page_size
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        fraction = pool.mem_fraction_static or CUDA_DEFAULT_FRACTION
        # Weights are already loaded: static memory (weights + pool) stays within fraction * total.
        budget = fraction * total - (total - free)
    else:
        budget = (pool.mem_fraction_static or CPU_DEFAULT_FRACTION) * available_host_bytes()
    table = page_table_bytes(pool.max_running_requests, context_length, pool.page_size)
    pages = pages_for_budget(budget / ranks_sharing, pool.page_size, bytes_per_token, table)
    if pages < 1:
        raise ValueError(
            f"mem_fraction_static leaves no room for the KV pool ({budget / 2**30:.2f} GiB); raise it or set max_total_tokens"
        )
    return pages
