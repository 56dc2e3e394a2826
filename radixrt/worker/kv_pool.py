"""Sizing the KV pool once at start, from the real free memory or an explicit token count."""

from __future__ import annotations

import torch

from radixrt.config import ServerArgs

CUDA_DEFAULT_FRACTION = 0.88
CPU_DEFAULT_FRACTION = 0.3


def available_host_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def plan_num_pages(args: ServerArgs, bytes_per_token: int, device: torch.device) -> int:
    """Pages for the pool: max_total_tokens if given, else a fraction of free memory."""
    if args.max_total_tokens is not None:
        return args.max_total_tokens // args.page_size
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        fraction = args.mem_fraction_static or CUDA_DEFAULT_FRACTION
        # Weights are already loaded: static memory (weights + pool) stays within fraction * total.
        budget = fraction * total - (total - free)
    else:
        budget = (args.mem_fraction_static or CPU_DEFAULT_FRACTION) * available_host_bytes()
    pages = int(budget // (bytes_per_token * args.page_size))
    if pages < 1:
        raise ValueError(
            f"mem_fraction_static leaves no room for the KV pool ({budget / 2**30:.2f} GiB); raise it or set max_total_tokens"
        )
    return pages
