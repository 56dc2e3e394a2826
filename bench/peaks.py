"""This host's measured peaks, the roofs a benchmark's figures are read against.

  copy_gbps()                  a large torch copy (COPY_BYTES, read + write bytes counted)
  gemm_gflops(m, n, k, dtype)  F.linear of x [m, k] by a weight [n, k] (out [m, n]), that dtype
  host()                       the CPU's model name and its flags that matter to these kernels

Both are measured with torch's thread count at the time of the call (set it as the worker
does first: run_as_worker, then torch.set_num_threads), once per process and thread count
(functools.cache), and report the median of their timed repeats.

NOTE: the GEMM probe is cold. It cycles through copies of the weight that together exceed
COLD_BYTES, so each call streams its weight from memory as a model's layer does (a model's
weights, taken together, do not fit in the last-level cache); the same weight called again
and again would be read from cache, and at batch 1 its GEMV would look several times faster
than any model could run it. A model whose weights all fit in the cache (tiny) may beat it.

    .venv/bin/python bench/peaks.py [--threads N]    # prints this host's peaks
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from radixrt.kernels.native_build import cpu_flags

from radixrt.launch.worker_env import find_tcmalloc, worker_env

COPY_BYTES = 256 << 20  # well past any last-level cache: the copy runs at memory speed
COLD_BYTES = 256 << 20  # the GEMM probe's weights, all copies together
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
REPEATS = 9  # timed samples per figure; the median is reported
MIN_SAMPLE_S = 0.02  # a sample repeats its call until it lasts this long


def run_as_worker() -> None:
    """Re-run this script under the allocator a CPU worker starts with (radixrt/launch/worker_env.py),
    once: the figures are then the worker's. Call it first thing in main()."""
    if "RADIXRT_WORKER_ENV" not in os.environ:
        env = worker_env(tcmalloc=find_tcmalloc()) | {"RADIXRT_WORKER_ENV": "1"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def host() -> dict:
    """The CPU (lscpu's model name), which of FLAGS it has, and torch's threads: stored beside every figure."""
    name = "unknown"
    try:
        out = subprocess.run(["lscpu"], check=False, capture_output=True, text=True).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), name)
    except OSError:
        pass
    have = cpu_flags() or frozenset()
    return {"cpu": name, "flags": [f for f in FLAGS if f in have], "threads": torch.get_num_threads(),
            "cores": len(os.sched_getaffinity(0))}


def median_seconds(fn, calls: int, repeats: int = REPEATS) -> float:
    """The median over `repeats` samples of one call's time, each sample `calls` calls long."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def copy_gbps() -> float:
    """GB/s (1e9 bytes) of dst.copy_(src) over COPY_BYTES, counting the bytes read and the bytes written."""
    return _copy_gbps(torch.get_num_threads())


@functools.cache
def _copy_gbps(threads: int) -> float:
    src = torch.rand(COPY_BYTES // 4)  # float32; written once, so every page is committed
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst, not timed
    return 2 * COPY_BYTES / median_seconds(lambda: dst.copy_(src), calls=1) / 1e9


def gemm_gflops(m: int, n: int, k: int, dtype: torch.dtype) -> float:
    """GFLOP/s (2mnk per call) of F.linear(x [m, k], w [n, k]) in dtype, weights cold (see the docstring)."""
    return 2 * m * n * k / gemm_seconds(m, n, k, dtype) / 1e9


def gemm_seconds(m: int, n: int, k: int, dtype: torch.dtype) -> float:
    """Seconds of one such call: the median, measured once per process and thread count."""
    return _gemm_seconds(m, n, k, dtype, torch.get_num_threads())


@functools.cache
def _gemm_seconds(m: int, n: int, k: int, dtype: torch.dtype, threads: int) -> float:
    w = torch.rand(n, k).to(dtype)  # [out, in]
    copies = max(1, math.ceil(COLD_BYTES / (w.numel() * w.element_size())))
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    x = torch.rand(m, k).to(dtype)
    ws_cycle = itertools.cycle(ws)

    def call() -> None:
        F.linear(x, next(ws_cycle))

    for _ in range(copies):  # warm: kernel selection, and every copy's pages committed
        call()
    start = time.perf_counter()
    call()
    once = max(time.perf_counter() - start, 1e-7)
    calls = max(copies, math.ceil(MIN_SAMPLE_S / once))  # a sample passes over every copy at least once
    return median_seconds(call, calls)


def main() -> None:
    run_as_worker()
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(host())
    print(f"copy: {copy_gbps():.1f} GB/s (read + write)")
    for m in (1, 16, 64):
        for dtype in (torch.bfloat16, torch.float32):
            print(f"gemm m={m:2} n=4096 k=768 {str(dtype)[6:]:8}: {gemm_gflops(m, 4096, 768, dtype):7.1f} GFLOP/s")


if __name__ == "__main__":
    main()
