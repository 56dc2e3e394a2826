"""The environment a worker process starts with: an allocator that keeps its memory.

A decode step allocates the same large temporaries (gathered K/V, attention
scores) every layer. glibc serves an allocation above its mmap threshold (at
most 32 MiB, adjusted as it goes) with a fresh mmap and returns it on free, so
every step pays page faults on tens of megabytes: measured 10x slower than the
copy itself for a 39 MB bf16 -> float32 conversion on this project's 2-core
machine. Two remedies, set here before the process starts (malloc reads them
once):
  * tcmalloc, preloaded when the machine has it (Debian's libtcmalloc-minimal4,
    which scripts/setup_env.sh installs where it can; vLLM's CPU guide
    recommends the same);
  * otherwise glibc told to keep what it allocated (fixed mmap and trim
    thresholds): as fast as tcmalloc on the attention temporaries alone, and
    3-15% behind it end to end (W2, W4 on the tiny benchmark model).
A variable the user already set is left alone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
# Fixed thresholds turn off glibc's dynamic mmap threshold: blocks up to 4 GiB come from
# the heap, and the heap is trimmed only past 16 GiB free at its top.
GLIBC_KEEP = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(16 << 30)}


def find_tcmalloc() -> str | None:
    for d in TCMALLOC_DIRS:
        for name in TCMALLOC_NAMES:
            path = Path(d) / name
            if path.is_file():
                return str(path)
    return None


def worker_env(base: Mapping[str, str] | None = None, tcmalloc: str | None = None) -> dict[str, str]:
    """base (default: os.environ) plus the allocator settings above."""
    env = dict(os.environ if base is None else base)
    preload = env.get("LD_PRELOAD", "")
    if tcmalloc and "tcmalloc" not in preload:
        env["LD_PRELOAD"] = f"{tcmalloc}:{preload}" if preload else tcmalloc
    if "tcmalloc" not in env.get("LD_PRELOAD", ""):
        for key, value in GLIBC_KEEP.items():
            env.setdefault(key, value)
    return env
